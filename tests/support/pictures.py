"""Models, plans and a console for the tests of the layout picture, memory bars and treescope."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from rich.console import Console

import flax_escale as fe
from flax_escale import linen as fel


@fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate"), "bias": ("mlp_intermediate",)})
class Up(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(64, 256, rngs=rngs)


def dense():
    return nn.Dense(
        6,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        ),
    )


def render(renderable, width=100):
    console = Console(record=True, width=width)
    console.print(renderable)
    return console.export_text()


@functools.cache
def optimizer_plan():
    # A Linen train state: params/..., opt_state/... (Adam's two moments and count), step.
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    dense = nn.Dense(
        256,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        ),
    )
    state = fel.init_train_state(
        dense, mesh, jax.random.key(0), jnp.ones((2, 64)), tx=optax.adam(1e-3)
    )
    return fe.sharding_report(state, show=False).plan
