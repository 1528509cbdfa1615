"""Mistakes users make with the mesh planner, one case each.

Cases for ``flax_escale.planning``: a ``Workload``'s ``loss`` and ``step`` (their signatures,
checked when the workload is built, and what they return, checked as the step traces),
``plan_mesh``'s budget, ``MeshPlan.table``, ``Candidate.explain`` and ``load_factory``. What a
case asserts, and the rest of the table: ``support/mistakes.py``. The cache directory's
mistakes need files, so they are plain tests below the table.
"""

import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import planning
from flax_escale.planning import _evaluate


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        return x @ self.param("w", init, (x.shape[-1], 32))


X = jax.ShapeDtypeStruct((8, 16), jnp.float32)


def workload(**options):
    return planning.Workload(_Tiny(), jax.random.key(0), (X,), tx=optax.sgd(0.1), **options)


def nnx_workload(**options):
    return planning.Workload(
        lambda rngs: nnx.Linear(16, 32, rngs=rngs),
        0,
        tx=optax.sgd(0.1),
        batch=(X,),
        **options,
    )


def plan(built=None, **options):
    """Plans ``built`` (the tiny workload by default) on 2 devices, no cache."""
    options = {"devices": 2, "memory": "1MiB", "axes": ("fsdp",), "cache": False, **options}
    return planning.plan_mesh(workload() if built is None else built, **options)


@functools.cache
def planned():
    """One plan of the tiny workload, for the cases of its results."""
    return plan()


# What a step or loss returns is checked as the step traces, on every mesh; the planner then
# raises what went wrong as the workload's error.
FAILED = r"traced on none of the 1 meshes tried"

CASES = [
    # --- a loss or step of the wrong signature, refused when the workload is built ---------
    case(
        lambda: workload(loss=lambda outputs: jnp.mean(outputs)),
        T,
        "Workload loss",
        "<lambda>(outputs)",
        r"cannot be called as loss\(outputs, batch\[0\]\).*exactly those 2 parameters",
        id="Workload-loss-too-few-parameters",
    ),
    case(
        lambda: workload(loss=lambda outputs, x, y: jnp.mean(outputs)),
        T,
        "Workload loss",
        "<lambda>(outputs, x, y)",
        r"cannot be called as loss\(outputs, batch\[0\]\)",
        id="Workload-loss-too-many-parameters",
    ),
    case(
        lambda: workload(step=lambda state: (state, 0.0)),
        T,
        "Workload step",
        "<lambda>(state)",
        r"cannot be called as step\(state, batch\[0\]\).*exactly those 2 parameters",
        id="Workload-step-too-few-parameters",
    ),
    case(
        lambda: nnx_workload(step=lambda model, batch: 0.0),
        T,
        "Workload step",
        "<lambda>(model, batch)",
        r"cannot be called as step\(model, optimizer, batch\[0\]\)",
        id="Workload-nnx-step-too-few-parameters",
    ),
    # --- a loss that returns no floating-point scalar --------------------------------------
    case(
        lambda: plan(workload(loss=lambda outputs, x: None)),
        fe.EscaleError,
        "Workload loss",
        "returned None",
        FAILED + r".*return one floating-point scalar",
        id="Workload-loss-returns-none",
    ),
    case(
        lambda: plan(workload(loss=lambda outputs, x: outputs)),
        fe.EscaleError,
        "Workload loss",
        "shape (8, 32)",
        r"not a scalar; return one floating-point scalar",
        id="Workload-loss-returns-an-array",
    ),
    case(
        lambda: plan(workload(loss=lambda outputs, x: 3)),
        fe.EscaleError,
        "Workload loss",
        "int 3",
        r"return one floating-point scalar",
        id="Workload-loss-returns-an-int",
    ),
    case(
        lambda: plan(nnx_workload(loss=lambda outputs, x: None)),
        fe.EscaleError,
        "Workload loss",
        "returned None",
        r"return one floating-point scalar",
        id="Workload-nnx-loss-returns-none",
    ),
    # --- a step that returns something else than (state, aux) ------------------------------
    case(
        lambda: plan(workload(step=lambda state, x: state)),
        fe.EscaleError,
        "Workload step",
        "the TrainState alone",
        FAILED + r".*return state.apply_gradients\(grads=grads\), loss",
        id="Workload-step-returns-the-state-alone",
    ),
    case(
        lambda: plan(workload(step=lambda state, x: None)),
        fe.EscaleError,
        "Workload step",
        "got None",
        r"must return \(state, aux\)",
        id="Workload-step-returns-none",
    ),
    case(
        lambda: plan(workload(step=lambda state, x: ({"a": 1}, 0.0))),
        fe.EscaleError,
        "Workload step",
        "dict {'a': 1}",
        r"return state.apply_gradients\(grads=grads\) or state.replace",
        id="Workload-step-returns-another-state",
    ),
    case(
        lambda: plan(workload(step=lambda state, x: (state, "done"))),
        fe.EscaleError,
        "Workload step",
        "str 'done'",
        r"return arrays or numbers",
        id="Workload-step-returns-a-string",
    ),
    # --- the budget: only None is not given --------------------------------------------------
    case(
        lambda: plan(memory=0),
        fe.EscaleError,
        "memory",
        "0",
        "positive int",
        id="plan_mesh-memory-zero",
    ),
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
    # --- a factory's reference -------------------------------------------------------------
    case(
        lambda: planning.load_factory(3),
        T,
        "workload",
        "int 3",
        r"MODULE:FUNCTION",
        id="load_factory-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


def test_explain_takes_a_profile_or_its_name():
    best = planned().best
    assert best.explain("h100") == best.explain(planning.PROFILES["h100"])


# --- the cache directory --------------------------------------------------------------------


def test_a_cache_under_a_file_is_refused_before_compiling(tmp_path, monkeypatch):
    file = tmp_path / "afile"
    file.write_text("not a directory")
    monkeypatch.setattr(_evaluate, "_compile", None)  # nothing may compile
    with pytest.raises(
        fe.EscaleError, match=r"cache: '.*afile/sub' cannot be created, as '.*afile' is a file"
    ):
        plan(cache=file / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any directory")
def test_a_cache_in_a_directory_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(fe.EscaleError, match=r"cache: '.*locked/plan' cannot be written"):
        plan(cache=locked / "plan")


def test_a_cache_that_cannot_be_written_is_a_library_error(tmp_path, monkeypatch):
    # What only writing tells (a file system that refuses it): as /proc does, even to root.
    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "mkdir", refuse)
    with pytest.raises(
        fe.EscaleError, match=r"cache: cannot keep .* in '.*plan' \(Permission denied\); give"
    ):
        plan(cache=tmp_path / "plan")
