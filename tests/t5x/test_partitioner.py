"""The t5x-style Partitioner: mesh and rules, data layout, partitioned functions, train states."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.mistakes import (
    MISTAKE,
    T,
    X,
    case,
    mesh5,
    raises_a_library_error,
)
from support.mistakes import (
    partitioner as t5x_partitioner,
)

import flax_escale as fe
from flax_escale import nnx as fen
from flax_escale import t5x
from flax_escale.t5x import AxisNames, DataLayout, Partitioner, standard_logical_axis_rules

HIDDEN = ("fsdp", "sp")


@fe.sharded_module(
    {
        "wi/kernel": ("hidden_state", "mlp_intermediate"),
        "wo/kernel": ("mlp_intermediate", "hidden_state"),
        "scale": ("hidden_state",),
    }
)
class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        h = nn.relu(nn.Dense(32, use_bias=False, name="wi")(x * scale))
        h = nn.with_logical_constraint(h, ("batch", "mlp_intermediate"))
        return nn.Dense(x.shape[-1], use_bias=False, name="wo")(h)


@fe.sharded_module(
    {"wi/kernel": ("hidden_state", "mlp_intermediate"), "wo/kernel": ("mlp_intermediate", None)}
)
class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(32, 16, use_bias=False, rngs=rngs)


@pytest.fixture
def partitioner(mesh):
    return Partitioner(mesh=mesh)


def make_init(tx):
    # One model object: TrainState keeps apply_fn as tree metadata, which specs must match.
    model = Mlp()

    def init(rng):
        params = model.init(rng, jnp.zeros((8, 16)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init


def trimmed(spec):
    """``spec`` without trailing ``None`` entries (the resolver gives one entry per dimension)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


# Construction, mesh and rules.


def test_needs_a_way_to_build_a_mesh():
    with pytest.raises(fe.MeshError, match="give mesh=, num_partitions, model_parallel_submesh"):
        Partitioner()


def test_mesh_excludes_mesh_building_arguments(mesh):
    with pytest.raises(fe.MeshError, match="mesh= was given together with num_partitions"):
        Partitioner(num_partitions=2, mesh=mesh)


def test_model_parallel_submesh_must_be_four_sizes():
    with pytest.raises(fe.MeshError, match=r"model_parallel_submesh \(2, 2, 1\) must be four"):
        Partitioner(model_parallel_submesh=(2, 2, 1))


def test_escale_mesh_defaults_to_partition_axis_rules(partitioner):
    assert partitioner.logical_axis_rules == fe.resolve.as_logical_rules(fe.PartitionAxis())
    assert partitioner.data_partition_spec == P(("fsdp", "dp"))


def test_t5x_mesh_defaults_to_the_standard_rules(devices):
    partitioner = Partitioner(num_partitions=1)
    assert set(partitioner.mesh.axis_names) == {"data", "model"}
    assert partitioner.logical_axis_rules == fe.resolve.as_logical_rules(
        standard_logical_axis_rules()
    )
    assert partitioner.data_partition_spec == P("data")


def test_multi_slice_mesh_splits_batch_over_replica_and_data(devices):
    partitioner = Partitioner(ici_mesh_shape=(1, 2, 4), dcn_mesh_shape=(1, 1, 1))
    assert dict(partitioner.mesh.shape) == {"replica": 1, "data": 2, "model": 4}
    assert dict(partitioner.logical_axis_rules)["batch"] == ("replica", "data")
    assert partitioner.data_partition_spec == P(("replica", "data"))
    assert partitioner.data_mesh_size == 2


def test_given_rules_win(mesh):
    partitioner = Partitioner(
        mesh=mesh, logical_axis_rules=fe.PartitionAxis(batch_axis=("dp", "fsdp"))
    )
    assert partitioner.data_partition_spec == P(("dp", "fsdp"))


def test_rules_naming_axes_the_mesh_lacks_are_refused(devices):
    partitioner = Partitioner(mesh=fe.create_mesh((2, 4), ("dp", "tp")))
    with pytest.raises(fe.MeshError, match=r"name mesh axes \['ep', 'fsdp', 'sp'\] that the mesh"):
        _ = partitioner.mesh


def test_rules_on_a_custom_mesh(devices):
    mesh = fe.create_mesh((2, 4), ("data", "tensor"))
    partitioner = Partitioner(
        mesh=mesh, logical_axis_rules=[("batch", "data"), ("mlp", "tensor"), ("embed", None)]
    )
    assert partitioner.data_partition_spec == P("data")
    assert partitioner.data_mesh_size == 2


