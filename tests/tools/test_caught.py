"""Tests of ``catching_corrections`` and ``corrections_table`` (``flax_escale/tools/_caught.py``):
corrections said while tracing, kept as rows rather than printed."""

import os
import warnings

import pytest
from support.wide_tables import WIDTHS, assert_readable, rendered

import flax_escale as fe
from flax_escale.resolve import enforce
from flax_escale.tools._caught import CaughtCorrection, catching_corrections, corrections_table


def test_a_constraint_and_a_parameter_are_kept_briefly_each_once():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    resolution = fe.resolve_logical_axes(("batch", None), shape=(6, 8), mesh=mesh)
    path = "params/blocks/attention/k_proj/bias"
    with catching_corrections() as found:
        for _ in range(2):  # traced twice: kept once
            enforce(resolution, strict=False, stacklevel=1)
            enforce(resolution, strict=False, path=path, stacklevel=1)
    dropped = (
        "dimension 0 (batch): size 6 is not divisible by the mesh axes of any of its rules "
        "(('fsdp', 'dp') of size 4); dropped ('fsdp', 'dp')"
    )
    asked = "('batch', None) on (6, 8) -> P(None, None)"
    assert [(c.constraint, c.correction, c.path) for c in found] == [
        (asked, dropped, None),
        (asked, dropped, path),
    ]
    # This file, relative to the working folder, and the line that asked.
    assert found[0].where.startswith(os.path.relpath(__file__) + ":")
    assert found[0].where != found[1].where


def _warn_twice():
    with catching_corrections() as found:
        warnings.warn("old", DeprecationWarning, stacklevel=1)
        warnings.warn_explicit(
            "logical name 'embed' has no rule, so it stays unsharded. Add a rule.",
            fe.ShardingCorrectionWarning,
            "/elsewhere/model.py",
            7,
        )
    return found


def test_other_warnings_pass_on_and_a_file_outside_the_folder_is_named_alone():
    with pytest.warns(DeprecationWarning, match="old"):
        found = _warn_twice()
    assert found == [
        CaughtCorrection(
            "model.py:7", "logical name 'embed' has no rule, so it stays unsharded. Add a rule.", ""
        )
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_the_table_reads_at_every_width(width):
    rows = [
        CaughtCorrection(
            f"examples/models/long_module_name_{i}.py:{100 + i}",
            "('batch', 'sequence', 'hidden_state') on (16, 32, 64) -> P(None, 'sp', 'tp')",
            "dimension 0 (batch): size 16 is not divisible by the mesh axes of any of its rules "
            "(('fsdp', 'dp') of size 3); dropped ('fsdp', 'dp')",
        )
        for i in range(3)
    ]
    text = rendered(corrections_table(rows, "3 activation constraint(s) corrected"), width)
    assert_readable(text, width, [r.where for r in rows])
