"""``fit_spec`` (``flax_escale/resolve/_fit.py``): a spec fitted to a shape and a mesh, and what
had to change."""

import pytest
from jax.sharding import PartitionSpec as P

from flax_escale.resolve import fit_spec

MESH = {"dp": 2, "fsdp": 4, "tp": 2, "sp": 1}


def _kinds(corrections):
    return [(c.kind, c.dim, c.mesh_axes) for c in corrections]


def test_valid_spec_is_kept_and_padded():
    spec, corrections = fit_spec(P(("fsdp", "dp")), (16, 6, 3), MESH)
    assert spec == P(("fsdp", "dp"), None, None)
    assert corrections == ()


def test_truncated_to_the_rank():
    spec, corrections = fit_spec(P("dp", None, "tp"), (4, 4), MESH)
    assert spec == P("dp", None)
    assert _kinds(corrections) == [("truncated", 2, ("tp",))]
    spec, corrections = fit_spec(P("dp", None, None), (4,), MESH)
    assert (spec, corrections) == (P("dp"), ())


@pytest.mark.parametrize(
    ("spec", "shape", "expected", "kinds"),
    [
        (P("tp", "tp"), (4, 4), P("tp", None), [("reused", 1, ("tp",))]),
        (P(("tp", "tp")), (4,), P(None), [("reused", 0, ("tp", "tp"))]),
        (P(("fsdp", "tp"), "tp"), (8, 4), P(("fsdp", "tp"), None), [("reused", 1, ("tp",))]),
        (P("fsdp"), (6,), P(None), [("not_divisible", 0, ("fsdp",))]),
        (P("model", "dp"), (4, 4), P(None, "dp"), [("not_in_mesh", 0, ("model",))]),
        (P("sp", "sp"), (3, 3), P("sp", None), [("reused", 1, ("sp",))]),
        (P("sp"), (3,), P("sp"), []),
    ],
)
def test_corrections(spec, shape, expected, kinds):
    fitted, corrections = fit_spec(spec, shape, MESH)
    assert fitted == expected
    assert _kinds(corrections) == kinds


def test_correction_details_say_what_was_wrong():
    _, (correction,) = fit_spec(P("fsdp"), (6,), MESH)
    assert correction.size == 6
    assert correction.detail == "size 6 is not divisible by ('fsdp',) of total size 4"


def test_without_shape_only_mesh_axes_are_checked():
    spec, corrections = fit_spec(P("fsdp", "model"), None, MESH)
    assert spec == P("fsdp", None)
    assert _kinds(corrections) == [("not_in_mesh", 1, ("model",))]


def test_none_entries_past_the_rank_are_simply_cut():
    spec, corrections = fit_spec(P("dp", None, None, ()), (4,), MESH)
    assert (spec, corrections) == (P("dp"), ())
    spec, corrections = fit_spec(P(None, None, P.UNCONSTRAINED), (4, 4), MESH)
    assert (spec, corrections) == (P(None, None), ())


def test_without_mesh_only_the_rank_and_reuse_are_checked():
    spec, corrections = fit_spec(P("model", "model", "x"), (3, 5), None)
    assert spec == P("model", None)
    assert _kinds(corrections) == [("truncated", 2, ("x",)), ("reused", 1, ("model",))]
    assert fit_spec(P("anything", "else"), (3, 5), None) == (P("anything", "else"), ())


def test_entries_and_specs_of_the_wrong_type_are_refused():
    from flax_escale import EscaleTypeError

    with pytest.raises(EscaleTypeError, match=r"entry 1 of spec P\('dp', 3\) must be None.*int 3"):
        fit_spec(P("dp", 3), (4, 4), MESH)
    with pytest.raises(EscaleTypeError, match=r"got the string 'tp'; write PartitionSpec\('tp'\)"):
        fit_spec("tp", (4, 4, 4), MESH)


def test_fit_spec_reads_entries_with_the_one_reader():
    from flax_escale import _specs
    from flax_escale.resolve import _fit

    assert _fit.mesh_axes_of is _specs.mesh_axes_of
    assert _fit.mesh_axes_of("fsdp") == ("fsdp",)
