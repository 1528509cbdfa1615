"""init_sharded and training across 2 real processes x 4 devices equal the 8-device run."""

import jax
import numpy as np
import pytest
from support.distributed import run_processes

pytestmark = pytest.mark.multiprocess

MODEL = """
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax_escale as fe
from flax_escale import linen as fel


@fe.sharded_module({"wi/kernel": ("hidden_state", "mlp_intermediate"),
                     "wo/kernel": ("mlp_intermediate", "hidden_state")})
class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, use_bias=False, name="wi")(x))
        h = fe.constrain(h, ("batch", "mlp_intermediate"))
        return nn.Dense(16, use_bias=False, name="wo")(h)


# dp spans the processes on the hybrid mesh: it goes first so each process loads one range.
RULES = fe.PartitionAxis(batch_axis=("dp", "fsdp"))


def train(mesh):
    shape = (16, 16)
    data = np.random.default_rng(0).standard_normal((3, *shape)).astype(np.float32)
    sharding = fe.batch_sharding(mesh, shape, ("batch", None), rules=RULES)
    rows = fe.process_batch_slice(sharding, shape)
    state = fel.init_train_state(Mlp(), mesh, jax.random.key(0), jnp.zeros(shape),
                                 tx=optax.sgd(0.1), rules=RULES)

    @jax.jit
    def step(state, x):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    with fe.use_sharding(mesh, RULES):
        for batch in data:
            x = fe.host_local_to_global(batch[rows], sharding, shape)
            state, loss = step(state, x)
            losses.append(float(loss))
    specs = jax.tree.map(lambda a: a.sharding.spec, state.params)
    gather = fe.sharding.make_shard_and_gather_fns(specs, mesh)[1]
    params = jax.tree.map(lambda f, a: f(a).tolist(), gather, state.params)
    return {"losses": losses, "params": params,
            "addressable": len(state.params["wi"]["kernel"].addressable_shards)}
"""


@pytest.mark.parametrize("dims", [(1, 8, 1, 1, 1), (2, 2, 1, 2, 1)], ids=str)
def test_two_processes_train_like_one(dims):
    results = run_processes(MODEL + f"\nresult = train(fe.create_mesh({dims}))\n")
    namespace: dict = {}
    exec(MODEL, namespace)
    import flax_escale as fe

    single = namespace["train"](fe.create_mesh(dims))
    for result in results:
        assert result["addressable"] == 4
        np.testing.assert_allclose(result["losses"], single["losses"], rtol=1e-6)
        for got, want in zip(
            jax.tree.leaves(result["params"]), jax.tree.leaves(single["params"]), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert results[0]["params"] == results[1]["params"]
    assert single["losses"][-1] < single["losses"][0]
