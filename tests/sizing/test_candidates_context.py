"""The context-parallel part of the planner's search space (``flax_escale/sizing/_context.py``):
which strategies a mesh whose sequence axes split the sequence gets, in which order, with one
device's share of the attention read from the traced step; and the mistakes in asking for them.
Nothing here compiles."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from support.context_workloads import BATCH, HEAD_DIM, HEADS, SEQ, Decoder, plain, workload

from flax_escale.context import AttentionShape, choose_strategy
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import Target
from flax_escale.sizing import PROFILES, Workload, plan_mesh
from flax_escale.sizing._context import ContextWorkloads, context_link, describe_context
from flax_escale.sizing._evaluate import TRACE_FAILURE, evaluate

H100 = PROFILES["h100"]


def candidates(built, dims):
    mesh = Target.named("cpu", devices=math.prod(dims)).mesh(dims)  # as the planner's
    return ContextWorkloads(built, H100).candidates(mesh)


def test_every_runnable_strategy_fastest_by_the_formulas_first():
    found = candidates(workload(), (1, 2, 1, 1, 2))  # fsdp=2 x sp=2
    # The 2 heads split 2 ways: all three strategies can run.
    assert {c["strategy"] for c in found} == {"all_gather", "ring", "ulysses"}
    # One device's share, read from the step's first context_attention: fsdp=2 halves the
    # batch, the heads are whole (no tp), float32.
    shape = AttentionShape(**found[0]["shape"])
    assert shape == AttentionShape(
        batch=BATCH // 2,
        sequence=SEQ,
        degree=2,
        q_heads=HEADS,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
        itemsize=4,
        causal=True,
    )
    assert all((c["axes"], c["degree"]) == (["sp"], 2) for c in found)
    costs = {c.strategy: c.seconds for c in choose_strategy(shape, context_link(H100)).costs}
    order = [c["strategy"] for c in found]
    assert order == sorted(costs, key=costs.get)
    assert order[0] == choose_strategy(shape, context_link(H100)).strategy


def test_ulysses_is_left_out_where_the_heads_do_not_split():
    found = candidates(workload(), (1, 1, 1, 1, 4))  # sp=4: 2 heads do not split 4 ways
    assert {c["strategy"] for c in found} == {"all_gather", "ring"}
    assert AttentionShape(**found[0]["shape"]).degree == 4


def test_the_sequence_is_the_context_forms_not_the_workloads():
    # A next-token step takes S + 1 tokens, which sp=2 does not divide; its context form takes
    # the S inputs (as the examples' do), which it does.
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    longer = dataclasses.replace(plain(), batch=(tokens,), context_parallel=workload)
    found = candidates(longer, (1, 2, 1, 1, 2))
    assert {c["strategy"] for c in found} == {"all_gather", "ring", "ulysses"}
    assert AttentionShape(**found[0]["shape"]).sequence == SEQ


@pytest.mark.parametrize(
    ("built", "dims"),
    [
        (workload, (1, 4, 1, 1, 1)),  # fsdp=4: the sequence is not split
        (plain, (1, 2, 1, 1, 2)),  # no context_parallel
    ],
)
def test_no_candidates_without_a_split_sequence_or_a_context_form(built, dims):
    assert candidates(built(), dims) == []


def test_the_explanation_puts_the_formulas_beside_the_compiled_bytes():
    shape = AttentionShape(1, 64, 4, 2, 2, 8, 4, True)
    context = {"strategy": "ring", "axes": ["sp"], "degree": 4, "shape": dataclasses.asdict(shape)}
    text = describe_context(context, {"collective-permute": [6, 6144, 6144]}, H100)
    lines = text.splitlines()
    assert lines[0] == "context parallelism: ring over sp=4"
    assert "sequence 64 (16 tokens a device), 2 query and 2 key/value heads of 8" in lines[1]
    # alpha = 989e12 / 450e9: a chunk of 16 tokens hides no hop; 3 hops of a quarter of the
    # 2 x 64 x 2 x 8 x 4 bytes of K and V.
    assert "alpha = 2198 FLOP/byte" in lines[2]
    assert "a ring hop does not hide" in lines[2]
    assert "auto would pick all_gather" in lines[2]
    assert lines[4].startswith("  ring: 6.00 KiB received, 3 collectives")
    assert lines[4].endswith("<- this candidate")
    assert lines[5].startswith("  ulysses: cannot run (ulysses splits the heads")
    assert lines[6].startswith("compiled step (every layer, forward and backward): ")
    assert "collective-permute 6.00 KiB in 6 collectives" in lines[6]


def test_the_factory_must_return_a_workload_calling_context_attention():
    wrong = dataclasses.replace(workload(), context_parallel=lambda strategy: Decoder)
    with pytest.raises(EscaleTypeError, match=r"called with 'all_gather', it returned \w+, not a"):
        plan_mesh(wrong, devices=2, axes=("sp",), memory="1GiB", time_budget=0, cache=False)
    silent = dataclasses.replace(workload(), context_parallel=lambda strategy: plain())
    with pytest.raises(EscaleError, match=r"step calls no flax_escale.context.context_attention"):
        plan_mesh(silent, devices=2, axes=("sp",), memory="1GiB", time_budget=0, cache=False)


def test_a_workload_refuses_a_context_parallel_that_is_not_a_function():
    with pytest.raises(EscaleTypeError, match="Workload context_parallel"):
        Workload(Decoder, 0, tx=plain().tx, batch=plain().batch, context_parallel="ring")


def test_a_mesh_whose_context_form_does_not_trace_fails_alone():
    # A form that runs ulysses whatever is asked: the 2 heads split over sp=2, not over sp=4.
    stubborn = dataclasses.replace(workload(), context_parallel=lambda _: workload("ulysses"))
    figures = evaluate(
        stubborn,
        Target.named("cpu", devices=4),
        memory_bytes=2**30,
        profile=H100,
        axes=("fsdp", "sp"),
        time_budget=0,  # nothing compiles: the candidates say what was planned
    )
    failed = [f for f in figures if f.status == "failed"]
    assert [f.label for f in failed] == ["sp=4 all_gather"]
    assert failed[0].reason.startswith(
        f"{TRACE_FAILURE}Workload context_parallel('all_gather'): its step does not trace on mesh"
    )
    assert "strategy='ulysses'" in failed[0].reason
    # fsdp=2 x sp=2 traced: its strategies were planned (and skipped, as the budget was spent).
    assert "fsdp=2 sp=2 ring" in {f.label for f in figures if f.status == "skipped"}
