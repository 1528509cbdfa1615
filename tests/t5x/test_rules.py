import jax
import pytest

from flax_escale import EscaleError
from flax_escale.t5x import AxisNames, standard_logical_axis_rules

REPLICATED = [
    ("relpos_buckets", None),
    ("abspos_buckets", None),
    ("length", None),
    ("layers", None),
    ("stack", None),
    ("mlp_activations", None),
]
MODEL_PARALLEL = [
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
]
EXPECTED = {
    (1, 1): [
        ("batch", "data"),
        ("vocab", "model"),
        ("embed", None),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("joined_kv", "model"),
        *REPLICATED,
    ],
    (2, 1): [*MODEL_PARALLEL, ("embed", "model"), *REPLICATED],
    (1, 2): [*MODEL_PARALLEL, ("embed", "data"), *REPLICATED],
    (2, 2): [*MODEL_PARALLEL, ("embed", "model"), ("embed", "data"), *REPLICATED],
}


@pytest.mark.parametrize(("dims", "rules"), EXPECTED.items())
def test_rules_are_t5x_rules(dims, rules):
    assert standard_logical_axis_rules(*dims) == rules


def test_defaults_and_additional_rules_are_appended():
    extra = [("expert", "data"), ("unmodeled", None)]
    assert standard_logical_axis_rules() == EXPECTED[(1, 1)]
    assert standard_logical_axis_rules(additional_rules=extra) == [*EXPECTED[(1, 1)], *extra]


@pytest.mark.parametrize("dims", [(3, 1), (1, 0), (0, 2)])
def test_unsupported_dims(dims):
    with pytest.raises(
        EscaleError,
        match=rf"`activation_partitioning_dims` = {dims[0]} `parameter_partitioning_dims` = "
        rf"{dims[1]} is not supported",
    ):
        standard_logical_axis_rules(*dims)


def test_axis_names_is_a_pytree_leaf():
    names = AxisNames("batch", "embed")
    assert names == ("batch", "embed")
    assert isinstance(names, tuple)
    tree = {"a": names, "b": [AxisNames("mlp")]}
    assert jax.tree_util.tree_leaves(tree) == [names, AxisNames("mlp")]
    assert jax.tree.map(lambda n: len(n), tree) == {"a": 2, "b": [1]}
    assert repr(names) == "AxisNames('batch', 'embed')"
    assert repr(AxisNames("mlp")) == "AxisNames('mlp')"
    assert AxisNames() == ()