# Data layout (one process; several processes are tested in test_partitioner_multiprocess).


def test_data_properties_in_one_process(partitioner):
    assert partitioner.data_mesh_size == 4
    assert partitioner.data_shards == 1
    assert partitioner.data_shard_id == 0
    layout = partitioner.get_data_layout(16)
    assert layout == DataLayout(16, 0, 1, True)
    assert partitioner.get_data_layout() == DataLayout(4, 0, 1, True)  # one row per device


def test_batch_size_must_be_a_multiple_of_the_data_devices(partitioner):
    with pytest.raises(fe.EscaleError, match="batch_size 6 is not a multiple of the 4 devices"):
        partitioner.get_data_layout(6)


def test_host_index_outside_the_mesh_is_an_error(partitioner):
    with pytest.raises(fe.MeshError, match="process 3"):
        partitioner.get_data_layout(8, host_index=3)


def test_no_batch_rule_means_one_shard(mesh):
    partitioner = Partitioner(mesh=mesh, logical_axis_rules=fe.PartitionAxis(batch_axis=None))
    assert partitioner.data_partition_spec == P()
    assert partitioner.data_mesh_size == 1
    assert partitioner.get_data_layout(3) == DataLayout(3, 0, 1, True)


def test_local_chunk_info_is_the_whole_array_in_one_process(partitioner):
    info = partitioner.get_local_chunk_info((8, 6), ("fsdp", None))
    assert info.slice == (slice(0, 8), slice(None))
    assert info.replica_id == 0


# Partitioned functions.


def test_partition_places_inputs_and_outputs(partitioner):
    double = partitioner.partition(
        lambda x, y: (2 * x, x @ y), (P("fsdp"), None), (P("fsdp"), P(None, "tp"))
    )
    x = jnp.arange(32.0).reshape(8, 4)
    y = jnp.ones((4, 6))
    doubled, product = double(x, y)
    mesh = partitioner.mesh
    assert doubled.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
    assert product.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
    np.testing.assert_array_equal(doubled, 2 * x)
    np.testing.assert_array_equal(product, x @ y)


def test_partition_static_and_donated_arguments(partitioner):
    scale = partitioner.partition(
        lambda x, k: x * k, P("fsdp"), P("fsdp"), static_argnums=(1,), donate_argnums=(0,)
    )
    x = jax.device_put(jnp.ones(8), NamedSharding(partitioner.mesh, P("fsdp")))
    np.testing.assert_array_equal(scale(x, 3), np.full(8, 3.0))
    assert x.is_deleted()


def test_logical_constraints_inside_take_effect(partitioner):
    # t5x enters the legacy `with mesh:`, under which Flax drops this constraint.
    def fn(x):
        h = nn.with_logical_constraint(x * 2, ("batch", "mlp_intermediate"))
        return fe.constrain(h + 1, ("batch", "hidden_state"))

    partitioned = partitioner.partition(fn, None, None)
    text = partitioned.lower(jnp.ones((8, 16))).as_text()
    # Flax's constraint, then ours: both (batch, mlp/hidden) on (fsdp, dp) x tp.
    assert sharding_constraints(text) == [('[{"fsdp", "dp"}, {"tp"}]', "8x16xf32")] * 2, text


