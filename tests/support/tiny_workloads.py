"""A tiny Linen workload planned on 2 simulated devices, for the tests of the planner's mistakes."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from flax_escale import sizing


class Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        return x @ self.param("w", init, (x.shape[-1], 32))


X = jax.ShapeDtypeStruct((8, 16), jnp.float32)


def workload(**options):
    return sizing.Workload(Tiny(), jax.random.key(0), (X,), tx=optax.sgd(0.1), **options)


def nnx_workload(**options):
    return sizing.Workload(
        lambda rngs: nnx.Linear(16, 32, rngs=rngs),
        0,
        tx=optax.sgd(0.1),
        batch=(X,),
        **options,
    )


def plan(built=None, **options):
    """Plans ``built`` (the tiny workload by default) on 2 devices, no cache."""
    options = {"devices": 2, "memory": "1MiB", "axes": ("fsdp",), "cache": False, **options}
    return sizing.plan_mesh(workload() if built is None else built, **options)


@functools.cache
def planned():
    """One plan of the tiny workload, for the cases of its results."""
    return plan()


# What a step or loss returns is checked as the step traces, on every mesh; the planner then
# raises what went wrong as the workload's error.
FAILED = r"traced on none of the 1 meshes tried"
