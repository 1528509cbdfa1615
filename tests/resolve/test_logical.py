"""``resolve_logical_axes`` and ``logical_to_mesh_axes`` (``flax_escale/resolve/_logical.py``):
their arguments."""

import pytest
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe

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
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
