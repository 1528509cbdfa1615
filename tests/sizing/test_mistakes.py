"""Mistakes users make with the mesh planner, one case each.

Cases for ``flax_escale.sizing``: a ``Workload``'s ``loss`` and ``step`` (their signatures,
checked when the workload is built, and what they return, checked as the step traces),
``plan_mesh``'s budget, ``MeshPlan.table``, ``Candidate.explain`` and ``load_factory``. What a
case asserts, and the rest of the table: ``support/mistakes.py``. The cache directory's
mistakes need files, so they are plain tests below the table.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.permissions import permission_bits_apply

import flax_escale as fe
from flax_escale import sizing
from flax_escale.sizing import _evaluate


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        return x @ self.param("w", init, (x.shape[-1], 32))


X = jax.ShapeDtypeStruct((8, 16), jnp.float32)


def workload(**options):
    return sizing.Workload(_Tiny(), jax.random.key(0), (X,), tx=optax.sgd(0.1), **options)


def nnx_workload(**options):
    return sizing.Workload(
        lambda rngs: nnx.Linear(16, 32, rngs=rngs),
        0,
        tx=optax.sgd(0.1),
        batch=(X,),
        **options,
    )


def plan(built=None, **options):
    """Plans ``built`` (the tiny workload by default) on 2 devices, no cache."""
    options = {"devices": 2, "memory": "1MiB", "axes": ("fsdp",), "cache": False, **options}
    return sizing.plan_mesh(workload() if built is None else built, **options)


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
    # --- a workload's and a profile's fields ---------------------------------------------
    case(
        lambda: workload(init_kwargs=3),
        T,
        "Workload: init_kwargs",
        "int 3",
        r"must be a mapping of keyword arguments.*init_kwargs=\{'train': False\}",
        id="Workload-init-kwargs-int",
    ),
    case(
        lambda: sizing.HardwareProfile(3, 1e12, 1e9),
        T,
        "HardwareProfile name",
        "int 3",
        r"must be a string such as 'my accelerator'",
        id="HardwareProfile-name-int",
    ),
    # --- the target, and the counts beside it ------------------------------------------------
    case(
        lambda: plan(target=fe.mesh.Target.named("cpu", devices=2), devices=4, slices=2),
        fe.EscaleError,
        "target='cpu'",
        "devices=4",
        r"disagrees with .*a Target of 2 devices.*leave devices out",
        id="plan_mesh-target-and-other-devices",
    ),
    case(
        lambda: plan(target=fe.mesh.Target.named("cpu", devices=2), devices=None, slices=2),
        fe.EscaleError,
        "target='cpu'",
        "slices=2",
        r"disagrees with .*in 1 slice\(s\).*leave slices out",
        id="plan_mesh-target-and-other-slices",
    ),
    # --- options checked before anything is built or compiled ------------------------------
    case(
        lambda: plan(axes=("fsdp", "fsdp")),
        fe.EscaleError,
        "axes",
        "('fsdp', 'fsdp')",
        r"must be distinct axes .*\['fsdp'\] are given twice",
        id="plan_mesh-axes-repeated",
    ),
    case(
        lambda: plan(progress="yes"),
        T,
        "progress",
        "str 'yes'",
        "True or False",
        id="plan_mesh-progress-string",
    ),
    # --- a factory's reference -------------------------------------------------------------
    case(
        lambda: sizing.load_factory(3),
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
    assert best.explain("h100") == best.explain(sizing.PROFILES["h100"])


# --- the cache directory --------------------------------------------------------------------


def test_a_cache_under_a_file_is_refused_before_compiling(tmp_path, monkeypatch):
    file = tmp_path / "afile"
    file.write_text("not a directory")
    monkeypatch.setattr(_evaluate, "_compile", None)  # nothing may compile
    with pytest.raises(
        fe.EscaleError, match=r"cache: '.*afile/sub' cannot be created, as '.*afile' is a file"
    ):
        plan(cache=file / "sub")


def test_a_cache_in_a_directory_without_write_permission_is_refused(tmp_path, request):
    if not permission_bits_apply(request):
        return
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


# --- what stops every mesh --------------------------------------------------------------------


def test_agreeing_counts_beside_a_target_are_accepted():
    target = fe.mesh.Target.named("cpu", devices=2)
    assert fe.mesh.Target.named(target, devices=2, slices=1) is target


def test_rules_naming_an_axis_the_meshes_lack_are_the_reason_given(monkeypatch):
    # Every mesh is pruned, as the batch goes to 'model': the rules are at fault, not the
    # meshes, and "no mesh fits" would send the user after memory.
    monkeypatch.setattr(_evaluate, "_compile", None)  # nothing may compile
    rules = [("batch", "model"), ("hidden_state", "model"), ("mlp_intermediate", "tp")]
    with pytest.raises(
        fe.EscaleError,
        match=r"workload: its rules or overrides name the mesh axes \['model'\], which the "
        r"planned meshes \(axes dp, fsdp, ep, tp, sp\) lack \(batch\[0\] dim 0 to model, "
        r"params/w dim 0 to model\), and every one of the 1 meshes of 2 devices was pruned .*"
        r"map the logical names to the library's mesh axes",
    ):
        plan(workload(rules=rules))


def test_every_mesh_pruned_is_not_said_to_be_out_of_memory():
    # A batch of 3 splits over no mesh of 2 devices: nothing was compiled, so no figure says
    # anything about memory.
    odd = sizing.Workload(
        _Tiny(), jax.random.key(0), (jax.ShapeDtypeStruct((3, 16), jnp.float32),), tx=optax.sgd(0.1)
    )
    result = plan(odd)
    assert result.best is None
    assert result.recommendation() == (
        "No mesh was compiled: all 1 meshes of 2 devices were pruned, as none can run the "
        f"workload as asked. The first, fsdp=2: {result.candidates[0].figures.reason}."
    )
    assert "cannot be split on fsdp=2" in result.recommendation()


class _Dropping(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(_Tiny()(x))


@pytest.mark.parametrize("rng", [0, {"params": 0, "dropout": 1}], ids=["int seed", "streams"])
def test_a_linen_model_drawing_random_numbers_plans_with_the_workloads_rng(rng):
    # As init_sharded(model, mesh, 0, x) initializes it, the default step gives the model's
    # streams the Workload's rng.
    built = sizing.Workload(_Dropping(), rng, (X,), tx=optax.sgd(0.1))
    result = plan(built)
    assert [c.figures.status for c in result.candidates] == ["compiled"]
    assert result.best is not None


def test_a_step_that_gives_the_model_no_key_says_so():
    def step(state, x):
        def objective(params):
            return jnp.mean(state.apply_fn({"params": params}, x))

        loss, grads = jax.value_and_grad(objective)(state.params)
        return state.apply_gradients(grads=grads), loss

    with pytest.raises(
        fe.EscaleError,
        match=FAILED + r".*Workload step: the model draws random numbers the step gives it no "
        r"key for \(.*dropout.*\); call the model with keys",
    ):
        plan(sizing.Workload(_Dropping(), 0, (X,), tx=optax.sgd(0.1), step=step))


def test_a_module_that_raises_as_it_is_imported_is_one_library_error(tmp_path):
    module = tmp_path / "planning_raises_on_import_7731.py"
    module.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(
        fe.EscaleError,
        match=r"workload: importing '.*planning_raises_on_import_7731.py' of .* raised "
        r"RuntimeError: no GPU here; fix the module",
    ) as caught:
        sizing.load_factory(f"{module}:workload")
    assert isinstance(caught.value.__cause__, RuntimeError)
