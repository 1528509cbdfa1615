"""t5x's ``get_mesh`` (``flax_escale/t5x/_tiling.py``): its mistakes."""

import pytest
from support.mistakes import (
    MISTAKE,
    T,
    case,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import t5x

CASES = [
    case(
        lambda: t5x.get_mesh(2),
        T,
        "model_parallel_submesh",
        "int 2",
        r"tuple of sizes",
        id="t5x-get_mesh-submesh-int",
    ),
    case(
        lambda: t5x.get_mesh((1, 1, 2)),
        fe.MeshError,
        "model_parallel_submesh",
        "(1, 1, 2)",
        r"like the hardware mesh \(1, 8\)",
        id="t5x-get_mesh-submesh-rank",
    ),
    case(
        lambda: t5x.get_mesh((1, 2), input_devices=8),
        T,
        "input_devices",
        "int 8",
        r"jax\.devices\(\)\[:8\]",
        id="t5x-get_mesh-devices-count",
    ),
    case(
        lambda: t5x.get_mesh((1, 2), backend="tpuu"),
        fe.EscaleError,
        "backend",
        "'tpuu'",
        "platforms JAX lists",
        id="t5x-get_mesh-backend-unknown",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
