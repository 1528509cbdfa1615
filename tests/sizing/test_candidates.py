"""``mesh_shapes``: every ordered factorization of the devices over the planned axes."""

import math

import pytest

import flax_escale as fe
from flax_escale.sizing import mesh_shapes


def test_mesh_shapes_lists_every_ordered_factorization():
    shapes = mesh_shapes(12, ("fsdp", "tp"))
    pairs = [(s["fsdp"], s["tp"]) for s in shapes]
    assert sorted(pairs) == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)]
    assert pairs[0] == (12, 1)  # most devices on the earliest axis first
    for s in shapes:
        assert list(s) == ["dp", "fsdp", "ep", "tp", "sp"]
        assert math.prod(s.values()) == 12
        assert s["dp"] == s["ep"] == s["sp"] == 1
    assert len(mesh_shapes(8, ("dp", "fsdp", "tp"))) == 10
    assert mesh_shapes(7, ("tp",)) == [{"dp": 1, "fsdp": 1, "ep": 1, "tp": 7, "sp": 1}]
    with pytest.raises(fe.EscaleError, match="must be distinct axes"):
        mesh_shapes(8, ("fsdp", "fsdp"))
    with pytest.raises(fe.EscaleError, match="at least one"):
        mesh_shapes(8, ())
