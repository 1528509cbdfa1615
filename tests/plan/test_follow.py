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

from flax_escale.plan._follow import Followed, follow_params

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
