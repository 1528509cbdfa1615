"""``plan_mesh`` on a TPU target: compiled for the hardware a user will rent, from this CPU.

A TPU slice is described by JAX (``jax.experimental.topologies``) and compiled for with
``libtpu``, which the test environment installs; nothing runs on it. The planner's figures on a
TPU target must be those of the same programs compiled directly, the user's way, on a mesh of
the slice's devices.
"""

import importlib.util
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from support.example_modules import load
from support.train_states import abstract_train_state

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale.__main__ import main
from flax_escale.mesh import Target
from flax_escale.sizing import Workload, plan_mesh
from flax_escale.sizing import _plan_mesh as plan_module
from flax_escale.sizing._estimate import RULE_OUT_MARGIN
from flax_escale.sizing._hlo import program_costs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler is not installed: pip install "flax-escale[tpu]"',
)

# --- the planner on a TPU slice ------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory):
    gpt = load("linen_gpt")
    cache = tmp_path_factory.mktemp("tpu_plans") / "plan"
    plan = plan_mesh(gpt.workload, target="v5e-8", axes=("dp", "fsdp"), cache=cache)
    return gpt, plan, cache


def _abstract_train_state(workload, mesh):
    """The train state a user lays out on a slice nothing runs on: planned, never made."""
    plan = fe.plan_sharding(workload.model, mesh, workload.rng, *workload.args)
    params = plan.treedef.unflatten(
        [jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=NamedSharding(mesh, e.spec)) for e in plan]
    )["params"]
    return abstract_train_state(workload, mesh, params)


@pytest.mark.slow
def test_a_tpu_plan_has_the_figures_of_the_programs_compiled_the_users_way(gpt_plan):
    gpt, plan, _ = gpt_plan
    assert plan.devices == 8
    assert "TPU compiler" in plan.backend
    assert plan.memory_bytes == 16 * 10**9
    compiled = [c for c in plan.candidates if c.figures.status == "compiled"]
    assert len(compiled) == 4, plan.candidates  # dp x fsdp of 8: 8x1, 4x2, 2x4, 1x8
    target = Target.named("v5e-8")
    workload = gpt.workload()
    (tokens,) = workload.batch
    for candidate in compiled:
        mesh = target.mesh(candidate.dims)
        init = fe.lower_init(workload.model, mesh, workload.rng, *workload.args).compile()
        state = _abstract_train_state(workload, mesh)
        sharding = fe.batch_sharding(mesh, tokens.shape)
        batch = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=sharding)
        jitted = fel.jit_train_step(gpt.train_step, state, batch_sharding=sharding, has_aux=True)
        with fe.use_sharding(mesh, None):
            step = jitted.lower(state, batch).compile()
        f = candidate.figures
        assert f.init_peak_bytes == fe.will_it_fit(init).peak_bytes, candidate.label
        assert f.step_peak_bytes == fe.will_it_fit(step).peak_bytes, candidate.label
        costs = program_costs(step)
        assert f.collectives == {
            kind: [c.count, c.bytes, c.wire_bytes] for kind, c in costs.collectives.items()
        }, candidate.label
        assert math.prod(candidate.dims) == 8


@pytest.mark.slow
def test_the_command_line_plans_for_a_tpu_slice_from_the_cache(gpt_plan, capsys, monkeypatch):
    gpt, plan, cache = gpt_plan
    monkeypatch.setattr(plan_module, "DEFAULT_CACHE", cache.parent)
    code = main(
        ["plan", f"{gpt.__file__}:workload", "--target", "v5e-8", "--axes", "dp,fsdp", "--top", "2"]
    )
    out = capsys.readouterr().out
    assert code == (0 if plan.best is not None else 1)
    assert "TPU compiler" in out
    assert "v5e:2x4" in out


# --- a compiler that aborts ends one mesh, not the plan ---------------------------------------

ABORTING_MODULE = """
import os
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from flax_escale.sizing import Workload

HERE = Path(__file__)


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        return x @ self.param("w", init, (x.shape[-1], 256))


def workload():
    # As libtpu does on some layouts: the third program handed to the compiler (the second
    # mesh's init) aborts the process, once.
    compile = jax.stages.Lowered.compile

    def aborting(self, *args, **kwargs):
        with HERE.with_suffix(".compiles").open("a") as log:
            log.write("compile\\n")
        calls = len(HERE.with_suffix(".compiles").read_text().splitlines())
        if calls == 3 and not HERE.with_suffix(".aborted").exists():
            HERE.with_suffix(".aborted").touch()
            print("F1126 routing.cc:88] no route for the ring, code 6173", file=sys.stderr)
            sys.stderr.flush()
            os.abort()
        return compile(self, *args, **kwargs)

    jax.stages.Lowered.compile = aborting
    x = jax.ShapeDtypeStruct((16, 256), jnp.float32)
    return Workload(Dense(), jax.random.key(0), (x,), tx=optax.adam(1e-3))
"""


