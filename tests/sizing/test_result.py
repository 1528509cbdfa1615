"""``MeshPlan`` and ``Candidate``: the plan's table, recommendation and explanations.

What a case of the table asserts: ``support/mistakes.py``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.tiny_workloads import Tiny, nnx_workload, plan, planned
from support.wide_tables import WIDTHS, assert_readable, header_cells, rendered

import flax_escale as fe
from flax_escale import sizing

CASES = [
    # --- the plan's results --------------------------------------------------------------------
    case(
        lambda: planned().table(top=0),
        fe.EscaleError,
        "top",
        "0",
        "positive int",
        id="MeshPlan.table-top-zero",
    ),
    case(
        lambda: planned().table(top=True),
        T,
        "top",
        "bool True",
        "positive int",
        id="MeshPlan.table-top-bool",
    ),
    case(
        lambda: planned().table(top=1.5),
        T,
        "top",
        "float 1.5",
        "positive int",
        id="MeshPlan.table-top-float",
    ),
    case(
        lambda: planned().best.explain(3),
        T,
        "profile",
        "int 3",
        r"pass one of \[.*'h100'",
        id="Candidate.explain-profile-int",
    ),
    case(
        lambda: planned().best.explain("h900"),
        fe.EscaleError,
        "profile",
        "'h900'",
        r"pass one of \[.*'h100'",
        id="Candidate.explain-profile-unknown",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_explain_takes_a_profile_or_its_name():
    best = planned().best
    assert best.explain("h100") == best.explain(sizing.PROFILES["h100"])


def test_every_mesh_pruned_is_not_said_to_be_out_of_memory():
    # A batch of 3 splits over no mesh of 2 devices: nothing was compiled, so no figure says
    # anything about memory.
    odd = sizing.Workload(
        Tiny(), jax.random.key(0), (jax.ShapeDtypeStruct((3, 16), jnp.float32),), tx=optax.sgd(0.1)
    )
    result = plan(odd)
    assert result.best is None
    assert result.recommendation() == (
        "No mesh was compiled: all 1 meshes of 2 devices were pruned, as none can run the "
        f"workload as asked. The first, fsdp=2: {result.candidates[0].figures.reason}."
    )
    assert "cannot be split on fsdp=2" in result.recommendation()


# --- what the plan says --------------------------------------------------------------------------


def test_a_float_batch_counts_one_token_a_row():
    # X is 8 rows of 16 features, split over fsdp=2: 4 tokens a device, not 8 x 16 / 2.
    best = planned().best
    assert best.figures.tokens_per_device == 4
    assert "; 4 tokens/device, under the 2,198 from which data/FSDP" in best.explain("h100")


def test_token_ids_count_batch_times_sequence_per_device():
    ids = jax.ShapeDtypeStruct((64, 1024), jnp.int32)
    embedded = sizing.Workload(
        lambda rngs: nnx.Embed(16, 8, rngs=rngs), 0, tx=optax.sgd(0.1), batch=(ids,)
    )
    result = plan(embedded, memory="64MiB")
    assert [c.figures.tokens_per_device for c in result.candidates] == [64 * 1024 / 2]


def test_the_recommendation_binds_what_init_sharded_returns_for_the_front_end():
    linen = planned()
    assert linen.front_end == "linen"
    assert linen.recommendation().splitlines()[-1] == (
        "variables = flax_escale.init_sharded(model, mesh, rng, *args, rules=rules)"
    )
    module = plan(nnx_workload())
    assert module.front_end == "nnx"
    assert module.recommendation().splitlines()[-1] == (
        "model = flax_escale.init_sharded(Model, mesh, rng, *args, rules=rules)"
    )


def test_the_title_tells_a_chosen_budget_from_the_hardwares_memory_and_says_whose_figures():
    result = dataclasses.replace(planned(), seconds=3.0)
    assert result.title() == (
        "2 devices, a memory budget of 1.00 MiB per device (as given; the NVIDIA H100 SXM has "
        "74.51 GiB)\nmemory, FLOPs and collectives compiled by XLA:CPU, 2 simulated devices in "
        "3 s; step times estimated for NVIDIA H100 SXM (989 TFLOP/s, 450 GB/s interconnect)"
    )
    full = dataclasses.replace(result, memory_bytes=80 * 10**9)
    assert full.title().startswith(
        "2 devices, a memory budget of 74.51 GiB per device (the NVIDIA H100 SXM's memory)\n"
    )


def test_every_column_of_the_table_has_a_header():
    headers = [column.header for column in planned().table().columns]
    assert all(headers)
    assert "budget" in headers


# --- the table at every width ------------------------------------------------------------


def _figures(label, status, peak=None, reason="", corrections=()):
    shape = dict.fromkeys(("dp", "fsdp", "ep", "tp", "sp"), 1)
    for part in label.split():
        axis, size = part.split("=")
        shape[axis] = int(size)
    compiled = status == "compiled"
    return sizing.Figures(
        shape=shape,
        status=status,
        reason=reason,
        corrections=corrections,
        state_bytes=peak // 2 if peak else None,
        init_peak_bytes=peak if compiled else None,
        step_peak_bytes=peak if compiled else None,
        flops=3e12 if compiled else None,
        collectives={"all-gather": [24, 2e8, 2e8], "reduce-scatter": [12, 1e8, 1e8]}
        if compiled
        else {},
        tokens_per_device=2048.0 if compiled else None,
    )


def ranked_meshes():
    """Eight meshes of 8 devices, ranked without compiling: fitting, too large, pruned."""
    gib = 1 << 30
    figures = [
        _figures("fsdp=8", "compiled", 20 * gib),
        _figures("fsdp=4 tp=2", "compiled", 18 * gib),
        _figures(
            "dp=2 fsdp=2 tp=2",
            "compiled",
            24 * gib,
            corrections=("params/blocks/attention/k_proj/bias dim 1: ('tp',) dropped",),
        ),
        _figures("fsdp=2 tp=4", "compiled", 90 * gib),
        _figures("dp=8", "state too large", 120 * gib),
        _figures("tp=8", "pruned", reason="8 key-value heads' dimension 2 splits over no tp=8"),
        _figures("dp=2 tp=4", "compiled", 30 * gib),
        _figures("dp=4 tp=2", "skipped", reason="the time budget ran out"),
    ]
    return sizing.MeshPlan.rank(
        figures,
        sizing.PROFILES["h100"],
        devices=8,
        memory_bytes=80 * gib,
        rules=None,
        seconds=95.0,
        time_budget=None,
        backend="XLA:CPU, 8 simulated devices",
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_the_table_reads_at_every_width_in_a_log(width):
    plan = ranked_meshes()
    text = rendered(plan.table(), width)
    # Each mesh's label, one a row, in the mesh column, whole.
    assert_readable(text, width, [c.label for c in plan.candidates], index=1)
    shown = header_cells(text)
    assert shown[:3] == ["#", "mesh", "peak / device"]
    assert "est. step" in shown
    assert "budget" in shown or width < 120  # the bar gives way first
    assert "notes" in shown  # the verdicts: pruned, does not fit
    assert all(h for h in shown)  # every column has a header


def test_the_table_below_its_key_columns_is_plain_rows():
    plan = ranked_meshes()
    text = rendered(plan.table(), 30)
    assert "┃" not in text
    assert all(c.label in text for c in plan.candidates)
