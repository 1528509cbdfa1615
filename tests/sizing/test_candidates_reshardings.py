"""No candidate mesh makes XLA replicate an array to split it another way.

Each workload's training step is compiled on each candidate mesh in a fresh process
(``support.reshardings``), and XLA's "involuntary full rematerialization" reports are
collected: there must be none. The workloads are the two examples (every layout of 8 devices
over ``dp, fsdp, tp, sp``), the real models of ``support.real_models`` and a Llama-shaped
decoder (vocabulary 32,000), on XLA:CPU and on the TPU compiler (a v5e slice of 8 chips, and
of 64 for the Llama-shaped one, the ``pod`` tests), where the candidates are those the
planner compiles.

Before the examples gathered their embedding tables for the lookup, four layouts of each had
reports (``dp`` with ``fsdp``, ``fsdp`` with ``sp``). lm1b, which constrains no activation,
has six on XLA:CPU unless its parameters are gathered where they are read
(``gather_at_use``); on the TPU compiler it has none either way.
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support import EXAMPLES, ROOT
from support.reshardings import step_reshardings

from flax_escale.sizing import mesh_shapes
from flax_escale.tools._reshardings import compile_collecting

pytestmark = [pytest.mark.slow, pytest.mark.xla]

SHAPES = [tuple(s.values()) for s in mesh_shapes(8, ("dp", "fsdp", "tp", "sp"))]
WORKLOADS = str(ROOT / "tests" / "support" / "real_models" / "workloads.py")
# Gemma names its own mesh axes in its einsums' out_sharding: its meshes are Explicit, and the
# four that split its 2 key/value heads 4 or 8 ways cannot run it.
GEMMA_CANNOT_RUN = {(2, 1, 1, 4, 1), (1, 2, 1, 4, 1), (1, 1, 1, 8, 1), (1, 1, 1, 4, 2)}


def _needs(target: str) -> None:
    if target != "cpu" and importlib.util.find_spec("libtpu") is None:
        pytest.skip('the TPU compiler is not installed: pip install "flax-escale[tpu]"')


def _assert_none(found: dict, expected_meshes: int) -> None:
    compiled = {shape: reports for shape, reports in found.items() if isinstance(reports, list)}
    assert len(compiled) == expected_meshes, found
    assert {shape: reports for shape, reports in compiled.items() if reports} == {}


@pytest.mark.parametrize("target", ["cpu", "v5e-8"])
@pytest.mark.parametrize("example", ["nnx_llama", "linen_gpt"])
def test_no_layout_of_the_example_replicates_an_array_to_reshard_it(example, target):
    # Every layout on XLA:CPU; on the TPU compiler the planner's candidates (sp, which does
    # not divide the 33 tokens of a step's batch, is pruned).
    _needs(target)
    found = step_reshardings(
        str(EXAMPLES / f"{example}.py"),
        "workload",
        SHAPES,
        target=target,
        candidates=target != "cpu",
    )
    assert len(SHAPES) == 20
    _assert_none(found, 20 if target == "cpu" else 10)


# The meshes each compiles: every layout of 8 devices for the real models (Gemma's but four),
# the planner's candidates for the Llama-shaped one (sp does not divide its 65 tokens). lm1b
# as written on the TPU compiler, and gathered at use on XLA:CPU, where as written it has six.
CASES = {
    ("lm1b_gathered", "cpu"): 20,
    ("lm1b", "v5e-8"): 20,
    ("wmt", "cpu"): 20,
    ("wmt", "v5e-8"): 20,
    ("gemma", "cpu"): 16,
    ("gemma", "v5e-8"): 16,
    ("llama", "cpu"): 10,
    ("llama", "v5e-8"): 10,
}


# jaxlib >= 0.11's XLA:CPU, on 5 of Gemma's 16 Explicit meshes (those where dp or sp is idle
# beside fsdp): Gemma's embedding table splits its features over fsdp and its lookup gives the
# rows batch-split (out_sharding=), so the gradient's scatter-add wants the rows' cotangent
# feature-split; XLA:CPU replicates it over the idle axis to get there ("parameter" and "copy"
# reports). Gemma's own layout, unchanged by the test's point; the behaviour is XLA's and
# shows without the library (test_xla_cpu_replicates_an_explicit_lookups_cotangent).
_XLA_CPU_011_GEMMA = pytest.mark.xfail(
    jax.__version_info__ >= (0, 11),
    reason="jaxlib >= 0.11 XLA:CPU replicates the cotangent of Gemma's Explicit lookup",
    strict=True,
)


def test_xla_cpu_replicates_an_explicit_lookups_cotangent_on_a_mesh_with_an_idle_axis():
    # The reproducer of Gemma's case in plain JAX: a table split over fsdp on its features,
    # looked up batch-split on an Explicit mesh, its gradient taken. jaxlib 0.10's XLA:CPU
    # partitions the gradient's scatter-add as it is; from 0.11 it replicates the cotangent
    # over dp, which splits nothing here, to split its features; with no idle axis, it does
    # not. When a JAX release changes this, the Gemma case's expected failure flags it.
    explicit = (jax.sharding.AxisType.Explicit,) * 2

    def reports(shape):
        mesh = jax.make_mesh(shape, ("dp", "fsdp"), axis_types=explicit)
        table = jax.ShapeDtypeStruct(
            (128, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))
        )
        ids = jax.ShapeDtypeStruct(
            (8, 16), jnp.int32, sharding=NamedSharding(mesh, P("fsdp", None))
        )

        def loss(table, ids):
            return jnp.tanh(table.at[ids].get(out_sharding=P("fsdp", None, None)) * 8.0).sum()

        with jax.set_mesh(mesh):
            return compile_collecting(jax.jit(jax.grad(loss)).lower(table, ids))[1]

    idle_dp = reports((2, 4))
    assert [r.operation for r in idle_dp] == (
        ["parameter", "copy"] if jax.__version_info__ >= (0, 11) else []
    ), idle_dp
    assert reports((1, 8)) == ()


@pytest.mark.parametrize(
    ("factory", "target"),
    [
        pytest.param(*case, marks=_XLA_CPU_011_GEMMA) if case == ("gemma", "cpu") else case
        for case in CASES
    ],
)
def test_no_candidate_mesh_of_a_real_model_replicates_an_array(factory, target):
    _needs(target)
    found = step_reshardings(
        WORKLOADS,
        factory,
        SHAPES,
        target=target,
        axis_types="explicit" if factory == "gemma" else None,
        candidates=factory == "llama",
    )
    if factory == "gemma":
        assert {shape for shape, reports in found.items() if reports is None} == GEMMA_CANNOT_RUN
    _assert_none(found, CASES[factory, target])


# v5p-128 is 64 chips (two TensorCores each); the compiler cannot route a 64-chip v5e slice
# from a host without one ("Failed to create limited ICI routing replica info table"), so the
# v5p slice stands for 64 chips. Its meshes compile in parts, one child process each, which
# the workers of a run share; together the tests say: 28 candidates (counted by pruning alone,
# nothing lowered), each compiled, none reporting a resharding.
POD_SHAPES = [tuple(s.values()) for s in mesh_shapes(64, ("dp", "fsdp", "tp", "sp"))]
POD_PARTS = 4


def _pod_reshardings(shapes, lower=True):
    _needs("v5p-128")
    return step_reshardings(
        WORKLOADS,
        "llama_64",
        shapes,
        devices=64,
        target="v5p-128",
        candidates=True,
        lower=lower,
    )


@pytest.mark.pod
def test_the_planner_has_28_candidate_meshes_of_64_chips_for_the_survey():
    found = _pod_reshardings(POD_SHAPES, lower=False)
    assert sum(result == "candidate" for result in found.values()) == 28, found


@pytest.mark.pod
@pytest.mark.parametrize("part", range(POD_PARTS))
def test_no_candidate_mesh_of_64_chips_replicates_an_array(part):
    found = _pod_reshardings(POD_SHAPES[part::POD_PARTS])
    # Every candidate of the part lowers and compiles (a list of reports), reporting nothing.
    assert [r for r in found.values() if not isinstance(r, list)] == [], found
    assert {shape: reports for shape, reports in found.items() if reports} == {}
