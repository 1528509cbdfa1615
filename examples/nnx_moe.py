"""A mixture-of-experts decoder in Flax NNX, its experts split over ``ep``, trained sharded.

Run it with ``python examples/nnx_moe.py``: on 8 simulated CPU devices, a 1 x 2 x 4
dp x fsdp x ep mesh. The decoder is ``nnx_llama``'s (RMSNorm, rotary grouped-query attention,
a layer stack run with ``nnx.scan``) with each MLP replaced by SwiGLU experts behind a top-k
router, plus shared experts for DeepSeek-style shapes; the dispatch and the rules are those of
``linen_moe`` (``--strategy capacity`` or ``dropless``, ``PartitionAxis(ep_as_fsdp=True)``),
from the same :mod:`flax_escale.moe` functions.
"""

from __future__ import annotations

import backend_choice
import jax
import jax.numpy as jnp
import moe_config
import optax
from flax import nnx
from moe_config import EXPERT_INIT, MANY_SMALL_EXPERTS, MOE_AXES, RULES, SMALL, Config
from nnx_llama import ACTIVATION, DECODER_AXES, Attention, lookup

import flax_escale as fe
from flax_escale import moe
from flax_escale import nnx as fen
from flax_escale.sizing import Workload


@fe.sharded_module(
    {
        "(gate|up)/kernel": ("hidden_state", "mlp_intermediate"),
        "down/kernel": ("mlp_intermediate", "hidden_state"),
    }
)
class SharedExperts(nnx.Module):
    """The experts every token goes to: one SwiGLU as wide as all of them together."""

    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        width = c.shared_experts * c.mlp
        self.gate = nnx.Linear(c.hidden, width, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.hidden, width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(width, c.hidden, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate(x)) * self.up(x)
        return self.down(fe.constrain(h, ("batch", "sequence", "mlp_intermediate")))


@fe.sharded_module(MOE_AXES)
class Moe(nnx.Module):
    """Routed SwiGLU experts (and shared ones): returns the output, aux loss, dropped count."""

    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.c = c
        expert_in, expert_out = (c.experts, c.hidden, c.mlp), (c.experts, c.mlp, c.hidden)
        router = jax.nn.initializers.lecun_normal()
        self.router = nnx.Param(router(rngs.params(), (c.hidden, c.experts)))
        self.wi_gate = nnx.Param(EXPERT_INIT(rngs.params(), expert_in))
        self.wi_up = nnx.Param(EXPERT_INIT(rngs.params(), expert_in))
        self.wo = nnx.Param(EXPERT_INIT(rngs.params(), expert_out))
        self.shared = SharedExperts(c, rngs=rngs) if c.shared_experts else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        c = self.c
        routed = moe.moe_mlp(
            x,
            self.router[...],
            moe.GatedExperts(self.wi_gate[...], self.wi_up[...], self.wo[...]),
            top_k=c.top_k,
            **c.dispatch(),
        )
        out = routed.output if self.shared is None else routed.output + self.shared(x)
        return out, routed.aux_loss, routed.dropped


@fe.sharded_module({"scale": ("hidden_state",)})
class Block(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.attention = Attention(c, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.moe = Moe(c, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        x = x + self.attention(self.attention_norm(x))
        y, aux_loss, dropped = self.moe(self.moe_norm(x))
        return fe.constrain(x + y, ACTIVATION), aux_loss, dropped


@fe.sharded_module(DECODER_AXES)
class MoeDecoder(nnx.Module):
    """Returns the logits, the mean load-balancing loss and the dropped assignments."""

    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.hidden, rngs=rngs)
        self.blocks = fen.stack_layers(lambda rngs: Block(c, rngs=rngs), c.layers, rngs)
        self.final_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden, c.vocab, use_bias=False, rngs=rngs)
        self.aux_loss_weight = c.aux_loss_weight

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        x = lookup(self.embed, tokens)

        @nnx.scan(
            in_axes=(nnx.Carry, 0),
            out_axes=(nnx.Carry, 0, 0),
            transform_metadata=fen.stacked(),
        )
        def run(x: jax.Array, block: Block) -> tuple[jax.Array, jax.Array, jax.Array]:
            return block(x)

        x, aux_loss, dropped = run(x, self.blocks)
        logits = self.lm_head(self.final_norm(x))
        return fe.constrain(logits, ("batch", "sequence", "vocab")), aux_loss.mean(), dropped.sum()


def loss_fn(model: MoeDecoder, tokens: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    logits, aux_loss, dropped = model(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss + model.aux_loss_weight * aux_loss, (loss, dropped)


@nnx.jit
def train_step(
    model: MoeDecoder, optimizer: nnx.Optimizer, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One AdamW step; returns the cross-entropy and the dropped assignments."""
    (_, (loss, dropped)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
    optimizer.update(model, grads)
    return loss, dropped


def workload(config: Config = SMALL, batch: int = 16) -> Workload:
    """The model, AdamW and ``train_step``, with ``ep`` splitting the batch outside experts.

    ``python -m flax_escale plan nnx_moe:workload --devices 8`` (from ``examples/``) ranks
    the meshes of 8 devices, ``ep`` ones among them.
    """
    return Workload(
        MoeDecoder,
        0,
        (config,),
        tx=optax.adamw(3e-3),
        rules=RULES,
        batch=(jax.ShapeDtypeStruct((batch, config.max_len + 1), jnp.int32),),
        step=train_step,
    )


def workload_64() -> Workload:
    """DeepSeek-style proportions (64 experts, six per token, two shared) for 64 devices.

    ``python -m flax_escale plan nnx_moe:workload_64 --devices 64`` (from ``examples/``)
    ranks the meshes of 64 devices, ``ep`` ones among them.
    """
    return workload(MANY_SMALL_EXPERTS, batch=64)


def main(argv: list[str] | None = None) -> list[float]:
    args, config = moe_config.command_line(__doc__.splitlines()[0], argv)
    devices = backend_choice.select_devices(args.devices)  # before any backend starts
    print(backend_choice.describe(devices))
    with jax.default_device(devices[0]):
        mesh = moe_config.mesh_of(args, devices)
        print(fe.plan_sharding(MoeDecoder, mesh, 0, config, rules=RULES).describe())
        model = fe.init_sharded(MoeDecoder, mesh, 0, config, rules=RULES)
        optimizer = fen.init_optimizer(model, optax.adamw(3e-3))
        return moe_config.train(
            lambda state, tokens: (state, train_step(*state, tokens)),
            (model, optimizer),
            config,
            args,
            mesh,
        )


if __name__ == "__main__":
    main()
