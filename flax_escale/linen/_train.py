"""A jitted Linen training step that keeps the train state in the layout it was planned in."""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from typing import Any

import jax

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.linen._step_batch import batch_problem, checked_batch_sharding, devices_of_state

__all__ = ["jit_train_step"]


def jit_train_step(
    step_fn: Callable[[Any, Any], Any],
    state: Any,
    *,
    batch_sharding: Any = None,
    has_aux: bool = False,
) -> Any:
    """``jax.jit(step_fn, donate_argnums=0)``, with the new state pinned to ``state``'s shardings.

    A plain ``jax.jit`` step returns the state in the layout the compiler chose: specs
    rewritten to an equivalent form (``P('fsdp',)`` for ``P(('fsdp', 'sp'), None)`` when
    ``sp`` has size 1) and arrays the plan left replicated (biases, say) sometimes split, so
    the specs after a step are not the ones the plan showed and the second step compiles again
    for the new layout. Here the state's input and output shardings are those of ``state``:
    every step runs the program compiled for the first, and the state keeps its plan's specs.
    The state's buffers are donated (the new state reuses them). Call the step inside
    :func:`~flax_escale.use_sharding` when the model constrains activations by logical names.

    Threads: a step may be called from any thread. The check that no buffer of the state was
    donated and the dispatch that donates them are one atomic operation, across every step
    this function builds; so of two threads that step from the same state, one runs and the
    other gets the :class:`~flax_escale.EscaleError` below, never a crash. Steps are
    dispatched one at a time (a first call, which compiles, holds the others until it has
    compiled); they run on the devices as JAX's asynchronous dispatch queues them. Chaining
    the states (each step on the state the last one returned) is the caller's job.

    Args:
        step_fn: ``step_fn(state, batch)``, returning the new state (of the same structure as
            ``state``), or ``(new_state, aux)`` with ``has_aux``.
        state: The train state, as :func:`init_train_state` builds it; only its arrays'
            shardings are read (``jax.ShapeDtypeStruct`` leaves with a sharding do too).
        batch_sharding: The batch's sharding: a ``jax.sharding.Sharding`` for every array of
            the batch (such as :func:`~flax_escale.batch_sharding`'s) or a tree of them shaped
            like a prefix of the batch, on the state's devices. ``None`` leaves the batch (or
            that part of it) where it is.
        has_aux: Whether ``step_fn`` returns ``(new_state, aux)``; ``aux`` (the loss, metrics)
            is laid out by the compiler.

    Returns:
        The jitted step, called as ``step(state, batch)`` (both by position); ``jax.jit``'s
        ``lower`` and ``trace`` work on it too, and check their arguments as a call does.

    Raises:
        EscaleTypeError: If ``state`` holds no array or a leaf of it is not an array with a
            sharding (a step of ``0``, say, as ``TrainState.create`` makes it), ``step_fn`` is
            not a function, or an entry of ``batch_sharding`` is not a sharding (a bare
            ``PartitionSpec``, say); when the step traces, if it does not return a state
            shaped like ``state`` (and ``aux`` with ``has_aux``) or takes the gradient of a
            loss that is not a scalar; if ``step_fn`` cannot take ``(state, batch)``; when the
            step is called with other than ``(state, batch)`` by position (a keyword batch, a
            third argument), a state of another structure, or a batch not shaped like
            ``batch_sharding``.
        EscaleError: If ``batch_sharding`` is on other devices than the state; when the step
            is called with a state an earlier call of a step was donated, or a batch that
            ``batch_sharding`` cannot place (a dimension it does not divide, fewer dimensions
            than its spec) or that sits on other devices than the state.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import optax
        >>> from flax_escale import create_mesh
        >>> from flax_escale.linen import init_train_state, jit_train_step
        >>> model = nn.Dense(16, use_bias=False, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> x = jnp.ones((4, 8))
        >>> state = init_train_state(model, create_mesh((1, 4, 1, 2, 1)), jax.random.key(0), x,
        ...                          tx=optax.sgd(0.1))
        >>> def step(state, x):
        ...     loss, grads = jax.value_and_grad(
        ...         lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
        ...     return state.apply_gradients(grads=grads), loss
        >>> train_step = jit_train_step(step, state, has_aux=True)
        >>> for _ in range(3):
        ...     state, loss = train_step(state, x)
        >>> int(state.step), state.params["kernel"].sharding.spec
        (3, P(('fsdp', 'sp'), 'tp'))
    """
    check.callable_(step_fn, "step_fn", "pass the function step_fn(state, batch)")
    check.takes_positional(step_fn, 2, "jit_train_step", "step_fn(state, batch)")
    has_aux = check.flag(has_aux, "has_aux")
    shardings = jax.tree_util.tree_map_with_path(_sharding_of, state)
    if not jax.tree.leaves(shardings):
        raise EscaleTypeError(
            f"jit_train_step: state must hold the train state's arrays, got "
            f"{check.describe(state)}, which holds none; pass the state init_train_state built."
        )
    devices = devices_of_state(shardings)
    batch_sharding = checked_batch_sharding(batch_sharding, devices)
    structure = jax.tree.structure(state)

    @functools.wraps(step_fn)  # named as the user's step in traces, profiles and HLO
    def checked_step(state: Any, batch: Any) -> Any:
        # What the step returns is checked while it traces, once per compilation.
        try:
            result = step_fn(state, batch)
        except TypeError as error:
            if not str(error).startswith(_NOT_SCALAR):
                raise
            # JAX words the rest differently by version; the shape is the part that matters.
            found = re.search(r"Output had shape: \([^)]*\)", str(error))
            shape = found.group(0) if found else str(error)[len(_NOT_SCALAR) :].strip()
            raise EscaleTypeError(
                f"jit_train_step: step_fn took the gradient of a loss that is not a scalar "
                f"({shape}); reduce it to one number, e.g. jnp.mean(loss), before jax.grad or "
                "jax.value_and_grad."
            ) from error
        new_state = result[0] if has_aux and isinstance(result, tuple) else result
        if has_aux and not (isinstance(result, tuple) and len(result) == 2):
            raise EscaleTypeError(
                f"jit_train_step: with has_aux=True, step_fn must return (new_state, aux), got "
                f"{check.describe(result)}; return the pair, or pass has_aux=False."
            )
        if jax.tree.structure(new_state) != structure:
            hint = (
                " (a (new_state, aux) pair? pass has_aux=True)"
                if not has_aux and isinstance(result, tuple) and len(result) == 2
                else ""
            )
            raise EscaleTypeError(
                "jit_train_step: step_fn must return a new state shaped like state"
                f"{hint}, got {check.describe(new_state)}."
            )
        return result

    jitted = jax.jit(
        checked_step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, None) if has_aux else shardings,
        donate_argnums=0,
    )
    return _DonatingStep(jitted, structure, batch_sharding, devices)


