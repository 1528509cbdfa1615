"""The one rule for optimizer state following its parameter, checked against optax itself.

Which parameter dimensions Adafactor's factored statistics keep is observed from a real optax
update (a gradient that varies along one parameter dimension only shows up along the statistic
dimension that tracks it), never recomputed the way the rule computes it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_escale import EscaleError, create_mesh, init_opt_state, opt_state_shardings
from flax_escale.plan._follow import Followed, follow_params
from flax_escale.plan._optimizer import follow_shardings

SHAPES = [
    (16, 16),
    (128, 128),
    (8, 16),
    (16, 8),
    (8, 16, 16),
    (16, 8, 16),
    (16, 16, 8),
    (4, 8, 16),
    (16, 8, 4),
    (8, 8, 8),
    (4, 4, 16),
    (16, 4, 4),
    (2, 16, 16, 4),
]


@pytest.fixture
def zero_mesh(devices):
    return create_mesh((2, 4, 1, 1, 1))


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _observed_kept(shape, field):
    """The parameter dimension each dimension of optax's ``field`` statistic tracks."""
    tx = optax.scale_by_factored_rms(min_dim_size_to_factor=2)
    params = jnp.zeros(shape)
    state = tx.init(params)
    kept = [None] * np.ndim(getattr(state, field))
    for dim, size in enumerate(shape):
        along = np.arange(1.0, size + 1).reshape(
            [size if d == dim else 1 for d in range(len(shape))]
        )
        _, updated = tx.update(jnp.broadcast_to(along, shape), state, params)
        stat = np.asarray(getattr(updated, field))
        varying = [j for j in range(stat.ndim) if not np.allclose(stat, np.take(stat, [0], axis=j))]
        assert len(varying) <= 1, (shape, field, dim, varying)
        if varying:
            kept[varying[0]] = dim
    assert None not in kept, f"the oracle could not tell every dimension of {field} for {shape}"
    return tuple(kept)


def _rule_kept(shape, state_path, leaf_shape):
    """The parameter dimensions the rule says a state leaf keeps (entries = dimension indices)."""
    (followed,) = follow_params(
        [(state_path, leaf_shape)], [("w", shape, tuple(range(len(shape))))]
    )
    return None if followed is None else followed.entries


def _factored_shapes(shape, min_dim_size_to_factor=2):
    tx = optax.scale_by_factored_rms(min_dim_size_to_factor=min_dim_size_to_factor)
    return jax.eval_shape(tx.init, jnp.zeros(shape))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("field", ["v_row", "v_col"])
def test_factored_statistics_keep_the_dimensions_optax_keeps(shape, field):
    leaf_shape = getattr(_factored_shapes(shape), field).shape
    assert _rule_kept(shape, f"0/{field}/w", leaf_shape) == _observed_kept(shape, field)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_without_a_field_name_the_shape_decides(shape):
    # No v_row / v_col in the path: v_row's shape always gives v_row's dimensions; v_col's
    # gives v_col's whenever its shape differs from v_row's (equal shapes read as v_row).
    state = _factored_shapes(shape)
    row, col = state.v_row.shape, state.v_col.shape
    assert _rule_kept(shape, "stat/w", row) == _observed_kept(shape, "v_row")
    if row != col:
        assert _rule_kept(shape, "stat/w", col) == _observed_kept(shape, "v_col")
    else:
        assert _rule_kept(shape, "stat/w", col) == _observed_kept(shape, "v_row")


def test_square_embedding_column_statistic_keeps_the_second_name():
    # optax ties the two sizes by index: the row statistic drops dimension 1, the column one 0.
    params = [("params/embed/embedding", (16, 16), ("vocab", "embed"))]
    state = [("opt_state/0/v_row/embed/embedding", (16,)), ("0/v_col/embed/embedding", (16,))]
    assert follow_params(state, params) == [Followed(0, ("vocab",)), Followed(0, ("embed",))]
    assert _observed_kept((16, 16), "v_row") == (0,)
    assert _observed_kept((16, 16), "v_col") == (1,)


def test_the_field_name_is_read_only_before_the_parameter_path():
    # A parameter named v_row: its column statistic is still a column statistic.
    params = [("v_row", (16, 16), ("a", "b"))]
    assert follow_params([("0/v_col/v_row", (16,))], params) == [Followed(0, ("b",))]
    assert follow_params([("0/v_row/v_row", (16,))], params) == [Followed(0, ("a",))]


def test_default_adafactor_factors_a_128_square():
    shapes = jax.eval_shape(optax.adafactor(1e-3).init, {"w": jnp.zeros((128, 128))})[0]
    params = [("w", (128, 128), ("x", "y"))]
    state = [("0/v_row/w", shapes.v_row["w"].shape), ("0/v_col/w", shapes.v_col["w"].shape)]
    state += [("0/v/w", shapes.v["w"].shape), ("0/count", shapes.count.shape)]
    expected = [Followed(0, ("x",)), Followed(0, ("y",)), Followed(0, None), None]
    assert follow_params(state, params) == expected


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ([("0/mu/a/w", (8, 16))], [Followed(0, ("fsdp", "tp"))]),
        ([("0/mu/b/w", (4,))], [Followed(1, ("tp",))]),
        ([("0/v_row/a/w", (1,)), ("0/v/b/w", (1,))], [Followed(0, None), Followed(1, None)]),
        ([("0/count", ()), ("0/mu/w", (8, 16))], [None, None]),  # no ending, ambiguous ending
        ([("0/mu/a/w", (16, 8))], [Followed(0, None)]),  # a shape the parameter cannot give
        ([("0/mu/b/w", ())], [Followed(1, None)]),  # a vector is never factored
    ],
)
def test_follow_params_cases(state, expected):
    params = [("params/a/w", (8, 16), ("fsdp", "tp")), ("params/b/w", (4,), ("tp",))]
    assert follow_params(state, params) == expected


def test_copies_that_agree_share_an_ending():
    # A parameter and its moment carrying the same entries: "w" still finds them.
    params = [("params/w", (8, 16), ("x", "y")), ("opt/mu/w", (8, 16), ("x", "y"))]
    assert follow_params([("opt/v_row/w", (8,))], params) == [Followed(0, ("x",))]


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
