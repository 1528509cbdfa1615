"""``Workload``: its fields, and its loss and step, checked when it is built or as the step traces.

What a case of the table asserts: ``support/mistakes.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.tiny_workloads import FAILED, Tiny, X, nnx_workload, plan, workload

import flax_escale as fe
from flax_escale import sizing

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
    # --- a workload's and a profile's fields ---------------------------------------------
    case(
        lambda: workload(init_kwargs=3),
        T,
        "Workload: init_kwargs",
        "int 3",
        r"must be a mapping of keyword arguments.*init_kwargs=\{'train': False\}",
        id="Workload-init-kwargs-int",
    ),
    # --- which batch dimensions count tokens ---------------------------------------------
    case(
        lambda: workload(tokens="ids"),
        T,
        "Workload: tokens",
        "str 'ids'",
        r"batch index or an \(index, dimensions\) pair.*tokens=\(0, 2\)",
        id="Workload-tokens-str",
    ),
    case(
        lambda: workload(tokens=(0, 0)),
        fe.EscaleError,
        "Workload: tokens",
        "tuple (0, 0)",
        r"tokens=0 for batch\[0\]",
        id="Workload-tokens-no-dimension",
    ),
    case(
        lambda: workload(tokens=1),
        fe.EscaleError,
        "Workload: tokens=1",
        "batch[1]",
        r"the batch has 1 array\(s\); pass tokens=0",
        id="Workload-tokens-past-the-batch",
    ),
    case(
        lambda: workload(tokens=(0, 3)),
        fe.EscaleError,
        "Workload: tokens=(0, 3)",
        "batch[0], which has 2 (shape (8, 16))",
        r"pass \(0, 2\) for batch x sequence or \(0, 1\) for rows",
        id="Workload-tokens-more-dimensions-than-the-array",
    ),
    case(
        lambda: batched(X, jax.ShapeDtypeStruct((), jnp.float32), tokens=1),
        fe.EscaleError,
        "Workload: tokens=1",
        "batch[1], a scalar",
        "name an array of the batch",
        id="Workload-tokens-a-scalar",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)


IDS = jax.ShapeDtypeStruct((64, 1024), jnp.int32)
ROWS = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
FRAMES = jax.ShapeDtypeStruct((64, 1024, 80), jnp.float32)


@pytest.mark.parametrize(
    ("batch", "tokens", "dims"),
    [
        ((IDS,), None, (0, (0, 1))),  # token ids: batch x sequence
        ((ROWS,), None, (0, (0,))),  # rows of features: one token a row
        ((FRAMES,), None, (0, (0, 1))),  # batch x sequence x features
        ((ROWS, IDS), None, (1, (0, 1))),  # the token ids, wherever they are
        ((jax.ShapeDtypeStruct((64,), jnp.int32),), None, (0, (0,))),
        ((jax.ShapeDtypeStruct((), jnp.float32),), None, None),
        ((ROWS, IDS), 0, (0, (0,))),  # said: batch[0], by the default's rule
        ((ROWS, IDS), (0, 2), (0, (0, 1))),  # said: batch[0]'s first two dimensions
        ((IDS,), (0, 1), (0, (0,))),
    ],
)
def test_the_token_dimensions_are_those_a_user_counts_tokens_along(batch, tokens, dims):
    assert batched(*batch, tokens=tokens).token_dims == dims


def batched(*batch, tokens=None):
    """An NNX workload of this batch (not traced: only its fields are looked at)."""
    return sizing.Workload(
        lambda rngs: nnx.Linear(16, 32, rngs=rngs), 0, tx=optax.sgd(0.1), batch=batch, tokens=tokens
    )


class _Dropping(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(Tiny()(x))


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