# How jax.grad refuses a function whose output is not a scalar.
_NOT_SCALAR = "Gradient only defined for scalar-output functions."


# Held across the check that no state buffer was donated and the dispatch that donates them,
# by every step: two threads stepping from one state (through one step or two) would otherwise
# both pass the check, and the second call would run on freed buffers (the process crashes).
_DISPATCH = threading.RLock()


class _DonatingStep:
    """The jitted step, called as ``step(state, batch)``, refusing a state already donated.

    Calling a jitted function again on arrays it was donated crashes the interpreter in some
    jaxlib versions; a stale state is the common way to do it (``step(state, batch)`` without
    keeping what it returned), two threads stepping from one state the other. ``lower`` and
    ``trace`` check their arguments as a call does; the rest is the jitted function's.
    """

    def __init__(
        self, jitted: Any, structure: Any, batch_sharding: Any, devices: tuple[Any, ...]
    ) -> None:
        self._jitted = jitted
        self._structure = structure
        self._batch_sharding = batch_sharding
        self._devices = devices

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state, batch = self._arguments("step", args, kwargs)
        # Every step: one flatten; paths are looked up once a leaf is found deleted.
        leaves = jax.tree.leaves(state)
        with _DISPATCH:
            if any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in leaves):
                self._refuse_donated(state)
            return self._placing(self._jitted, state, batch)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit``'s ``lower``, with the arguments checked as a call checks them."""
        return self._placing(self._jitted.lower, *self._arguments("step.lower", args, kwargs))

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit``'s ``trace``, with the arguments checked as a call checks them."""
        return self._placing(self._jitted.trace, *self._arguments("step.trace", args, kwargs))

    def _arguments(self, call: str, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        if kwargs:
            named = ", ".join(f"{name}=" for name in kwargs)
            raise EscaleTypeError(
                f"jit_train_step: the step takes (state, batch) by position, got the keyword "
                f"argument(s) {named}; call {call}(state, batch)."
            )
        if len(args) != 2:
            extra = (
                "; put what else the step needs in the batch (a dict of arrays) or the state"
                if len(args) > 2
                else ""
            )
            raise EscaleTypeError(
                f"jit_train_step: the step takes 2 arguments, (state, batch), got {len(args)}"
                f"{extra}; call {call}(state, batch)."
            )
        state, batch = args
        if jax.tree.structure(state) != self._structure:
            raise EscaleTypeError(
                "jit_train_step: the state passed is not shaped like the state the step was "
                f"built for (got {check.describe(state)}): its arrays or its static fields "
                "differ (a TrainState made again with another apply_fn or tx object, say); pass "
                "the state the step was built for, or what its last call returned."
            )
        return state, batch

    def _placing(self, function: Callable[..., Any], state: Any, batch: Any) -> Any:
        # JAX refuses a batch it cannot place with errors about pjit's arguments; the batch is
        # only examined once it has refused, so that a step pays nothing for the checks.
        try:
            return function(state, batch)
        except (ValueError, TypeError) as error:
            problem = batch_problem(batch, self._batch_sharding, self._devices)
            if problem is None:
                raise
            raise problem from error

    @staticmethod
    def _refuse_donated(state: Any) -> None:
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise EscaleError(
                    f"jit_train_step: state{jax.tree_util.keystr(path)} was donated to an "
                    "earlier call of a step, which reused its memory for the state it "
                    "returned; pass the state the last call returned: "
                    "state, loss = step(state, batch)."
                )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def _sharding_of(path: Any, leaf: Any) -> jax.sharding.Sharding:
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        raise EscaleTypeError(
            f"jit_train_step: state{jax.tree_util.keystr(path)} is {leaf!r}, not an array with "
            "a sharding; build the state with flax_escale.linen.init_train_state, or put every "
            "leaf on the mesh (jax.device_put(jnp.asarray(leaf, jnp.int32), NamedSharding(mesh, "
            "PartitionSpec())) for a step) before jitting."
        )
    return sharding
