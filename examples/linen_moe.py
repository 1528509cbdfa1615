"""A mixture-of-experts decoder in Flax Linen, its experts split over ``ep``, trained sharded.

Run it with ``python examples/linen_moe.py``: on 8 simulated CPU devices, a 1 x 2 x 4
dp x fsdp x ep mesh. Every layer's MLP is a set of SwiGLU experts behind a top-k router with a
load-balancing loss (DeepSeek-style shapes add always-on shared experts beside them); the
experts' kernels are annotated ``(expert, hidden_state, mlp_intermediate)``, so they live on
``ep`` and the rest of each kernel where any weight's goes. ``--strategy`` picks the dispatch
(see :func:`flax_escale.moe.moe_mlp`): ``capacity`` (the default; tokens beyond each expert's
slots are dropped, and the count is printed) or ``dropless``. The rules are
``PartitionAxis(ep_as_fsdp=True)``: outside the experts ``ep`` splits the batch and the other
weights as ``fsdp`` does. ``moe_config`` holds the configurations, Mixtral 8x7B's and
DeepSeekMoE 16B's among them for compile-only measurements (``bench/b10_moe.py``).
"""

from __future__ import annotations

import backend_choice
import flax.linen as nn
import jax
import jax.numpy as jnp
import moe_config
import optax
from flax.training.train_state import TrainState
from linen_gpt import ACTIVATION, Attention, embed, scanned
from moe_config import EXPERT_INIT, MOE_AXES, RULES, SMALL, Config

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import moe
from flax_escale.sizing import Workload


@fe.sharded_module(MOE_AXES)
class Moe(nn.Module):
    """Routed SwiGLU experts (and shared ones): returns the output, aux loss, dropped count."""

    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        c = self.config
        expert_in, expert_out = (c.experts, c.hidden, c.mlp), (c.experts, c.mlp, c.hidden)
        experts = moe.GatedExperts(
            self.param("wi_gate", EXPERT_INIT, expert_in),
            self.param("wi_up", EXPERT_INIT, expert_in),
            self.param("wo", EXPERT_INIT, expert_out),
        )
        router = self.param("router", nn.initializers.lecun_normal(), (c.hidden, c.experts))
        routed = moe.moe_mlp(
            x,
            router,
            experts,
            top_k=c.top_k,
            **c.dispatch(),
        )
        out = routed.output
        if c.shared_experts:
            out = out + SharedExperts(c, name="shared")(x)
        return out, routed.aux_loss, routed.dropped


@fe.sharded_module(
    {
        "(gate|up)/kernel": ("hidden_state", "mlp_intermediate"),
        "down/kernel": ("mlp_intermediate", "hidden_state"),
    }
)
class SharedExperts(nn.Module):
    """The experts every token goes to: one SwiGLU as wide as all of them together."""

    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        width = c.shared_experts * c.mlp
        gate = nn.Dense(width, use_bias=False, name="gate")(x)
        up = nn.Dense(width, use_bias=False, name="up")(x)
        h = fe.constrain(jax.nn.silu(gate) * up, ("batch", "sequence", "mlp_intermediate"))
        return nn.Dense(c.hidden, use_bias=False, name="down")(h)


@fe.sharded_module({"(scale|bias)": ("hidden_state",)})
class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        x = x + Attention(self.config, name="attention")(nn.RMSNorm(name="ln_attention")(x))
        y, aux_loss, dropped = Moe(self.config, name="moe")(nn.RMSNorm(name="ln_moe")(x))
        return fe.constrain(x + y, ACTIVATION), (aux_loss, dropped)


@fe.sharded_module(
    {
        "token/embedding": ("vocab", "hidden_state"),
        "position/embedding": (None, "hidden_state"),
        "ln_final/scale": ("hidden_state",),
        "head/kernel": ("hidden_state", "vocab"),
    }
)
class MoeDecoder(nn.Module):
    """Returns the logits, the mean load-balancing loss and the dropped assignments."""

    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        c = self.config
        _, x = embed(c, tokens)
        x, (aux_loss, dropped) = scanned(Block, c.layers)(c, name="blocks")(x, None)
        logits = nn.Dense(c.vocab, use_bias=False, name="head")(nn.RMSNorm(name="ln_final")(x))
        return fe.constrain(logits, ("batch", "sequence", "vocab")), aux_loss.mean(), dropped.sum()


def loss_fn(params, apply_fn, tokens, aux_loss_weight):
    logits, aux_loss, dropped = apply_fn({"params": params}, tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss + aux_loss_weight * aux_loss, (loss, dropped)


@jax.jit
def train_step(
    state: TrainState, tokens: jax.Array, aux_loss_weight: float = 0.01
) -> tuple[TrainState, tuple[jax.Array, jax.Array]]:
    """One AdamW step; returns the new state, and the cross-entropy and dropped assignments."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, metrics), grads = grad_fn(state.params, state.apply_fn, tokens, aux_loss_weight)
    return state.apply_gradients(grads=grads), metrics


def workload(config: Config = SMALL, batch: int = 16) -> Workload:
    """The model, AdamW and ``train_step``, with ``ep`` splitting the batch outside experts.

    ``python -m flax_escale plan linen_moe:workload --devices 8`` (from ``examples/``) ranks
    the meshes of 8 devices, ``ep`` ones among them.
    """
    return Workload(
        MoeDecoder(config),
        jax.random.key(0),
        (jax.ShapeDtypeStruct((batch, config.max_len), jnp.int32),),
        tx=optax.adamw(3e-3),
        rules=RULES,
        batch=(jax.ShapeDtypeStruct((batch, config.max_len + 1), jnp.int32),),
        step=train_step,
    )


def main(argv: list[str] | None = None) -> list[float]:
    args, config = moe_config.command_line(__doc__.splitlines()[0], argv)
    devices = backend_choice.select_devices(args.devices)  # before any backend starts
    print(backend_choice.describe(devices))
    with jax.default_device(devices[0]):
        mesh = moe_config.mesh_of(args, devices)
        model = MoeDecoder(config)
        rng = jax.random.key(0)
        example = jnp.zeros((args.batch, config.max_len), jnp.int32)
        print(fe.plan_sharding(model, mesh, rng, example, rules=RULES).describe())
        tx = optax.adamw(3e-3)
        state = fel.init_train_state(model, mesh, rng, example, tx=tx, rules=RULES)
        weight = config.aux_loss_weight
        return moe_config.train(
            lambda state, tokens: train_step(state, tokens, weight), state, config, args, mesh
        )


if __name__ == "__main__":
    main()
