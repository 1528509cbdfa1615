"""t5x's axes (``flax_escale/t5x/_axes.py``): ``standard_logical_axis_rules`` and ``AxisNames``."""

import flax.linen as nn
import jax
import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import (
    MISTAKE,
    T,
    case,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import EscaleError, t5x
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


CASES = [
    case(
        lambda: t5x.standard_logical_axis_rules(3),
        fe.EscaleError,
        "activation_partitioning_dims",
        "3",
        "each must be 1 or 2",
        id="t5x-standard_rules-dims-three",
    ),
    case(
        lambda: t5x.standard_logical_axis_rules("1"),
        T,
        "activation_partitioning_dims",
        "'1'",
        r"each must be 1 or 2 \(an int\)",
        id="t5x-standard_rules-dims-string",
    ),
    case(
        lambda: t5x.standard_logical_axis_rules(additional_rules="batch"),
        T,
        "additional_rules",
        "'batch'",
        r"pass e\.g\. \[\('expert', 'model'\)\]",
        id="t5x-standard_rules-additional-string",
    ),
    case(
        lambda: t5x.standard_logical_axis_rules(additional_rules=[("batch", 3)]),
        T,
        "additional_rules",
        "('batch', 3)",
        "a mesh axis name, or a tuple or list of mesh axis names",
        id="t5x-standard_rules-additional-int-axes",
    ),
    case(
        lambda: t5x.standard_logical_axis_rules(additional_rules=[("batch",)]),
        T,
        "additional_rules",
        "('batch',)",
        r"not a pair; pass e\.g\. \[\('expert', 'model'\)\]",
        id="t5x-standard_rules-additional-one-item",
    ),
    case(
        lambda: t5x.AxisNames("batch", 3),
        T,
        "AxisNames",
        "('batch', 3)",
        "one logical name \\(a string\\), a tuple of names or None per dimension",
        id="t5x-AxisNames-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_standard_rules_target_the_mesh_axes_given():
    rules = standard_logical_axis_rules(2, 2, data_axis=("fsdp", "dp"), model_axis="tp")
    assert ("batch", ("fsdp", "dp")) in rules
    assert ("embed", "tp") in rules
    assert ("embed", ("fsdp", "dp")) in rules
    assert ("kv", None) in rules
    assert not any(target in ("data", "model") for _, target in rules)
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P(("fsdp", "dp"), "tp")


def test_standard_rules_keep_t5x_axes_by_default():
    assert standard_logical_axis_rules()[:2] == [("batch", "data"), ("vocab", "model")]


def test_standard_rules_refuse_a_bad_mesh_axis():
    with pytest.raises(
        fe.EscaleTypeError, match=r"model_axis must be None, a mesh axis name.*int 3"
    ):
        standard_logical_axis_rules(model_axis=3)
