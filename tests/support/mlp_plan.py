"""A small Linen MLP and its plan, for the tests of plan diffs, plan JSON and snapshots."""

import warnings

import flax.linen as nn
import jax.numpy as jnp

import flax_escale as fe

X = jnp.ones((2, 8))


class Mlp(nn.Module):
    width: int = 32
    extra: bool = False

    @nn.compact
    def __call__(self, x):
        def init(names):
            return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

        x = nn.Dense(self.width, kernel_init=init(("hidden_state", "mlp_intermediate")))(x)
        if self.extra:
            x = nn.Dense(self.width, name="extra")(x)
        return nn.Dense(8, kernel_init=init(("mlp_intermediate", "hidden_state")))(x)


def mlp_plan(model=None, mesh=(1, 4, 1, 2, 1), **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        return fe.plan_sharding(model or Mlp(), fe.create_mesh(mesh), 0, X, **kwargs)
