"""``ShardingPlan.diff`` (``flax_escale/plan/_diff.py``): what changes between two plans."""

import pytest
from jax.sharding import PartitionSpec as P
from support.mlp_plan import Mlp, mlp_plan
from support.wide_tables import WIDTHS, assert_readable, header_cells, rendered, transformer_plan

from flax_escale.errors import EscaleTypeError


def test_diff_of_two_meshes_lists_specs_and_bytes():
    before, after = mlp_plan(), mlp_plan(mesh=(1, 8, 1, 1, 1))
    diff = before.diff(after)
    assert bool(diff)
    assert len(diff) == 2
    assert diff.unchanged == 2
    kernel = next(c for c in diff if c.path == "params/Dense_0/kernel")
    assert kernel.kinds == ("spec",)
    assert kernel.before.spec == P(("fsdp", "sp"), "tp")
    assert kernel.after.spec == P(("fsdp", "sp"), None)
    assert kernel.bytes_before == kernel.bytes_after == 8 * 32 * 4 // 8
    assert diff.summary() == (
        "2 array(s) differ, 2 the same (mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1) -> (dp=1, "
        "fsdp=8, ep=1, tp=1, sp=1)); bytes per device +0"
    )


def test_diff_of_two_rule_sets_and_two_model_versions():
    before = mlp_plan()
    after = mlp_plan(rules=[("hidden_state", "fsdp")])
    diff = before.diff(after)
    changed = {c.path: c.kinds for c in diff}
    assert changed["params/Dense_0/kernel"] == ("spec", "bytes")
    assert diff.changes[0].bytes_after == 2 * diff.changes[0].bytes_before
    grown = mlp_plan(Mlp(extra=True))
    kinds = {c.path: c.kinds for c in before.diff(grown)}
    assert kinds == {"params/extra/kernel": ("added",), "params/extra/bias": ("added",)}
    assert {c.path: c.kinds for c in grown.diff(before)} == {
        "params/extra/kernel": ("removed",),
        "params/extra/bias": ("removed",),
    }
    assert "added" in before.diff(grown).describe()


def test_diff_of_corrections_and_its_table():
    before = mlp_plan(rules=[("hidden_state", "fsdp"), ("mlp_intermediate", "tp")])
    after = mlp_plan(rules=[("hidden_state", "fsdp"), ("mlp_intermediate", "expert")])
    diff = before.diff(after)
    change = next(c for c in diff if c.path == "params/Dense_0/kernel")
    assert change.kinds == ("spec", "bytes", "corrections")
    text = diff.describe()
    assert "corrections: none -> mesh axis 'expert' is not in the mesh" in text
    table = diff.table()
    assert [c.header for c in table.columns][:4] == ["path", "what", "spec before", "spec after"]
    assert table.row_count == len(diff)


def test_diff_refuses_what_is_not_a_plan():
    with pytest.raises(EscaleTypeError, match=r"other must be a ShardingPlan, got dict {}"):
        mlp_plan().diff({})


# --- the table at every width ------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_the_diff_table_reads_at_every_width_in_a_log(width):
    # The same train state on fsdp=4 tp=2 and on fsdp=8: most arrays change spec or bytes.
    diff = transformer_plan((1, 4, 1, 2, 1)).diff(transformer_plan((1, 8, 1, 1, 1)))
    assert len(diff) > 30
    text = rendered(diff.table(), width)
    assert_readable(text, width, [c.path for c in diff])
    shown = header_cells(text)
    assert shown[0] == "path"
    assert {"spec before", "spec after"} <= set(shown)
    # Left out in this order as the width shrinks: notes, the bytes, what changed.
    order = ["path", "what", "spec before", "spec after", "before", "after", "notes"]
    assert shown == [c for c in order if c in shown]
    assert ("notes" in shown) == (width >= 160)
    assert ("what" in shown) == (width >= 100)


def test_a_diff_of_no_notes_leaves_the_column_out_and_narrow_it_is_plain():
    diff = mlp_plan().diff(mlp_plan(mesh=(1, 8, 1, 1, 1)))
    assert "notes" not in header_cells(rendered(diff.table(), 200))
    text = rendered(diff, 40)
    assert text.startswith(" ".join(diff.summary().split()[:3]))
    assert "┃" not in text
    assert_readable(text, 40, [c.path for c in diff])
