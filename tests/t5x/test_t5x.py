"""A t5x-style training program runs on flax_escale.t5x with only its imports changed.

``t5x_program`` is written the way t5x's documentation describes a partitioned training loop:
build the partitioner, ask it for the logical and mesh axes of an ``eval_shape``'d train state,
partition the initialization and a train step with in/out axis resources (``donate_argnums``
included), compile, lay out the data per host, and chunk arrays with ``LocalChunker``. Nothing in
it is specific to this library but the import below; in t5x that import reads
``from t5x.partitioning import PjitPartitioner as Partitioner, AxisNames, DataLayout, ...``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding, PartitionSpec
from support.lowered import sharding_constraints

import flax_escale.t5x
from flax_escale.t5x import (
    AxisNames,
    DataLayout,
    LocalChunker,
    LocalChunkInfo,
    Partitioner,
    standard_logical_axis_rules,
)

EMBED, MLP, BATCH = 16, 32, 8
INIT = nn.initializers.normal(0.1)


class MlpBlock(nn.Module):
    """A T5 MLP block with t5x's logical axis names."""

    @nn.compact
    def __call__(self, x):
        wi = self.param("wi", nn.with_logical_partitioning(INIT, ("embed", "mlp")), (EMBED, MLP))
        h = nn.with_logical_constraint(nn.relu(x @ wi), ("batch", "mlp"))
        wo = self.param("wo", nn.with_logical_partitioning(INIT, ("mlp", "embed")), (MLP, EMBED))
        return h @ wo


def t5x_program(partitioner, steps=3):
    """A t5x training loop; returns what a test looks at."""
    model, tx = MlpBlock(), optax.adam(1e-2)

    def init_train_state(rng):
        params = model.init(rng, jnp.ones((BATCH, EMBED)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch) - batch) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    abstract_state = jax.eval_shape(init_train_state, jax.random.key(0))
    logical_axes = partitioner.get_logical_axes(abstract_state)
    state_axes = partitioner.get_mesh_axes(abstract_state)
    p_init = partitioner.partition(
        init_train_state, in_axis_resources=None, out_axis_resources=state_axes
    )
    state = p_init(jax.random.key(0))
    p_train_step = partitioner.partition(
        train_step,
        in_axis_resources=(state_axes, partitioner.data_partition_spec),
        out_axis_resources=(state_axes, None),
        donate_argnums=(0,),
    )
    batch_struct = jax.ShapeDtypeStruct((BATCH, EMBED), jnp.float32)
    compiled_step = partitioner.compile(p_train_step, abstract_state, batch_struct)

    # Each host loads its own part of the global batch, as a t5x input pipeline does.
    layout = partitioner.get_data_layout(BATCH)
    rows = layout.batch_size // layout.num_shards
    data = np.random.default_rng(0).standard_normal((BATCH, EMBED)).astype(np.float32)
    host_rows = data[layout.shard_id * rows : (layout.shard_id + 1) * rows]
    chunk = LocalChunker(partitioner.mesh).get_local_chunk_info(
        data.shape, partitioner.data_partition_spec
    )
    losses = []
    for _ in range(steps):
        state, loss = compiled_step(state, host_rows)
        losses.append(float(loss))
    return {
        "logical_axes": logical_axes,
        "state_axes": state_axes,
        "state": state,
        "losses": losses,
        "layout": layout,
        "default_layout": partitioner.get_data_layout(),
        "chunk": chunk,
        "lowered": p_train_step.lower(abstract_state, batch_struct).as_text(),
        "reference": _unsharded_losses(init_train_state, train_step, data, steps),
    }


def _unsharded_losses(init_train_state, train_step, data, steps):
    state, losses = jax.jit(init_train_state)(jax.random.key(0)), []
    step = jax.jit(train_step)
    for _ in range(steps):
        state, loss = step(state, data)
        losses.append(float(loss))
    return losses


