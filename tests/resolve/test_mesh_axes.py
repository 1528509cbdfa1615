"""``fit_mesh_axes`` (``flax_escale/resolve/_mesh_axes.py``): mesh axes fitted to a shape and a
mesh."""

import re

import pytest
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, raises_a_library_error

from flax_escale import ShardingResolutionError, create_mesh
from flax_escale.resolve import fit_mesh_axes


@pytest.fixture
def mesh2(devices):
    return create_mesh((2, 4), ("dp", "tp"))


@pytest.mark.parametrize(
    ("spec", "shape", "expected", "kinds"),
    [
        (("dp", "tp"), (8, 8), P("dp", "tp"), []),
        (("dp", "tp"), (8, 6), P("dp", None), [("not_divisible", 1)]),
        ((("dp", "tp"),), (16, 3), P(("dp", "tp"), None), []),
        ((("dp", "tp"),), (12,), P(None), [("not_divisible", 0)]),
        (("tp", "tp"), (8, 8), P("tp", None), [("reused", 1)]),
        (("fsdp", None), (8, 8), P(None, None), [("not_in_mesh", 0)]),
        (("dp", None, "tp"), (8, 8), P("dp", None), [("truncated", 2)]),
        ((None,), (8, 8), P(None, None), []),
        ((), (), P(), []),
    ],
)
def test_fit_mesh_axes(mesh2, spec, shape, expected, kinds):
    r = fit_mesh_axes(spec, shape=shape, mesh=mesh2)
    assert r.spec == expected
    assert r.rules_spec == P(*spec)
    assert r.shape == shape
    assert r.mesh_shape == (("dp", 2), ("tp", 4))
    assert r.logical_axes is None
    assert [(c.kind, c.dim) for c in r.corrections] == kinds
    assert r.ok is (not kinds)


def test_fit_mesh_axes_accepts_an_abstract_mesh(mesh2):
    r = fit_mesh_axes(("dp", "tp"), shape=(8, 6), mesh=mesh2.abstract_mesh)
    assert r.spec == P("dp", None)


def test_fit_mesh_axes_strict_message(mesh2):
    with pytest.raises(ShardingResolutionError) as info:
        fit_mesh_axes(("dp", "tp"), shape=(8, 6), mesh=mesh2, strict=True, path="dense/kernel")
    message = str(info.value)
    assert message.startswith(
        f"parameter 'dense/kernel': mesh axes {P('dp', 'tp')} with shape (8, 6) on mesh "
        f"{{'dp': 2, 'tp': 4}} resolve to {P('dp', 'tp')}, corrected to {P('dp', None)}:"
    )
    assert "dimension 1: size 6 is not divisible by ('tp',) of total size 4" in message
    assert "dropped ('tp',)" in message
    assert message.endswith("(strict=True; pass strict=False to correct instead.)")


def test_fit_mesh_axes_strict_without_path(mesh2):
    expected = "^" + re.escape(f"mesh axes {P('fsdp')} with shape")
    with pytest.raises(ShardingResolutionError, match=expected):
        fit_mesh_axes(("fsdp",), shape=(8,), mesh=mesh2, strict=True)


def test_fit_mesh_axes_strict_passes_a_valid_spec(mesh2):
    r = fit_mesh_axes((None, ("dp", "tp")), shape=(3, 16), mesh=mesh2, strict=True)
    assert r.spec == P(None, ("dp", "tp"))
    assert r.corrections == ()


CASES = [
    case(
        lambda: fit_mesh_axes(("dp",), shape=(8,), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="fit_mesh_axes-mesh-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
