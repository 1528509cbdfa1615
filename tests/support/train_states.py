"""A Linen TrainState as a user lays it out on a mesh nothing runs on (shapes and shardings)."""

import jax
import jax.numpy as jnp
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe


def abstract_train_state(workload, mesh, params):
    """``params`` (abstract, with shardings), the optimizer state following them, a step."""
    opt_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(workload.tx.init, params),
        fe.opt_state_shardings(workload.tx, params),
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return TrainState(
        step=step, apply_fn=workload.model.apply, params=params, tx=workload.tx, opt_state=opt_state
    )
