"""What the mixture-of-experts examples share: configurations, rules and the training loop."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import backend_choice
import jax
import toy_data

import flax_escale as fe
from flax_escale import moe

RULES = fe.PartitionAxis(ep_as_fsdp=True)
"""Outside the experts, ``ep`` splits the batch and the other weights as ``fsdp`` does."""

MOE_AXES = {
    "router": ("hidden_state", "expert_gate"),
    "wi_gate": moe.EXPERT_AXES["wi_gate"],
    "wi_up": moe.EXPERT_AXES["wi_up"],
    "wo": moe.EXPERT_AXES["wo"],
}
"""The MoE layer's parameters: the router's kernel, and the experts' on ``expert`` first."""

EXPERT_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", 1, 2, 0)
"""Each expert initialized as its own dense layer: the fan-in is the kernels' middle dimension."""


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4  # the NNX example's grouped-query attention reads it; Linen's has none
    head_dim: int = 16
    mlp: int = 64  # each expert's intermediate size
    experts: int = 8
    top_k: int = 2
    shared_experts: int = 0  # always-on experts of the same size beside the routed ones
    layers: int = 2
    max_len: int = 32
    rope_base: float = 10_000.0
    strategy: moe.Strategy = "capacity"
    capacity_factor: float = 1.25
    exchange: moe.Exchange = "all_to_all"
    aux_loss_weight: float = 0.01
    # The dense examples' attention reads it: the MoE examples leave attention to XLA.
    context_parallel: str | None = None

    def dispatch(self) -> dict[str, Any]:
        """``moe_mlp``'s strategy with its own option (it refuses the other strategy's)."""
        if self.strategy == "capacity":
            return {"strategy": "capacity", "capacity_factor": self.capacity_factor}
        return {"strategy": self.strategy, "exchange": self.exchange}


# Mixtral 8x7B: 8 experts of 14,336, two per token, grouped-query attention with 8 KV heads.
MIXTRAL_8X7B = Config(
    vocab=32_000,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    mlp=14_336,
    experts=8,
    top_k=2,
    layers=32,
    max_len=4096,
    rope_base=1e6,
)
# DeepSeekMoE 16B: many small experts (64 of 1,408, six per token) and two shared ones.
DEEPSEEK_MOE_16B = Config(
    vocab=102_400,
    hidden=2048,
    heads=16,
    kv_heads=16,
    head_dim=128,
    mlp=1408,
    experts=64,
    top_k=6,
    shared_experts=2,
    layers=28,
    max_len=4096,
)
# DeepSeek-style proportions at a size the planner compiles quickly for 64 devices.
MANY_SMALL_EXPERTS = Config(
    hidden=256,
    heads=8,
    kv_heads=8,
    head_dim=32,
    mlp=128,
    experts=64,
    top_k=6,
    shared_experts=2,
    layers=2,
    max_len=64,
)
SMALL = Config()
CONFIGS = {
    "small": SMALL,
    "many-small-experts": MANY_SMALL_EXPERTS,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "deepseek-moe-16b": DEEPSEEK_MOE_16B,
}


def command_line(description: str, argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    """The examples' options, and the small configuration with the dispatch they choose."""
    parser = argparse.ArgumentParser(description=description)
    backend_choice.add_devices_argument(parser)
    parser.add_argument(
        "--mesh",
        default=None,
        help="sizes of dp,fsdp,ep,tp,sp (default 1,2,4,1,1 on cpu, 1,1,-1,1,1 on accelerators)",
    )
    parser.add_argument("--strategy", choices=moe.STRATEGIES, default="capacity")
    # No defaults here: an option of the other strategy is refused rather than ignored.
    parser.add_argument(
        "--exchange",
        choices=("all_to_all", "ragged_all_to_all"),
        help="the dropless strategy's token exchange (default all_to_all)",
    )
    parser.add_argument(
        "--capacity-factor",
        type=float,
        help="the capacity strategy's slots per expert, over the even share (default 1.25)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    other = "--exchange" if args.strategy == "capacity" else "--capacity-factor"
    if (args.exchange if args.strategy == "capacity" else args.capacity_factor) is not None:
        parser.error(f"{other} is not an option of --strategy {args.strategy}")
    chosen = {"exchange": args.exchange, "capacity_factor": args.capacity_factor}
    given = {name: value for name, value in chosen.items() if value is not None}
    return args, dataclasses.replace(SMALL, strategy=args.strategy, **given)


def mesh_of(args: argparse.Namespace, devices: list[jax.Device]) -> jax.sharding.Mesh:
    """``--mesh``, or the default: ``fsdp=2 x ep=4`` on CPU, every device on ``ep`` else."""
    text = args.mesh or ("1,2,4,1,1" if args.devices == "cpu" else "1,1,-1,1,1")
    return fe.parse_mesh_from_string(text, fe.mesh.DEFAULT_AXIS_NAMES, devices=devices)


def train(
    step: Callable[[Any, jax.Array], tuple[Any, tuple[jax.Array, jax.Array]]],
    state: Any,
    config: Config,
    args: argparse.Namespace,
    mesh: jax.sharding.Mesh,
) -> list[float]:
    """Runs ``step(state, tokens) -> (state, (loss, dropped))``; prints and returns losses."""
    losses = []
    data = toy_data.batches(config.vocab, args.batch, config.max_len)
    assignments = args.batch * config.max_len * config.top_k * config.layers
    with fe.use_sharding(mesh, RULES):
        for i in range(args.steps):
            tokens = fe.constrain(next(data), ("batch", "sequence"))
            start = time.perf_counter()
            state, (loss, dropped) = step(state, tokens)
            losses.append(float(loss))
            if i % 5 == 0 or i == args.steps - 1:
                ms = (time.perf_counter() - start) * 1e3
                print(
                    f"step {i:3d}  loss {losses[-1]:.4f}  dropped {int(dropped)} of "
                    f"{assignments}  ({ms:.0f} ms)"
                )
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    return losses
