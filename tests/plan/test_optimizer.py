import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, TX, T, case, params, raises_a_library_error

import flax_escale as fe
from flax_escale import EscaleError, create_mesh, init_opt_state, opt_state_shardings
from flax_escale.plan._optimizer import follow_shardings


@pytest.fixture
def zero_mesh(devices):
    return create_mesh((2, 4, 1, 1, 1))


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _params(mesh):
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "kernel": _put(rng.standard_normal((8, 16), dtype=np.float32), mesh, P("fsdp", "tp")),
            "bias": _put(rng.standard_normal((16,), dtype=np.float32), mesh, P("tp")),
        },
        "scale": _put(rng.standard_normal((4,), dtype=np.float32), mesh, P()),
    }


PARAM_SPECS = {"dense": {"kernel": P("fsdp", "tp"), "bias": P("tp")}, "scale": P()}
PARAM_SHARDS = {"dense": {"kernel": (2, 8), "bias": (8,)}, "scale": (4,)}


def _specs(tree):
    return jax.tree.map(lambda s: s.spec, tree)


def _unsharded(params):
    return jax.tree.map(np.asarray, params)


def _assert_bit_equal(actual, expected):
    actual_leaves, actual_def = jax.tree.flatten(actual)
    expected_leaves, expected_def = jax.tree.flatten(expected)
    assert actual_def == expected_def
    assert len(actual_leaves) == len(expected_leaves) > 0
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert a.dtype == e.dtype
        assert a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _assert_shardings_match(state, shardings):
    leaves, state_def = jax.tree.flatten(state)
    sharding_leaves, sharding_def = jax.tree.flatten(shardings)
    assert state_def == sharding_def
    for leaf, sharding in zip(leaves, sharding_leaves, strict=True):
        assert leaf.sharding == sharding


def test_adam_moments_follow_params_and_count_is_replicated(mesh):
    params = _params(mesh)
    shardings = opt_state_shardings(optax.adam(1e-3), params)
    adam, empty = shardings
    assert isinstance(adam, optax.ScaleByAdamState)
    assert isinstance(empty, optax.EmptyState)
    assert adam.count == NamedSharding(mesh, P())
    assert _specs(adam.mu) == PARAM_SPECS
    assert _specs(adam.nu) == PARAM_SPECS
    assert adam.mu["dense"]["kernel"] == params["dense"]["kernel"].sharding
    assert all(s.mesh is mesh for s in jax.tree.leaves(shardings))


def test_opt_state_shardings_has_the_structure_of_the_state(mesh):
    params = _params(mesh)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    shardings = opt_state_shardings(tx, params)
    state = tx.init(_unsharded(params))
    assert jax.tree.structure(shardings) == jax.tree.structure(state)


def test_sgd_momentum_follows_params(mesh):
    params = _params(mesh)
    (trace, _) = opt_state_shardings(optax.sgd(0.1, momentum=0.9), params)
    assert isinstance(trace, optax.TraceState)
    assert _specs(trace.trace) == PARAM_SPECS


def test_chain_clip_adamw(mesh):
    params = _params(mesh)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    clip, (adam, *rest) = opt_state_shardings(tx, params)
    assert jax.tree.leaves(clip) == []
    assert adam.count.spec == P()
    assert _specs(adam.mu) == PARAM_SPECS
    assert _specs(adam.nu) == PARAM_SPECS
    assert jax.tree.leaves(rest) == []


def test_adafactor_factored_leaves_follow_the_kept_dimensions(mesh):
    params = _params(mesh)
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    factored = opt_state_shardings(tx, params)[0]
    shapes = jax.eval_shape(tx.init, params)[0]
    # The kernel (8, 16) is factored into a row (8,) and a column (16,) statistic; v is a dummy.
    assert shapes.v_row["dense"]["kernel"].shape == (8,)
    assert shapes.v_col["dense"]["kernel"].shape == (16,)
    assert shapes.v["dense"]["kernel"].shape == (1,)
    replicated = NamedSharding(mesh, P())
    assert factored.count == replicated
    assert factored.v_row["dense"]["kernel"].spec == P("fsdp")
    assert factored.v_col["dense"]["kernel"].spec == P("tp")
    assert factored.v["dense"]["kernel"] == replicated
    # Vectors are not factored: v has the parameter's shape and follows its sharding.
    assert shapes.v["dense"]["bias"].shape == (16,)
    assert factored.v["dense"]["bias"].spec == P("tp")
    assert factored.v_row["dense"]["bias"] == replicated


