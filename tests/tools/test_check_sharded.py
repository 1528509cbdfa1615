"""Tests of ``check_sharded`` (``flax_escale/tools/_check_sharded.py``): large arrays split over
the mesh axes their shapes allow."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe


def test_check_sharded_passes_good_layouts_and_names_offenders():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    good = {
        "w": jax.ShapeDtypeStruct(
            (1024, 1024), np.float32, sharding=NamedSharding(mesh, P("fsdp", "tp"))
        )
    }
    fe.check_sharded(good)
    half = {
        "big": jax.ShapeDtypeStruct(
            (1024, 1024), np.float32, sharding=NamedSharding(mesh, P("fsdp"))
        ),
        "replicated": jax.ShapeDtypeStruct(
            (2048, 1024), np.float32, sharding=NamedSharding(mesh, P())
        ),
        "small": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P())),
    }
    with pytest.raises(fe.UnshardedParameterError, match=r"2 large array\(s\)") as caught:
        fe.check_sharded(half)
    message = str(caught.value)
    assert message.index("replicated") < message.index("big")  # largest first
    assert "could also use ['tp']" in message
    assert "small" not in message
    fe.check_sharded(half, min_bytes=1 << 30)
    fe.check_sharded({"big": half["big"]}, tolerance=1.0)


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.check_sharded(params(), "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="check_sharded-mesh-string",
    ),
    case(
        lambda: fe.check_sharded("params", mesh_dp_tp()),
        T,
        "tree",
        "'params'",
        r"variables\['params'\]",
        id="check_sharded-string",
    ),
    case(
        lambda: fe.check_sharded(42, mesh_dp_tp()),
        T,
        "tree",
        "int 42",
        "pytree of arrays",
        id="check_sharded-int",
    ),
    case(
        lambda: fe.check_sharded(None, mesh_dp_tp()),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="check_sharded-none",
    ),
    case(
        lambda: fe.check_sharded({"w": "kernel"}, mesh_dp_tp()),
        T,
        "tree",
        "{'w': 'kernel'}",
        "no array leaf",
        id="check_sharded-no-arrays",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), min_bytes="1MB"),
        T,
        "min_bytes",
        "'1MB'",
        "int of at least 0",
        id="check_sharded-min_bytes-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), min_bytes=-1),
        fe.EscaleError,
        "min_bytes",
        "-1",
        "int of at least 0",
        id="check_sharded-min_bytes-negative",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), tolerance="0.1"),
        T,
        "tolerance",
        "'0.1'",
        "not a string",
        id="check_sharded-tolerance-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), tolerance=-0.1),
        fe.EscaleError,
        "tolerance",
        "-0.1",
        "at least 0",
        id="check_sharded-tolerance-negative",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), top="5"),
        T,
        "top",
        "'5'",
        "pass the int 5",
        id="check_sharded-top-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), rules="batch"),
        T,
        "rules",
        "'batch'",
        "pairs",
        id="check_sharded-rules-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
