"""plan_mesh with context parallelism: a workload with ``context_parallel`` gets, on each mesh
whose ``sp`` splits the sequence, its context-parallel forms compiled (the formulas' pick
first, the others only where it does not fit, or all when exhaustive), ranked with the other
candidates and explained: the formulas' figures beside the compiled collectives."""

import dataclasses
import io

import pytest
from rich.console import Console
from support.example_modules import load

from flax_escale.context import AttentionShape
from flax_escale.sizing import MeshPlan, plan_mesh
from tests.support.context_workloads import workload


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the exhaustive plan reads the figures the first compiled."""
    return tmp_path_factory.mktemp("plan")


@pytest.fixture(scope="module")
def plan(cache):
    """2 devices over fsdp and sp: fsdp=2 and sp=2, plain, and sp=2 with the formulas' pick."""
    return plan_mesh(workload(), devices=2, axes=("fsdp", "sp"), memory="1GiB", cache=cache)


def by_label(plan):
    return {c.label: c for c in plan.candidates}


def test_the_pick_of_the_formulas_is_compiled_on_each_mesh_splitting_the_sequence(plan):
    # On H100 figures this tiny attention is latency-bound: ring's one hop over sp=2 edges out
    # the gather (the same bytes, none of the attention exposed before it) and ulysses' four
    # all-to-alls. The pick fits, so the other strategies are not compiled.
    assert set(by_label(plan)) == {"fsdp=2", "sp=2", "sp=2 ring"}
    assert all(c.figures.status == "compiled" and c.fits for c in plan.candidates)
    # Ranked with the others by the same estimate.
    times = [c.step_seconds for c in plan.fitting]
    assert times == sorted(times)
    assert len(plan.fitting) == 3
    ring = by_label(plan)["sp=2 ring"]
    assert ring.figures.context["strategy"] == "ring"
    assert ring.figures.context["axes"] == ["sp"]


def test_the_compiled_exchange_is_the_formula_forward_and_backward(plan):
    ring = by_label(plan)["sp=2 ring"]
    shape = AttentionShape(**ring.figures.context["shape"])
    forward = shape.bytes_received("ring")  # one hop of half of K and V: 2 x 4 x 64 x 2 x 8 x 4 / 2
    assert forward == 16384
    # The permutes of the step: K and V forward, their gradients backward (and the positions).
    permuted = ring.figures.collectives["collective-permute"][2]
    assert 2 * forward <= permuted <= 2.1 * forward
    # XLA's own attention on the same mesh permutes nothing.
    assert "collective-permute" not in by_label(plan)["sp=2"].figures.collectives


def test_the_notes_and_the_explanation_name_the_strategy_and_its_figures(plan):
    ring = by_label(plan)["sp=2 ring"]
    note = ring.explain(plan.profile)
    assert note.startswith(
        "context ring over sp=2: 16.00 KiB a device a layer by the formula (forward), a hop does "
        "not hide; auto would pick ring; compiled collective-permute "
    )
    text = ring.explain_context("h100")
    assert text.splitlines()[0] == "context parallelism: ring over sp=2"
    assert "batch 4, sequence 64 (32 tokens a device), 2 query and 2 key/value heads" in text
    assert "  ulysses: " in text
    assert "<- this candidate" in text
    assert "compiled step (every layer, forward and backward): " in text
    assert by_label(plan)["sp=2"].explain_context("h100") == ""
    shown = io.StringIO()
    Console(file=shown, width=160).print(plan.table())
    assert "sp=2 ring" in shown.getvalue()
    assert "context ring over sp=2" in shown.getvalue()


def test_a_context_parallel_best_says_so_in_the_recommendation(plan):
    contexts = [c.figures for c in plan.candidates if c.figures.context is not None]
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(MeshPlan)}
    del fields["candidates"], fields["profile"]
    only = MeshPlan.rank(contexts, plan.profile, **fields)
    assert only.best.figures.context is not None
    assert (
        "# attention runs flax_escale.context.context_attention(q, k, v, strategy="
        f"{only.best.figures.context['strategy']!r})" in only.recommendation()
    )


@pytest.mark.slow
def test_exhaustive_compiles_every_strategy_that_can_run(cache):
    plan = plan_mesh(
        workload(), devices=2, axes=("sp",), memory="1GiB", exhaustive=True, cache=cache
    )
    found = by_label(plan)
    assert set(found) == {"sp=2", "sp=2 all_gather", "sp=2 ring", "sp=2 ulysses"}
    # Each strategy's exchange is in its compiled step as the collective it compiles to.
    assert "all-to-all" in found["sp=2 ulysses"].figures.collectives
    assert "collective-permute" in found["sp=2 ring"].figures.collectives
    assert "all-to-all" not in found["sp=2 ring"].figures.collectives


@pytest.mark.slow
def test_an_examples_sp_meshes_are_planned_context_parallel_where_its_own_batch_prunes_them():
    # The Llama's step takes 33 tokens (32 inputs and their next tokens), which sp=4 does not
    # divide; its context-parallel form takes 32 inputs, labels and positions, which it does.
    llama = load("nnx_llama")
    plan = plan_mesh(llama.workload, devices=4, axes=("sp",), memory="1GiB", cache=False)
    pruned, compiled = by_label(plan)["sp=4"], plan.fitting
    assert pruned.figures.status == "pruned"
    assert "(16, 33)" in pruned.figures.reason
    # 2 key/value heads do not split 4 ways: Ulysses cannot run; the formulas' pick fits.
    (only,) = compiled
    assert only.figures.context["strategy"] in {"all_gather", "ring"}
    assert only.label == f"sp=4 {only.figures.context['strategy']}"
    assert AttentionShape(**only.figures.context["shape"]).sequence == 32