def test_adafactor_factored_state_is_born_split(mesh):
    params = _params(mesh)
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    state = init_opt_state(tx, params)[0]
    assert state.v_row["dense"]["kernel"].addressable_shards[0].data.shape == (2,)
    assert state.v_col["dense"]["kernel"].addressable_shards[0].data.shape == (8,)


def test_adafactor_unfactored_kernel_follows_param(mesh):
    params = _params(mesh)
    factored = opt_state_shardings(optax.adafactor(1e-3), params)[0]
    assert factored.v["dense"]["kernel"].spec == P("fsdp", "tp")
    assert factored.v_row["dense"]["kernel"].spec == P()


TRANSFORMS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=4),
    "adafactor_default": lambda: optax.adafactor(1e-3),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_init_opt_state_equals_tx_init(mesh, name):
    tx = TRANSFORMS[name]()
    params = _params(mesh)
    state = init_opt_state(tx, params)
    _assert_bit_equal(state, tx.init(_unsharded(params)))
    _assert_shardings_match(state, opt_state_shardings(tx, params))


def test_init_opt_state_copies_params_into_the_state(mesh):
    # Schedule-free keeps z, a copy of the parameters, so the state is not all zeros, and
    # non-zero scalars (b1=0.9, step_count=1).
    params = _params(mesh)
    tx = optax.contrib.schedule_free_sgd(0.1)
    state = init_opt_state(tx, params)
    _assert_bit_equal(state, tx.init(_unsharded(params)))
    np.testing.assert_array_equal(
        np.asarray(state.z["dense"]["kernel"]), np.asarray(params["dense"]["kernel"])
    )
    assert _specs(jax.tree.map(lambda x: x.sharding, state.z)) == PARAM_SPECS
    assert state.b1.sharding.spec == P()
    assert float(state.b1) == pytest.approx(0.9)
    assert int(state.step_count) == 1


def test_init_opt_state_per_device_shapes(mesh):
    params = _params(mesh)
    adam = init_opt_state(optax.adam(1e-3), params)[0]
    shards = jax.tree.map(lambda x: x.addressable_shards[0].data.shape, adam.mu)
    assert shards == PARAM_SHARDS
    assert jax.tree.map(lambda x: x.addressable_shards[0].data.shape, adam.nu) == PARAM_SHARDS
    assert adam.count.addressable_shards[0].data.shape == ()
    assert adam.count.sharding.spec == P()
    assert adam.count.dtype == jnp.int32