# (partitioner arguments, data mesh size, the batch's spec, the (batch, mlp) constraint)
CONFIGS = {
    # On CPU t5x's default mesh is processes x local devices: data 1, model 8.
    "num_partitions": ({"num_partitions": 1}, 1, PartitionSpec("data"), '[{"data"}, {"model"}]'),
    "ici_dcn": (
        {"ici_mesh_shape": (1, 4, 2), "dcn_mesh_shape": (1, 1, 1)},
        4,
        PartitionSpec(("replica", "data")),
        '[{"replica", "data"}, {"model"}]',
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_t5x_program_runs_changed_only_in_its_imports(devices, config):
    kwargs, data_size, batch_spec, constraint = CONFIGS[config]
    partitioner = Partitioner(**kwargs)
    out = t5x_program(partitioner)

    # Logical axes: AxisNames that compare equal to PartitionSpecs, None where there are none.
    logical = out["logical_axes"]
    assert logical.params["wi"] == PartitionSpec("embed", "mlp")
    assert logical.params["wo"] == AxisNames("mlp", "embed")
    assert logical.opt_state[0].mu["wi"] == PartitionSpec("embed", "mlp")
    assert logical.step is None
    # Mesh axes: t5x's standard rules (embed unsharded, mlp over model).
    specs = out["state_axes"]
    mesh = partitioner.mesh
    model_size = mesh.shape["model"]
    assert specs.params["wi"] == PartitionSpec(None, "model")
    assert specs.opt_state[0].nu["wo"] == PartitionSpec("model", None)
    wi = nn.unbox(out["state"].params)["wi"]
    assert wi.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "model")), 2)
    assert wi.addressable_shards[0].data.shape == (EMBED, MLP // model_size)
    # The same numbers as the unsharded program, and it trains.
    np.testing.assert_allclose(out["losses"], out["reference"], rtol=1e-5)
    assert out["losses"][-1] < out["losses"][0]
    # The activation constraint inside the step is in the program (t5x's `with mesh:` drops it).
    found = sharding_constraints(out["lowered"])
    assert (constraint, f"{BATCH}x{MLP}xf32") in found, found
    # Data: one process loads the whole batch; without a batch size, one row per data device.
    assert partitioner.data_partition_spec == batch_spec
    assert partitioner.data_mesh_size == data_size
    assert out["layout"] == DataLayout(BATCH, 0, 1, True)
    assert out["default_layout"] == DataLayout(data_size, 0, 1, True)
    assert out["chunk"] == LocalChunkInfo((slice(0, BATCH), slice(None)), 0)


def test_param_with_axes_state_and_its_optimizer_state(devices):
    # t5x's own models name parameters with param_with_axes (the names in a params_axes
    # collection beside the params); optax's state for them carries no names, and follows its
    # parameter all the same.
    from typing import Any

    from flax import struct
    from flax.linen import partitioning as nn_partitioning

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            wi = nn_partitioning.param_with_axes("wi", INIT, (EMBED, MLP), axes=("embed", "mlp"))
            return x @ wi

    @struct.dataclass
    class State:  # the layout of t5x's train state: params_axes kept beside the params
        params: Any
        opt_state: Any
        params_axes: Any

    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)

    def init_train_state(rng):
        variables = Block().init(rng, jnp.ones((BATCH, EMBED)))
        params = variables["params"]
        return State(params, tx.init(params), variables["params_axes"])

    partitioner = Partitioner(ici_mesh_shape=(1, 4, 2), dcn_mesh_shape=(1, 1, 1))
    abstract_state = jax.eval_shape(init_train_state, jax.random.key(0))
    logical = partitioner.get_logical_axes(abstract_state)
    assert logical.params["wi"] == PartitionSpec("embed", "mlp")
    factored = logical.opt_state[0]
    assert (factored.v_row["wi"], factored.v_col["wi"]) == (AxisNames("embed"), AxisNames("mlp"))
    state = partitioner.partition(
        init_train_state, None, partitioner.get_mesh_axes(abstract_state)
    )(jax.random.key(0))
    assert state.params["wi"].sharding.spec == PartitionSpec(None, "model")
    assert state.opt_state[0].v_col["wi"].sharding.spec == PartitionSpec("model")


def test_constructor_takes_t5x_arguments_in_t5x_order(devices):
    rules = standard_logical_axis_rules(activation_partitioning_dims=2)
    partitioner = Partitioner(None, None, False, None, (1, 2, 4), (1, 1, 1), rules)
    assert partitioner.params_on_devices is False
    assert dict(partitioner.mesh.shape) == {"replica": 1, "data": 2, "model": 4}
    assert dict(partitioner.logical_axis_rules)["embed"] == "model"
    assert Partitioner(num_partitions=1).params_on_devices is True


def test_mesh_keyword_for_library_users(devices):
    from flax_escale import create_mesh

    partitioner = Partitioner(mesh=create_mesh((2, 4), ("data", "model")))
    assert partitioner.data_partition_spec == PartitionSpec("data")
    assert partitioner.get_data_layout() == DataLayout(2, 0, 1, True)


def test_axis_names_compare_like_partition_specs():
    names = AxisNames("embed", "mlp")
    assert names == PartitionSpec("embed", "mlp")
    assert PartitionSpec("embed", "mlp") == names
    # `!=` too, from either side (PartitionSpec defers to AxisNames).
    assert (names != PartitionSpec("embed", "mlp")) is False
    assert (PartitionSpec("embed", "mlp") != names) is False
    assert names != PartitionSpec("embed")
    assert PartitionSpec("mlp", "embed") != names
    assert names == ("embed", "mlp")
    assert AxisNames("embed", None) == PartitionSpec("embed", None)
    assert hash(names) == hash(("embed", "mlp"))
    assert jax.tree.leaves({"w": names}) == [names]


def test_every_public_name_is_documented():
    # The names themselves are pinned, with every namespace's, in tests/test_public_api.py.
    for name in flax_escale.t5x.__all__:
        assert getattr(flax_escale.t5x, name).__doc__, name
