"""t5x's device coordinates and bounds (``flax_escale/t5x/_hardware.py``): their mistakes."""

import jax
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
        lambda: t5x.get_coords(None),
        T,
        "device",
        "None",
        r"jax\.devices\(\)\[-1\]",
        id="t5x-get_coords-none",
    ),
    case(
        lambda: t5x.get_coords(jax.devices()[0], local_device_count=0),
        fe.EscaleError,
        "local_device_count",
        "0",
        "positive int",
        id="t5x-get_coords-count-zero",
    ),
    case(
        lambda: t5x.bounds_from_last_device("cpu:7"),
        T,
        "last_device",
        "'cpu:7'",
        r"jax\.devices\(\)\[-1\]",
        id="t5x-bounds_from_last_device-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