def test_params_as_shape_dtype_structs(mesh):
    params = {
        "w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    }
    adam = opt_state_shardings(optax.adam(1e-3), params)[0]
    assert adam.mu["w"].spec == P("fsdp")
    assert adam.count.spec == P()


# ZeRO-1.


def test_zero1_adds_dp_to_the_first_dimension(zero_mesh):
    w = _put(jnp.arange(32.0).reshape(8, 4), zero_mesh, P("fsdp"))
    adam = opt_state_shardings(optax.adam(1e-3), {"w": w}, shard_over=("dp",))[0]
    assert adam.mu["w"].spec == P(("fsdp", "dp"), None)
    assert adam.nu["w"].spec == P(("fsdp", "dp"), None)
    assert adam.count.spec == P()


def test_zero1_init_shards_are_smaller(zero_mesh):
    w = _put(jnp.arange(32.0).reshape(8, 4), zero_mesh, P("fsdp"))
    tx = optax.adam(1e-3)
    state = init_opt_state(tx, {"w": w}, shard_over=("dp",))
    mu = state[0].mu["w"]
    assert mu.sharding.spec == P(("fsdp", "dp"), None)
    assert mu.addressable_shards[0].data.shape == (1, 4)
    assert w.addressable_shards[0].data.shape == (2, 4)
    # Every device holds a distinct row of the moments.
    assert sorted(s.index[0].start for s in mu.addressable_shards) == list(range(8))
    _assert_bit_equal(state, tx.init({"w": np.asarray(w)}))


@pytest.mark.parametrize(
    ("spec", "shape", "expected"),
    [
        (P("fsdp"), (8, 4), P(("fsdp", "dp"), None)),
        (P("fsdp"), (4, 4), P("fsdp", "dp")),
        (P("fsdp"), (4, 6), P("fsdp", "dp")),
        (P("fsdp"), (4, 3), P("fsdp")),
        (P("fsdp"), (4,), P("fsdp")),
        (P(), (6, 4), P("dp", None)),
        (P(), (3, 4), P(None, "dp")),
        (P(), (3, 5), P()),
        (P(), (), P()),
        (P(None, "fsdp"), (3, 8), P(None, ("fsdp", "dp"))),
        (P("dp", "fsdp"), (8, 8), P("dp", "fsdp")),
    ],
)
def test_zero1_dimension_choice(zero_mesh, spec, shape, expected):
    param = _put(jnp.zeros(shape), zero_mesh, spec)
    shardings = opt_state_shardings(optax.sgd(0.1, momentum=0.9), {"p": param}, shard_over=("dp",))
    assert shardings[0].trace["p"].spec == expected


def test_zero1_size_one_axis_adds_nothing(zero_mesh):
    w = _put(jnp.zeros((8, 4)), zero_mesh, P("fsdp"))
    for shard_over in [("ep",), ("tp", "sp")]:
        adam = opt_state_shardings(optax.adam(1e-3), {"w": w}, shard_over=shard_over)[0]
        assert adam.mu["w"].spec == P("fsdp")
    adam = opt_state_shardings(optax.adam(1e-3), {"w": w}, shard_over=("dp", "ep"))[0]
    assert adam.mu["w"].spec == P(("fsdp", "dp"), None)


def test_zero1_on_a_size_one_dp_mesh_changes_nothing(mesh):
    params = _params(mesh)
    with_zero = opt_state_shardings(optax.adam(1e-3), params, shard_over=("dp",))
    without = opt_state_shardings(optax.adam(1e-3), params)
    assert _specs(with_zero) == _specs(without)
    # ...and both are the parameters' own specs, not the same wrong answer twice.
    assert _specs(with_zero[0].mu) == _specs(with_zero[0].nu) == PARAM_SPECS


def test_zero1_splits_factored_leaves_and_replicates_the_rest(zero_mesh):
    w = _put(jnp.zeros((8, 16)), zero_mesh, P("fsdp"))
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    factored = opt_state_shardings(tx, {"w": w}, shard_over=("dp",))[0]
    assert factored.v_row["w"].spec == P(("fsdp", "dp"))
    assert factored.v_col["w"].spec == P("dp")
    assert factored.v["w"].spec == P()
    assert factored.count.spec == P()


# Errors.


@pytest.mark.parametrize(
    "bad",
    [
        np.ones((8, 4), np.float32),
        jnp.ones((8, 4)),
        jax.ShapeDtypeStruct((8, 4), jnp.float32),
    ],
    ids=["numpy", "single_device", "no_sharding"],
)
def test_param_without_named_sharding(mesh, bad):
    params = {"good": _put(jnp.zeros((8, 4)), mesh, P("fsdp")), "bad": bad}
    with pytest.raises(EscaleError, match=r"shape \(8, 4\) has sharding .*not a NamedSharding"):
        opt_state_shardings(optax.adam(1e-3), params)
    with pytest.raises(EscaleError, match="NamedSharding"):
        init_opt_state(optax.adam(1e-3), params)


def test_single_device_sharding_is_named_in_the_message(mesh):
    with pytest.raises(EscaleError, match=r"has sharding SingleDeviceSharding\("):
        opt_state_shardings(optax.adam(1e-3), {"w": jnp.ones((8, 4))})


def test_shard_over_unknown_axis(zero_mesh):
    w = _put(jnp.zeros((8, 4)), zero_mesh, P("fsdp"))
    with pytest.raises(
        EscaleError, match=r"shard_over=\('dp', 'nope'\): mesh axis 'nope' is not in the mesh"
    ):
        opt_state_shardings(optax.adam(1e-3), {"w": w}, shard_over=("dp", "nope"))
    with pytest.raises(EscaleError, match="'nope'"):
        init_opt_state(optax.adam(1e-3), {"w": w}, shard_over=("nope",))


def test_params_on_two_meshes(mesh, devices):
    other = create_mesh((2, 4), ("dp", "tp"))
    params = {"a": _put(jnp.zeros((8,)), mesh, P("fsdp")), "b": _put(jnp.zeros((8,)), other, P())}
    with pytest.raises(EscaleError, match=r"must all be sharded on one mesh, found 2"):
        opt_state_shardings(optax.adam(1e-3), params)
    with pytest.raises(EscaleError, match="one mesh"):
        init_opt_state(optax.adam(1e-3), params)


def test_empty_params_are_refused_clearly():
    with pytest.raises(EscaleError, match="no parameters"):
        opt_state_shardings(optax.adam(1e-3), {})


# opt_state_shardings with the rule.


def test_adafactor_square_kernel_shardings(mesh):
    w = _put(jnp.zeros((16, 16)), mesh, P("fsdp", "tp"))
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    factored = opt_state_shardings(tx, {"w": w})[0]
    assert factored.v_row["w"].spec == P("fsdp")
    assert factored.v_col["w"].spec == P("tp")
    assert factored.v["w"].spec == P()
    state = init_opt_state(tx, {"w": w})[0]
    assert state.v_row["w"].addressable_shards[0].data.shape == (4,)
    assert state.v_col["w"].addressable_shards[0].data.shape == (8,)


@pytest.mark.parametrize(
    ("shape", "spec", "row", "col"),
    [
        ((8, 16, 16), P(None, "fsdp", "tp"), P(None, "fsdp"), P(None, "tp")),
        ((16, 8, 16), P("fsdp", None, "tp"), P("fsdp", None), P(None, "tp")),
        ((16, 16, 8), P("fsdp", "tp", None), P("fsdp", None), P("tp", None)),
        ((16, 32), P("tp", "fsdp"), P("tp"), P("fsdp")),
        ((32, 16), P("fsdp", "tp"), P("tp"), P("fsdp")),
    ],
    ids=str,
)
def test_adafactor_factored_shardings(mesh, shape, spec, row, col):
    w = _put(jnp.zeros(shape), mesh, spec)
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    factored = opt_state_shardings(tx, {"w": w})[0]
    assert (factored.v_row["w"].spec, factored.v_col["w"].spec) == (row, col)
    state = init_opt_state(tx, {"w": w})
    np.testing.assert_array_equal(
        np.asarray(state[0].v_col["w"]),
        np.asarray(tx.init({"w": np.zeros(shape, np.float32)})[0].v_col["w"]),
    )


def test_adafactor_unfactored_follows_whole(mesh):
    w = _put(jnp.zeros((16, 16)), mesh, P("fsdp", "tp"))
    factored = opt_state_shardings(optax.adafactor(1e-3), {"w": w})[0]
    assert factored.v["w"] == w.sharding
    assert factored.v_row["w"].spec == factored.v_col["w"].spec == P()


def test_zero1_square_adafactor(zero_mesh):
    w = _put(jnp.zeros((16, 16)), zero_mesh, P(None, "fsdp"))
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    factored = opt_state_shardings(tx, {"w": w}, shard_over=("dp",))[0]
    assert factored.v_row["w"].spec == P("dp")
    assert factored.v_col["w"].spec == P(("fsdp", "dp"))
    assert factored.count.spec == P()


def test_masked_and_multi_transform(mesh):
    params = {
        "kernel": _put(jnp.zeros((8, 16)), mesh, P("fsdp", "tp")),
        "bias": _put(jnp.zeros((16,)), mesh, P("tp")),
    }
    labels = {"kernel": "adam", "bias": "sgd"}
    tx = optax.chain(
        optax.masked(optax.adam(1e-3), {"kernel": True, "bias": False}),
        optax.multi_transform(
            {"adam": optax.adam(1e-3), "sgd": optax.sgd(0.1, momentum=0.9)}, labels
        ),
    )
    masked, multi = opt_state_shardings(tx, params)
    host = tx.init(jax.tree.map(np.asarray, params))
    assert jax.tree.structure((masked, multi)) == jax.tree.structure(host)
    assert masked.inner_state[0].mu["kernel"] == params["kernel"].sharding
    adam = multi.inner_states["adam"].inner_state[0]
    sgd = multi.inner_states["sgd"].inner_state[0]
    assert adam.mu["kernel"].spec == P("fsdp", "tp")
    assert adam.count.spec == P()
    assert sgd.trace["bias"].spec == P("tp")
    state = init_opt_state(tx, params)
    assert jax.tree.structure(state) == jax.tree.structure(host)


def test_params_that_are_one_array(mesh):
    w = _put(jnp.zeros((8, 16)), mesh, P("fsdp", "tp"))
    adam = opt_state_shardings(optax.adam(1e-3), w)[0]
    assert adam.mu == adam.nu == w.sharding
    assert adam.count.spec == P()


# follow_shardings, as the NNX front end calls it.


def test_follow_shardings_on_an_nnx_optimizer(mesh):
    model = nnx.Linear(16, 16, use_bias=True, rngs=nnx.Rngs(0))
    tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
    abstract = nnx.eval_shape(lambda: nnx.Optimizer(model, tx, wrt=nnx.Param))
    params = [
        ("kernel", (16, 16), NamedSharding(mesh, P("fsdp", "tp"))),
        ("bias", (16,), NamedSharding(mesh, P("tp"))),
    ]
    shardings = follow_shardings(nnx.state(abstract), params, mesh)
    factored = shardings["opt_state"][0]
    assert factored.v_row["kernel"].spec == P("fsdp")
    assert factored.v_col["kernel"].spec == P("tp")
    assert factored.v["bias"].spec == P("tp")
    assert factored.v["kernel"].spec == factored.v_row["bias"].spec == P()
    assert shardings["step"].spec == P()


def test_follow_shardings_errors(mesh, zero_mesh):
    state = {"mu": {"w": jnp.zeros((8,))}}
    params = [("w", (8,), NamedSharding(mesh, P("fsdp")))]
    with pytest.raises(EscaleError, match=r"shard_over=\('nope',\): mesh axis 'nope' is not in"):
        follow_shardings(state, params, mesh, shard_over=("nope",))
    with pytest.raises(
        EscaleError, match=r"params: 'w' is sharded on the mesh \{.*\}, not on the optimizer's"
    ):
        follow_shardings(state, params, zero_mesh)


# Every front end and the partitioner use the one rule: a square kernel's column statistic
# keeps the second name (dimension 1), as optax's v_col does.
SQUARE_NAMES = ("vocab", "hidden_state")  # P('tp', ('fsdp', 'sp')) on fsdp=4 x tp=2


SQUARE_TX = optax.adafactor(1e-3, min_dim_size_to_factor=4)


def _square_specs(tree):
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, P)
    )[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        role = next((k for k in keys if k in ("v_row", "v_col")), None)
        if role and "kernel" in keys:
            found[role] = leaf if isinstance(leaf, P) else leaf.sharding.spec
    return found


SQUARE_EXPECTED = {"v_row": P("tp"), "v_col": P(("fsdp", "sp"))}


def test_square_kernel_statistics_in_every_front_end(devices):
    import flax.linen as nn

    import flax_escale as fe
    from flax_escale import linen as fel
    from flax_escale import nnx as fen
    from flax_escale.t5x import Partitioner

    mesh = create_mesh((1, 4, 1, 2, 1))
    dense = nn.Dense(
        16,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), SQUARE_NAMES),
    )
    x = jnp.ones((2, 16))
    state = fel.init_train_state(dense, mesh, jax.random.key(0), x, tx=SQUARE_TX)
    assert _square_specs(state.opt_state) == SQUARE_EXPECTED

    @fe.sharded_module({"kernel": SQUARE_NAMES})
    class Square(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(16, 16, use_bias=False, rngs=rngs)

    optimizer = fen.init_optimizer(fe.init_sharded(Square, mesh, 0), SQUARE_TX)
    assert _square_specs(nnx.state(optimizer)) == SQUARE_EXPECTED

    from flax.training.train_state import TrainState

    def create(key):
        params = dense.init(key, x)["params"]
        return TrainState.create(apply_fn=dense.apply, params=params, tx=SQUARE_TX)

    abstract = jax.eval_shape(create, jax.random.key(0))
    axes = Partitioner(mesh=mesh).get_mesh_axes(abstract)
    assert _square_specs(axes) == {k: P(*v) for k, v in SQUARE_EXPECTED.items()}


# Mistakes with opt_state_shardings and init_opt_state, one case each (support/mistakes.py
# says what a case asserts).
MISTAKES = [
    case(
        lambda: fe.opt_state_shardings(TX, params(), shard_over="dp"),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="opt_state_shardings-shard_over-string",
    ),
    case(
        lambda: fe.init_opt_state(TX, params(), shard_over="dp"),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="init_opt_state-shard_over-string",
    ),
    case(
        lambda: fe.init_opt_state(TX, params(), shard_over=("dp",) * 1000),
        fe.EscaleError,
        "shard_over",
        "'dp' is named 1000 times",
        r"name each axis once",
        id="init_opt_state-shard_over-repeated",
    ),
    case(
        lambda: fe.opt_state_shardings(TX, params(), shard_over=("dp", 1)),
        T,
        "shard_over",
        "int 1",
        "not a string",
        id="shard_over-entry-int",
    ),
    case(
        lambda: fe.opt_state_shardings(None, params()),
        T,
        "tx",
        "None",
        r"optax\.adam\(1e-3\)",
        id="opt_state_shardings-tx-none",
    ),
    case(
        lambda: fe.opt_state_shardings("adam", params()),
        T,
        "tx",
        "'adam'",
        r"optax\.adam\(1e-3\), not its name",
        id="opt_state_shardings-tx-name",
    ),
    case(
        lambda: fe.init_opt_state(optax.adam, params()),
        T,
        "tx",
        "function",
        r"call the factory first, e\.g\. optax\.adam\(1e-3\)",
        id="init_opt_state-tx-factory",
    ),
]


@pytest.mark.parametrize(MISTAKE, MISTAKES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
