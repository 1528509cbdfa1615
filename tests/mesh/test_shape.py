"""Mesh shapes from sizes: ``calculate_host_mesh_shape`` and ``resolve_axis_dims``."""

import pytest
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import mesh as fem

CASES = [
    # --- the mesh builders and mesh queries ------------------------------------------------
    case(
        lambda: fe.calculate_host_mesh_shape(8),
        T,
        "global_mesh_shape",
        "int 8",
        r"pass \(8,\)",
        id="calculate_host_mesh_shape-int",
    ),
    case(
        lambda: fe.calculate_host_mesh_shape("2,4"),
        T,
        "global_mesh_shape",
        "'2,4'",
        "parse_mesh_from_string",
        id="calculate_host_mesh_shape-string",
    ),
    case(
        lambda: fe.calculate_host_mesh_shape((2, 4), total_devices="8"),
        T,
        "total_devices",
        "'8'",
        "pass the int 8",
        id="calculate_host_mesh_shape-total-string",
    ),
    case(
        lambda: fe.calculate_host_mesh_shape((2, 4), num_processes=2.0),
        T,
        "num_processes",
        "float 2.0",
        "pass the int 2",
        id="calculate_host_mesh_shape-processes-float",
    ),
    case(
        lambda: fem.resolve_axis_dims(8, 8),
        T,
        "axis_dims",
        "int 8",
        r"\(2, 4\)",
        id="resolve_axis_dims-int",
    ),
    case(
        lambda: fem.resolve_axis_dims((2, 4), "8"),
        T,
        "device_count",
        "'8'",
        "pass the int 8",
        id="resolve_axis_dims-count-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
