"""The pipeline reader (``flax_escale/sizing/_hlo/_pipeline.py``) on compiled pipeline steps.

A training step (loss and gradients) of a tiny stack of two-matrix layers run by
:func:`flax_escale.pipeline.pipeline` over ``pp=2 x fsdp=4`` (8 devices, float32 weights) is
compiled by XLA:CPU with float32 activations and by the TPU compiler (a v5e 2x4 slice
described by ``jax.experimental.topologies``; nothing runs) with bfloat16 ones, which it
permutes in that type (float32 ones it permutes forwards in bfloat16, the type the next
stage's matmul takes them in).

The schedule's figures are the oracle: ``m * v + p - 1`` iterations per pass, one
microbatch's activations permuted per iteration and once more outside the loop, forward and
backward (``Schedule.permuted_activations``), and each stage weight's gradient reduced once
per step.
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.pipeline import Schedule, pipeline
from flax_escale.sizing._hlo import pipeline_figures

STAGES, MICROBATCHES, LAYERS = 2, 4, 4
BATCH, LENGTH, WIDTH, MLP = 16, 8, 16, 32
FSDP = 4
LAYER_SHAPES = [(WIDTH, MLP), (MLP, WIDTH)]


def _layer(w, x):
    w1, w2 = (a.astype(x.dtype) for a in w)  # float32 weights, matmuls in the activations' type
    return jnp.tanh(x @ w1) @ w2


def _compile(devices: list[jax.Device], repeats: int, dtype: jnp.dtype) -> jax.stages.Compiled:
    mesh = fe.create_mesh((STAGES, FSDP), ("pp", "fsdp"), devices=devices)

    def array(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    stack = (
        array((LAYERS, WIDTH, MLP), P("pp", "fsdp")),
        array((LAYERS, MLP, WIDTH), P("pp", None, "fsdp")),
    )
    x = array((BATCH, LENGTH, WIDTH), P("fsdp"), dtype)

    def loss(stack, x):
        out = pipeline(_layer, stack, x, microbatches=MICROBATCHES, repeats=repeats)
        return out.astype(jnp.float32).sum()

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss)).lower(stack, x).compile()


@pytest.fixture(scope="module")
def tpu_devices() -> list[jax.Device]:
    """The chips of a TPU v5e 2x4 slice, described for the TPU compiler (libtpu)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip('the TPU compiler is not installed: pip install "flax-escale[tpu]"')
    from jax.experimental import topologies

    return list(topologies.get_topology_desc("v5e:2x4", "tpu").devices)


@pytest.fixture(scope="module", params=[("cpu", 1), ("cpu", 2), ("tpu", 1)], ids=str)
def step(request):
    """A compiled step on each compiler (GPipe; and circular on XLA:CPU), with its schedule."""
    compiler, repeats = request.param
    if compiler == "cpu":
        devices, dtype = jax.devices("cpu")[:8], jnp.float32
    else:
        devices, dtype = request.getfixturevalue("tpu_devices"), jnp.bfloat16
    schedule = Schedule(STAGES, MICROBATCHES, repeats, LAYERS)
    return pipeline_figures(_compile(devices, repeats, dtype)), schedule, jnp.dtype(dtype)


def test_the_loops_run_the_schedules_iterations(step):
    figures, schedule, _ = step
    assert figures.loops == (schedule.iterations,) * 2  # the forward pass's and the backward's
    assert figures.iterations == MICROBATCHES * schedule.repeats + STAGES - 1
    assert figures.stages == STAGES
    assert figures.bubble_fraction == pytest.approx(schedule.bubble_fraction)


def test_permute_bytes_are_the_activations_crossing_stages(step):
    figures, schedule, dtype = step
    microbatch = BATCH // MICROBATCHES // FSDP * LENGTH * WIDTH * dtype.itemsize  # per device
    analytic = 2 * schedule.permuted_activations() * microbatch  # forward and backward
    assert figures.permutes == 2 * schedule.permuted_activations()
    assert figures.permute_bytes == analytic
    assert figures.permute_types == {"f32" if dtype == jnp.float32 else "bf16": analytic}


def test_the_outputs_sum_is_no_weight_gradient(step):
    figures, _, _ = step
    # The forward psum (the gradients' sum over the data axes is its transpose's kin, named
    # after the pcast it transposes).
    outputs = [
        r for r in figures.reductions if "psum" in r.op_name and "transpose" not in r.op_name
    ]
    assert outputs
    assert not any(r.reduces(LAYER_SHAPES) for r in outputs)
    assert all(r.runs == 1 and not r.in_loop for r in outputs)


