"""``as_logical_rules`` (``flax_escale/resolve/_rules.py``): rules read, checked and frozen."""

import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import (
    EscaleError,
)
from flax_escale.resolve import as_logical_rules


def test_valid_rules_still_freeze():
    rules = as_logical_rules([("batch", ["fsdp", "dp"]), ("embed", None), ("mlp", "tp")])
    assert rules == (("batch", ("fsdp", "dp")), ("embed", None), ("mlp", "tp"))


CASES = [
    case(
        lambda: as_logical_rules("batch"),
        T,
        "rules",
        "'batch'",
        r"\[\('batch', 'dp'\)\]",
        id="rules-string",
    ),
    case(
        lambda: fe.logical_to_mesh_axes(("batch",), rules="batch"),
        T,
        "rules",
        "'batch'",
        r"pairs",
        id="logical_to_mesh_axes-rules-string",
    ),
    # --- malformed rules, named where they enter -------------------------------------------
    case(
        lambda: as_logical_rules([("batch", 3)]),
        T,
        "rules",
        "('batch', 3)",
        "a name, a tuple of names or None",
        id="rule-target-int",
    ),
    case(
        lambda: as_logical_rules([("batch", ("fsdp", 3))]),
        T,
        "rules",
        "('batch', ('fsdp', 3))",
        "a name, a tuple of names or None",
        id="rule-target-tuple-with-int",
    ),
    case(
        lambda: as_logical_rules([("batch", ["fsdp", 3])]),
        T,
        "rules",
        "('batch', ['fsdp', 3])",
        "a name, a tuple of names or None",
        id="rule-target-list-with-int",
    ),
    case(
        lambda: as_logical_rules([("batch", {"dp"})]),
        T,
        "rules",
        "('batch', {'dp'})",
        "a name, a tuple of names or None",
        id="rule-target-set",
    ),
    case(
        lambda: as_logical_rules([("kernel",)]),
        T,
        "rules",
        "('kernel',)",
        r"\(logical name, mesh axes\) pair",
        id="rule-one-element",
    ),
    case(
        lambda: as_logical_rules([("batch", "dp", "fsdp")]),
        T,
        "rules",
        "('batch', 'dp', 'fsdp')",
        r"\('embed', \('fsdp', 'tp'\)\)",
        id="rule-three-elements",
    ),
    case(
        lambda: as_logical_rules([(3, P())]),
        T,
        "rules",
        repr((3, P())),
        "must be a string",
        id="rule-name-int",
    ),
    case(
        lambda: as_logical_rules([(None, "dp")]),
        T,
        "rules",
        "(None, 'dp')",
        "must be a string",
        id="rule-name-none",
    ),
    case(
        lambda: as_logical_rules(["batch"]),
        T,
        "rules",
        "'batch'",
        r"\(logical name, mesh axes\) pair",
        id="rule-bare-string",
    ),
    case(lambda: as_logical_rules(42), T, "rules", "int 42", "PartitionAxis", id="rules-int"),
    case(
        lambda: as_logical_rules({"batch": "dp"}),
        T,
        "rules",
        "{'batch': 'dp'}",
        "PartitionAxis",
        id="rules-dict",
    ),
    case(
        lambda: fe.logical_to_mesh_axes(("batch",), rules=[("batch", 3)]),
        T,
        "rules",
        "('batch', 3)",
        "a name",
        id="logical_to_mesh_axes-rule-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ([("a",)], r"each rule must be a \(logical name, mesh axes\) pair, got \('a',\)"),
        (["ab"], r"each rule must be a \(logical name, mesh axes\) pair, got 'ab'"),
        ([(1, "x")], r"the logical name of rule \(1, 'x'\) must be a string"),
        ([("a", {"x"})], r"the mesh axes of rule \('a', \{'x'\}\) must be a name"),
    ],
)
def test_bad_rules(rules, match):
    with pytest.raises(EscaleError, match=match):
        as_logical_rules(rules)


def test_as_logical_rules_freezes_lists():
    assert as_logical_rules([["a", ["x", "y"]]]) == (("a", ("x", "y")),)
    frozen = (("a", "x"),)
    assert as_logical_rules(frozen) is frozen