@pytest.mark.slow
def test_a_compiler_abort_fails_its_mesh_and_a_new_child_plans_the_rest(tmp_path, monkeypatch):
    module = tmp_path / "aborting_planned.py"
    module.write_text(ABORTING_MODULE)
    plan = plan_mesh(
        f"{module}:workload", target="v5e-8", axes=("dp", "fsdp"), exhaustive=True, cache=False
    )
    assert (tmp_path / "aborting_planned.aborted").exists()
    by_status = {}
    for c in plan.candidates:
        by_status.setdefault(c.figures.status, []).append(c)
    (failed,) = by_status["failed"]
    assert failed.figures.reason == (
        "the TPU compiler ended the process compiling it (SIGABRT): "
        "F1126 routing.cc:88] no route for the ring, code 6173"
    )
    assert failed.figures.textbook_seconds is not None
    assert failed.figures.state_bytes > 0
    compiled = by_status["compiled"]
    assert len(compiled) == 3, plan.candidates  # dp x fsdp of 8: four meshes, one aborted
    assert sorted(c.dims for c in plan.candidates) == sorted(
        (8 // f, f, 1, 1, 1) for f in (1, 2, 4, 8)
    )
    # The first child compiled one mesh (two programs) and began the next; the second child
    # compiled only the meshes left (two programs each): nothing was compiled twice.
    compiles = (tmp_path / "aborting_planned.compiles").read_text().splitlines()
    assert len(compiles) == 3 + 2 * 2
    assert plan.best in compiled


# --- ruled out by the textbook, never the best ------------------------------------------------


class _Mlp(nn.Module):
    """A two-layer MLP annotated like a transformer's: column- then row-parallel kernels."""

    @nn.compact
    def __call__(self, x):
        kernel = nn.with_logical_partitioning
        init = nn.initializers.lecun_normal()
        h = nn.Dense(8192, kernel_init=kernel(init, ("hidden_state", "mlp_intermediate")))(x)
        return nn.Dense(2048, kernel_init=kernel(init, ("mlp_intermediate", "hidden_state")))(
            nn.gelu(h)
        )


def mlp_workload(batch=64):
    # Wide and fed a small batch: communication decides, so the floor has meshes to rule out.
    x = jax.ShapeDtypeStruct((batch, 2048), jnp.float32)
    return Workload(_Mlp(), jax.random.key(0), (x,), tx=optax.adam(1e-3))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v5e-8", pytest.param("v5p-128", marks=pytest.mark.pod)])
def test_no_mesh_ruled_out_before_compiling_would_have_ranked_first(name, tmp_path):
    every = plan_mesh(mlp_workload, target=name, exhaustive=True, cache=tmp_path)
    quick = plan_mesh(mlp_workload, target=name, cache=tmp_path)
    assert every.best is not None
    assert quick.best.dims == every.best.dims
    assert quick.best.step_seconds == every.best.step_seconds
    compiled = {c.dims: c for c in every.candidates if c.figures.status == "compiled"}
    ruled_out = [c for c in quick.candidates if c.figures.status == "ruled out"]
    assert ruled_out, "nothing is ruled out on this workload: the test would check nothing"
    for candidate in ruled_out:
        truth = compiled[candidate.dims]
        assert truth.step_seconds > every.best.step_seconds, candidate.label
        textbook = candidate.figures.textbook_seconds
        assert textbook > RULE_OUT_MARGIN * quick.best.step_seconds, candidate.label
        assert f"more than {RULE_OUT_MARGIN:g} x the" in candidate.figures.reason
    assert len([c for c in quick.candidates if c.figures.status == "compiled"]) < len(compiled)


@pytest.mark.slow
def test_a_compiled_row_says_what_bounds_its_step(gpt_plan):
    _, plan, _ = gpt_plan
    notes = plan.best.explain(plan.profile)
    assert re.match(
        r"(compute|communication)-bound \(\d+% of the estimate\); \S+ sends \d+% of the bytes; ",
        notes,
    )
    assert re.search(r"[\d,]+ tokens/device, (over|under) the [\d,]+ from which data/FSDP", notes)