def test_stage_weight_gradients_are_reduced_once_per_step(step):
    figures, _, _ = step
    reductions = figures.weight_reductions(LAYER_SHAPES)
    assert reductions
    assert [(r.runs, r.in_loop) for r in reductions] == [(1, False)] * len(reductions)


# --- the reader on programs written out -------------------------------------------------------

# One instruction a line, as compilers print them.
NESTED = """
HloModule m, num_partitions=4
%layers (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %w = f32[8,8]{1,0} parameter(0)
  %g = f32[2,8]{1,0} all-reduce(%w), to_apply=%add, metadata={op_name="jit(f)/dot_general"}
}
%windowed_dot_general_body_rs.1 (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %q = f32[2,8]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="jit(f)/transpose/dot_general"}
}
%stages (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %x = f32[2,8]{1,0} parameter(0)
  %s = (f32[2,8]{1,0}, f32[2,8]{1,0}) collective-permute-start(%x), source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  %d = f32[2,8]{1,0} collective-permute-done(%s), metadata={op_name="jit(f)/while/ppermute"}
  %r = f32[2,8]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="jit(f)/dot_general"}
  %l = (s32[]) while(%t), body=%layers, backend_config={"known_trip_count":{"n":"3"}}
  %rs = (s32[]) while(%t), body=%windowed_dot_general_body_rs.1, backend_config={"known_trip_count":{"n":"4"}}
}
ENTRY %main (a: f32[2,8]) -> f32[2,8] {
  %w = (s32[]) while(%t), body=%stages, backend_config={"known_trip_count":{"n":"7"}}
  %e = bf16[2,8]{1,0} collective-permute(%a), source_target_pairs={{0,2},{2,0},{1,3},{3,1}}, metadata={op_name="jit(f)/shard_map/ppermute"}
  %o = f32[4,2,8]{2,1,0} all-reduce(%a), to_apply=%add, metadata={op_name="jit(f)/psum"}
  %z = f32[8,2]{1,0} reduce-scatter(%a), to_apply=%add, dimensions={0}
  %f = f32[2,8]{1,0} fusion(%a), kind=kCustom, calls=%all-reduce-scatter.1
}
"""  # noqa: E501


def test_nested_loops_multiply_and_a_matmul_ring_is_not_the_pipelines():
    figures = pipeline_figures(NESTED)
    assert figures.loops == (7,)  # the layers' loop and the matmul's ring are not the pipeline's
    assert figures.stages == 2  # device 0 sends to 2, which sends back to 0
    assert figures.permutes == 8  # 7 in the loop (at their -done) and one after it
    assert figures.permute_bytes == 7 * 64 + 32
    assert figures.permute_types == {"f32": 7 * 64, "bf16": 32}
    grads = figures.weight_reductions([(8, 8)])
    assert [(r.kind, r.arrays, r.runs, r.in_loop) for r in grads] == [
        ("all-reduce", (("f32", (2, 8)),), 21, True),  # 3 layers x 7 iterations
        ("reduce-scatter", (("f32", (2, 8)),), 7, True),  # a windowed matmul's ring, once a run
        ("reduce-scatter", (("f32", (8, 2)),), 1, False),
        ("reduce-scatter", (("f32", (2, 8)),), 1, False),  # the TPU compiler's fusion
    ]
    assert [r.op_name for r in figures.reductions if not r.reduces([(8, 8)])] == ["jit(f)/psum"]


def test_without_metadata_every_permute_is_the_pipelines():
    text = NESTED.replace('metadata={op_name="jit(f)/dot_general"}', "")
    text = text.replace(', metadata={op_name="jit(f)/while/ppermute"}', "")
    text = text.replace(', metadata={op_name="jit(f)/shard_map/ppermute"}', "")
    figures = pipeline_figures(text)
    assert figures.permutes == 7 + 7 + 1  # the ring named after its matmul is not counted
    assert figures.stages == 2


def test_a_program_without_a_pipeline_has_no_figures():
    figures = pipeline_figures(
        "HloModule m\nENTRY %main (a: f32[8]) -> f32[8] {\n"
        "  %ar = f32[8]{0} all-reduce(%a), to_apply=%add\n}\n"
    )
    assert (figures.loops, figures.stages, figures.iterations, figures.bubble_fraction) == (
        (),
        None,
        None,
        None,
    )
    assert figures.permutes == figures.permute_bytes == 0
    assert [(r.kind, r.runs, r.in_loop) for r in figures.reductions] == [("all-reduce", 1, False)]