def test_legacy_mesh_context_drops_the_constraint_the_partitioner_keeps(partitioner):
    def fn(x):
        return nn.with_logical_constraint(x * 2, ("batch", "mlp_intermediate"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with partitioner.mesh, nn.logical_axis_rules([("batch", "fsdp"), ("mlp", "tp")]):
            legacy = jax.jit(fn).lower(jnp.ones((8, 16))).as_text()
    ours = partitioner.partition(fn, None, None).lower(jnp.ones((8, 16))).as_text()
    assert "sharding_constraint" not in legacy
    assert sharding_constraints(ours) == [('[{"fsdp", "dp"}, {"tp"}]', "8x16xf32")]


def test_compile_gives_a_compiled_program(partitioner):
    double = partitioner.partition(lambda x: 2 * x, None, P("fsdp"))
    compiled = partitioner.compile(double, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert compiled.memory_analysis().output_size_in_bytes == 8 * 16 * 4 // 4
    np.testing.assert_array_equal(compiled(jnp.ones((8, 16))), np.full((8, 16), 2.0))


def test_bad_axis_resources_are_named(partitioner):
    with pytest.raises(fe.EscaleError, match="axis resources must be PartitionSpec"):
        partitioner.partition(lambda x: x, ("batch", None), None)


# Train states.


def test_linen_train_state_logical_axes_with_adam(partitioner):
    abstract = jax.eval_shape(make_init(optax.adam(1e-3)), jax.random.key(0))
    axes = partitioner.get_logical_axes(abstract)
    kernel = AxisNames("hidden_state", "mlp_intermediate")
    assert axes.params["wi"]["kernel"] == kernel
    assert axes.opt_state[0].mu["wi"]["kernel"] == kernel
    assert axes.opt_state[0].nu["wo"]["kernel"] == AxisNames("mlp_intermediate", "hidden_state")
    assert axes.opt_state[0].count is None
    assert axes.step is None


def test_linen_adafactor_factored_statistics_drop_the_factored_dimension(partitioner):
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    abstract = jax.eval_shape(make_init(tx), jax.random.key(0))
    # optax copies the parameter's box onto the factored statistics, names of the wrong rank.
    boxed = abstract.opt_state[0].v_row["wi"]["kernel"]
    assert len(boxed.names) == 2
    assert boxed.value.shape == (16,)
    axes = partitioner.get_logical_axes(abstract)
    factored = axes.opt_state[0]
    assert factored.v_row["wi"]["kernel"] == AxisNames("hidden_state")
    assert factored.v_col["wi"]["kernel"] == AxisNames("mlp_intermediate")
    # A statistic takes its parameter's spec on the dimensions it keeps, as the front ends'
    # opt_state_shardings give it: wi/kernel is P(HIDDEN, 'tp').
    specs = partitioner.get_mesh_axes(abstract).opt_state[0]
    assert specs.v_row["wi"]["kernel"] == P(HIDDEN)
    assert specs.v_col["wi"]["kernel"] == P("tp")
    # The (1,) placeholder and the count have no names: None, as t5x gives them.
    assert specs.v["wi"]["kernel"] is None
    assert specs.count is None


def test_linen_mesh_axes_are_shape_aware(partitioner):
    abstract = jax.eval_shape(make_init(optax.sgd(0.1)), jax.random.key(0))
    specs = partitioner.get_mesh_axes(abstract)
    assert specs.params["wi"]["kernel"] == P(HIDDEN, "tp")
    assert specs.params["wo"]["kernel"] == P("tp", HIDDEN)
    # scale (16,) takes tp first: 16 divides by 2.
    assert specs.params["scale"] == P("tp")
    assert specs.step is None
    plan = partitioner.plan_sharding(abstract)
    assert plan["params/wi/kernel"].spec == P(HIDDEN, "tp")


def test_mesh_axes_strict_refuses_corrections_and_unknown_names(devices):
    partitioner = Partitioner(mesh=fe.create_mesh((1, 8, 1, 1, 1)))
    tree = {"w": nn.Partitioned(jnp.zeros((6, 4)), ("fsdp", None))}
    with pytest.warns(fe.ShardingCorrectionWarning, match="6 is not divisible"):
        assert trimmed(partitioner.get_mesh_axes(tree)["w"]) == P()
    with pytest.raises(fe.ShardingResolutionError, match=r"(?s)'w'.*6 is not divisible"):
        partitioner.get_mesh_axes(tree, strict=True)
    unknown = {"u": nn.LogicallyPartitioned(jnp.zeros((8, 4)), ("hiden_state", None))}
    with pytest.raises(fe.ShardingResolutionError, match=r"(?s)'u'.*hiden_state"):
        partitioner.get_mesh_axes(unknown, strict=True)


def test_mesh_axis_annotations_and_plain_arrays(partitioner):
    tree = {
        "meshed": nn.Partitioned(jnp.zeros((8, 4)), ("fsdp", None)),
        "plain": jnp.zeros((8, 4)),
    }
    assert partitioner.get_logical_axes(tree) == {"meshed": None, "plain": None}
    specs = partitioner.get_mesh_axes(tree)
    assert specs["meshed"] == P("fsdp", None)
    assert specs["plain"] is None


def test_nnx_model_and_optimizer(partitioner):
    model = fe.init_sharded(NnxMlp, partitioner.mesh, 0)
    optimizer = fen.init_optimizer(model, optax.adafactor(1e-3, min_dim_size_to_factor=4))
    axes = partitioner.get_logical_axes((model, optimizer))
    assert axes[0]["wi"]["kernel"] == AxisNames("hidden_state", "mlp_intermediate")
    factored = axes[1]["opt_state"][0]
    assert factored.v_row["wi"]["kernel"] == AxisNames("hidden_state")
    # wo/kernel (32, 16): optax factors out dimension 0 for the row statistic, 1 for the column.
    assert factored.v_row["wo"]["kernel"] == AxisNames(None)
    assert factored.v_col["wo"]["kernel"] == AxisNames("mlp_intermediate")
    model_specs, optimizer_specs = partitioner.get_mesh_axes((model, optimizer))
    # The model's specs are those init_sharded gave it (one resolver).
    created = jax.tree.map(lambda v: v.sharding.spec, nnx.to_pure_dict(nnx.state(model)))
    assert nnx.to_pure_dict(model_specs) == created
    assert model_specs["wi"]["kernel"] == P(HIDDEN, "tp")
    assert model_specs["wo"]["kernel"] == P("tp", None)
    factored_specs = optimizer_specs["opt_state"][0]
    assert factored_specs.v_row["wi"]["kernel"] == P(HIDDEN)
    assert factored_specs.v_col["wo"]["kernel"] == P("tp")
    assert trimmed(factored_specs.v_row["wo"]["kernel"]) == P()
    # The same specs the optimizer was created with (one rule for optimizer state).
    created = jax.tree.map(lambda v: v.sharding.spec, nnx.state(optimizer))["opt_state"][0]
    for stat in ("v_row", "v_col"):
        for name in ("wi", "wo"):
            ours = getattr(factored_specs, stat)[name]["kernel"]
            assert trimmed(ours) == trimmed(getattr(created, stat)[name]["kernel"])


def test_t5x_flow_init_and_train_equal_the_unsharded_run(partitioner):
    tx = optax.adam(1e-2)
    init = make_init(tx)
    abstract = jax.eval_shape(init, jax.random.key(0))
    axes = partitioner.get_mesh_axes(abstract)
    p_init = partitioner.partition(init, None, axes)
    state = p_init(jax.random.key(0))
    kernel = nn.unbox(state.params)["wi"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(partitioner.mesh, P(HIDDEN, "tp")), 2)
    reference = jax.jit(init)(jax.random.key(0))
    np.testing.assert_array_equal(kernel, nn.unbox(reference.params)["wi"]["kernel"])

    def step(state, x):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, x) - x) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    p_step = partitioner.partition(
        step, (axes, partitioner.data_partition_spec), (axes, None), donate_argnums=(0,)
    )
    batch = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    data = [batch] * 3
    ref_step = jax.jit(step)
    losses, ref_losses = [], []
    for x in data:
        state, loss = p_step(state, x)
        reference, ref_loss = ref_step(reference, x)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    moved = nn.unbox(state.opt_state[0].mu)["wo"]["kernel"]
    assert moved.sharding.is_equivalent_to(NamedSharding(partitioner.mesh, P("tp", HIDDEN)), 2)


def test_move_params_to_devices_is_bit_exact(partitioner):
    init = make_init(optax.adam(1e-3))
    host = jax.tree.map(np.asarray, nn.unbox(jax.jit(init)(jax.random.key(1))))
    abstract = jax.eval_shape(init, jax.random.key(1))
    axes = partitioner.get_mesh_axes(abstract)
    moved = partitioner.move_params_to_devices(host, axes)
    kernel = moved.params["wi"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(partitioner.mesh, P(HIDDEN, "tp")), 2)
    assert kernel.addressable_shards[0].data.shape == (16 // 4, 32 // 2)
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_partitioner_puts_idle_axes_to_use_as_init_sharded_does():
    # GPT-2-XL's token embedding: the vocabulary (50,257) divides neither tp nor (fsdp, sp).
    embed = nn.Embed(
        50257,
        1600,
        embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "hidden_state")
        ),
    )
    tokens = jnp.zeros((2, 8), jnp.int32)
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    abstract = jax.eval_shape(
        lambda key: TrainState.create(
            apply_fn=embed.apply, params=embed.init(key, tokens)["params"], tx=optax.adam(1e-3)
        ),
        jax.random.key(0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)  # the vocabulary's
        used = Partitioner(mesh=mesh).get_mesh_axes(abstract)
        idle = Partitioner(mesh=mesh, use_idle_axes=False).get_mesh_axes(abstract)
        library = fe.plan_sharding(embed, mesh, jax.random.key(0), tokens)
    assert used.params["embedding"] == P(None, ("tp", "fsdp"))
    assert used.opt_state[0].mu["embedding"] == P(None, ("tp", "fsdp"))
    assert library["params/embedding"].spec == used.params["embedding"]
    assert idle.params["embedding"] == P(None, "tp")
    with pytest.raises(fe.EscaleTypeError, match="use_idle_axes"):
        Partitioner(mesh=mesh, use_idle_axes="no")


# --- get_mesh_axes: None for leaves without axis names, as in t5x ---------------------------

# t5x's ModelBasedPartitionerTest: its rules and parameters (here as Flax boxes).
T5X_RULES = (("batch", "data"), ("embed", None), ("vocab", "model"), ("mlp", "model"))
LOGITS = P("model", None)
KERNEL = P(None, "model")


class T5xParams(nn.Module):
    @nn.compact
    def __call__(self, x):
        def param(name, shape, names):
            init = nn.with_logical_partitioning(nn.initializers.ones, names)
            return self.param(name, init, shape)

        logits = param("logits_dense", (16, 16), ("vocab", "embed"))
        kernel = param("kernel", (32, 16), ("embed", "mlp"))
        return x @ logits + kernel.sum()


def model_based_partitioner():
    return Partitioner(mesh=fe.create_mesh((2, 4), ("data", "model")), logical_axis_rules=T5X_RULES)


def t5x_state(tx):
    model = T5xParams()

    def init(key):
        params = model.init(key, jnp.ones((2, 16)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_get_mesh_axes_of_an_adafactor_state(factored, momentum):
    tx = optax.adafactor(0.1, min_dim_size_to_factor=8, factored=factored, momentum=momentum)
    axes = model_based_partitioner().get_mesh_axes(jax.eval_shape(t5x_state(tx), jax.random.key(0)))
    assert axes.step is None
    assert axes.params == {"logits_dense": LOGITS, "kernel": KERNEL}
    stats = axes.opt_state[0]
    assert stats.count is None
    if factored:
        # The (1,) placeholders are None, as t5x gives v of a factored parameter.
        assert stats.v == {"logits_dense": None, "kernel": None}
        # t5x gives the factored statistics None; the library's follow their parameter.
        assert stats.v_row == {"logits_dense": P("model"), "kernel": P("model")}
        assert stats.v_col == {"logits_dense": P(None), "kernel": P(None)}
    else:
        assert stats.v == {"logits_dense": LOGITS, "kernel": KERNEL}
        assert stats.v_row == {"logits_dense": None, "kernel": None}
        assert stats.v_col == {"logits_dense": None, "kernel": None}
    averages = [s for s in axes.opt_state if isinstance(s, optax.EmaState)]
    if momentum:
        # t5x's rule for optax's EmaState: no axes for the count, the parameters' for ema.
        (average,) = averages
        assert average.count is None
        assert average.ema == {"logits_dense": LOGITS, "kernel": KERNEL}
    else:
        assert averages == []


def test_names_that_all_stay_unsharded_give_a_spec_not_none():
    # t5x resolves any leaf with logical axes, even when every name maps to None.
    abstract = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    tree = {"w": nn.LogicallyPartitioned(abstract, ("embed", None))}
    assert model_based_partitioner().get_mesh_axes(tree) == {"w": P(None, None)}


def test_an_unnamed_leaf_the_plan_shards_keeps_its_spec():
    # 2 MiB without names: the model axis, which w's names use, is idle on it, and the plan
    # puts it to use (the library's default); None would replicate it. Without idle axes it
    # stays whole and is None, as in t5x.
    w = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((16, 16), jnp.float32), ("embed", "mlp"))
    tree = {"big": jax.ShapeDtypeStruct((1024, 512), jnp.float32), "w": w}
    mesh = fe.create_mesh((2, 4), ("data", "model"))
    assert Partitioner(mesh=mesh, logical_axis_rules=T5X_RULES).get_mesh_axes(tree) == {
        "big": P("model", None),
        "w": KERNEL,
    }
    idle = Partitioner(mesh=mesh, logical_axis_rules=T5X_RULES, use_idle_axes=False)
    assert idle.get_mesh_axes(tree) == {"big": None, "w": KERNEL}


def test_none_mesh_axes_are_replicated_where_the_partitioner_uses_them():
    partitioner = model_based_partitioner()
    init = t5x_state(optax.adafactor(0.1, min_dim_size_to_factor=8))
    axes = partitioner.get_mesh_axes(jax.eval_shape(init, jax.random.key(0)))
    replicated = NamedSharding(partitioner.mesh, P())
    state = partitioner.partition(init, None, axes)(jax.random.key(0))
    host = jax.tree.map(np.asarray, nn.unbox(jax.jit(init)(jax.random.key(0))))
    moved = partitioner.move_params_to_devices(host, axes)
    for placed in (nn.unbox(state), moved):
        for leaf in (placed.step, placed.opt_state[0].count, placed.opt_state[0].v["kernel"]):
            assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
        kernel = placed.params["kernel"]
        assert kernel.sharding.is_equivalent_to(NamedSharding(partitioner.mesh, KERNEL), 2)


CASES = [
    case(
        lambda: t5x.Partitioner(num_partitions="2"),
        T,
        "num_partitions",
        "'2'",
        "pass the int 2",
        id="t5x-Partitioner-partitions-string",
    ),
    case(
        lambda: t5x.Partitioner(mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="t5x-Partitioner-mesh-string",
    ),
    case(
        lambda: t5x.Partitioner(model_parallel_submesh=2),
        T,
        "model_parallel_submesh",
        "int 2",
        r"pass \(2,\)",
        id="t5x-Partitioner-submesh-int",
    ),
    case(
        lambda: t5x.Partitioner(mesh=mesh5(), logical_axis_rules="batch"),
        T,
        "logical_axis_rules",
        "'batch'",
        r"pass e\.g\. \[\('batch', 'dp'\)\]",
        id="t5x-Partitioner-rules-string",
    ),
    case(
        lambda: t5x.Partitioner(mesh=mesh5(), logical_axis_rules=[("batch", 3)]),
        T,
        "logical_axis_rules",
        "('batch', 3)",
        "a name, a tuple of names or None",
        id="t5x-Partitioner-rules-int-axes",
    ),
    case(
        lambda: t5x_partitioner().partition("step", None, None),
        T,
        "fn",
        "'step'",
        "pass the step function itself",
        id="t5x-partition-fn-string",
    ),
    case(
        lambda: t5x_partitioner().partition(lambda a, b: a + b, None, None)(X, b=X),
        T,
        "PartitionedFunction",
        "['b']",
        "pass them positionally",
        id="t5x-partitioned-call-keyword",
    ),
    case(
        lambda: t5x_partitioner().partition(lambda: 1, None, None)(X),
        T,
        "PartitionedFunction",
        "cannot take 1 positional",
        "pass them as the function takes them",
        id="t5x-partitioned-call-wrong-arity",
    ),
    case(
        lambda: t5x_partitioner().get_logical_axes("params"),
        T,
        "train_state",
        "'params'",
        "not its name",
        id="t5x-get_logical_axes-string",
    ),
    case(
        lambda: t5x_partitioner().get_mesh_axes("params"),
        T,
        "train_state",
        "'params'",
        "not its name",
        id="t5x-get_mesh_axes-string",
    ),
    case(
        lambda: t5x_partitioner().move_params_to_devices("params", {"w": P()}),
        T,
        "train_state",
        "'params'",
        "not its name",
        id="t5x-move_params_to_devices-string",
    ),
    case(
        lambda: t5x_partitioner().move_params_to_devices({"w": X}, {"v": P("fsdp")}),
        fe.EscaleError,
        "train_state_axes",
        "{'v': P('fsdp',)}",
        "shaped like train_state",
        id="t5x-move_params_to_devices-other-structure",
    ),
    case(
        lambda: t5x_partitioner().compile(
            t5x_partitioner().partition(lambda x: 2 * x, None, P()), X, X
        ),
        T,
        "PartitionedFunction",
        "cannot take 2 positional",
        "pass them as the function takes them",
        id="t5x-compile-wrong-arity",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_partitioner_strict_raises_on_what_does_not_divide(devices):
    fsdp8 = fe.create_mesh((1, 8, 1, 1, 1))
    # (6, 12) on fsdp=8: hidden_state's fallback (fsdp, sp) divides neither 6 nor 12, and tp=1.
    kernel = jax.ShapeDtypeStruct((6, 12), jnp.float32)
    state = {"w": nn.LogicallyPartitioned(kernel, ("hidden_state", "mlp_intermediate"))}
    partitioner = Partitioner(mesh=fsdp8)
    with pytest.raises(fe.ShardingResolutionError, match=r"parameter 'w'.*\(6, 12\)"):
        partitioner.get_mesh_axes(state, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"parameter 'w'"):
        assert partitioner.get_mesh_axes(state) == {"w": P(None, None)}
