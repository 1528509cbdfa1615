"""Mistakes users make with the resolution of logical axes, one case each.

Cases for ``as_logical_rules``, ``logical_to_mesh_axes``, ``resolve_logical_axes`` and
``fit_mesh_axes``. What a case asserts, and the rest of the table: ``support/mistakes.py``.
"""

import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import (
    MISTAKE,
    T,
    case,
    mesh_dp_tp,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale.resolve import as_logical_rules, fit_mesh_axes

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fe.logical_to_mesh_axes("batch"),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="logical_to_mesh_axes-string",
    ),
    case(
        lambda: fe.resolve_logical_axes("batch"),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="resolve_logical_axes-string",
    ),
    case(
        lambda: fe.resolve_logical_axes("batch", shape=(8,), mesh=mesh_dp_tp()),
        T,
        "logical_axes",
        "'batch'",
        r"pass \('batch',\)",
        id="resolve_logical_axes-string-mesh",
    ),
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
    # --- wrong entries inside a sequence of names ------------------------------------------
    case(
        lambda: fe.resolve_logical_axes(("batch", 3)),
        T,
        "logical_axes",
        "int 3",
        "logical name",
        id="resolve_logical_axes-entry-int",
    ),
    case(
        lambda: fe.logical_to_mesh_axes(("batch", 4.0)),
        T,
        "logical_axes",
        "float 4.0",
        "logical name",
        id="logical_to_mesh_axes-entry-float",
    ),
    case(
        lambda: fe.resolve_logical_axes(7),
        T,
        "logical_axes",
        "int 7",
        r"\('batch'",
        id="resolve_logical_axes-int",
    ),
    # --- a wrong type where a mesh is expected ---------------------------------------------
    case(
        lambda: fe.resolve_logical_axes(("batch",), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="resolve_logical_axes-mesh-string",
    ),
    case(
        lambda: fe.logical_to_mesh_axes(("batch",), shape=(8,), mesh={"dp": 8}),
        T,
        "mesh",
        "{'dp': 8}",
        r"create_mesh\(",
        id="logical_to_mesh_axes-mesh-dict",
    ),
    case(
        lambda: fit_mesh_axes(("dp",), shape=(8,), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="fit_mesh_axes-mesh-string",
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


def test_valid_rules_still_freeze():
    rules = as_logical_rules([("batch", ["fsdp", "dp"]), ("embed", None), ("mlp", "tp")])
    assert rules == (("batch", ("fsdp", "dp")), ("embed", None), ("mlp", "tp"))
