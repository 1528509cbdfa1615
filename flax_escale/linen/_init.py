"""Linen models initialized directly in their sharded layout, with their optimizer state."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._frontend import _pipeline as pipeline
from flax_escale._frontend._options import InitOptions
from flax_escale._frontend._overrides import Overrides
from flax_escale._paths import is_box
from flax_escale._paths import unbox as unbox_leaf
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.linen._annotator import annotating
from flax_escale.linen._at_use import data_axes, gathering_apply
from flax_escale.mesh import with_auto_axes
from flax_escale.plan import USE_IDLE_AXES, ShardingPlan, annotated_leaves
from flax_escale.plan._optimizer import create_checked
from flax_escale.resolve import RulesLike
from flax_escale.sharding._use_sharding import sharding_context

__all__ = ["FRONT_END", "LinenCall", "LinenFrontEnd", "init_train_state"]


def init_train_state(
    model: nn.Module,
    mesh: Mesh,
    rng: Any,
    *inputs: Any,
    tx: optax.GradientTransformation,
    rules: RulesLike = None,
    strict: bool = False,
    overrides: Overrides | None = None,
    use_idle_axes: bool = USE_IDLE_AXES,
    shard_over: Sequence[str] = (),
    method: Callable[..., Any] | str | None = None,
    gather_at_use: bool = False,
    **init_kwargs: Any,
) -> TrainState:
    """A Flax ``TrainState`` whose parameters and optimizer state are born sharded.

    The parameters come from :func:`~flax_escale.init_sharded`; the optimizer state from
    :func:`~flax_escale.init_opt_state`, each leaf in its parameter's sharding (and split over
    ``shard_over`` too, ZeRO-1 style). ``apply_fn`` is ``model.apply``; with
    ``gather_at_use``, it gathers each parameter over the axes the rules split the batch and
    sequence over (``dp``, ``fsdp``, ``sp`` by default) where the model reads it, as FSDP does:
    for a model with no activation constraints of its own, whose parameters' layout XLA
    could otherwise follow onto its activations (and replicate them to split them again).

    Args:
        model: The Linen module.
        mesh: The mesh.
        rng: A key or a dict of keys, as ``model.init`` takes.
        *inputs: Example inputs for ``model.init``.
        tx: The optax transformation.
        rules: The logical-axis rules; see :func:`~flax_escale.plan_sharding`.
        strict: Raise instead of correcting; see :func:`~flax_escale.plan_sharding`.
        overrides: Annotations to replace; see :func:`~flax_escale.plan_sharding`.
        use_idle_axes: See :func:`~flax_escale.plan_sharding`.
        shard_over: Mesh axes to also split optimizer state over, such as ``("dp",)``.
        method: Passed to ``model.init``.
        gather_at_use: Make ``apply_fn`` gather each parameter where the model reads it.
        **init_kwargs: Passed to ``model.init``.

    Returns:
        The train state, at step 0. Every leaf is a ``jax.Array`` on the mesh, the step a
        replicated ``int32`` scalar: the state has the types and shardings a jitted training
        step returns, so the step compiles once, not again for its own output.

    Raises:
        EscaleError: If the model has variables besides ``params`` (a ``TrainState`` holds only
            parameters): use :func:`~flax_escale.init_sharded` and
            :func:`~flax_escale.init_opt_state`; or, with ``gather_at_use``, if the rules split
            the batch and sequence over no mesh axis.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import optax
        >>> import flax_escale as fe
        >>> @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
        ... class Up(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(16)(x)
        >>> state = fe.linen.init_train_state(Up(), fe.create_mesh((2, 4, 1, 1, 1)),
        ...     jax.random.key(0), jax.numpy.ones((2, 8)), tx=optax.adam(1e-3), shard_over=("dp",))
        >>> state.opt_state[0].mu["Dense_0"]["kernel"].sharding.spec  # ZeRO-1: dp too
        P(('fsdp', 'sp', 'dp'), None)
        >>> state.step.dtype, state.step.sharding.spec
        (dtype('int32'), P())
    """
    tx = check.transformation(tx, "tx")
    shard_over = check.names(shard_over, "shard_over")
    # Refused before any work when the rules leave nothing to gather over.
    gathered_over = data_axes(rules) if check.flag(gather_at_use, "gather_at_use") else None
    _check_model(model)
    options = InitOptions.create(
        rules=rules, strict=strict, overrides=overrides, use_idle_axes=use_idle_axes
    )
    call = {**init_kwargs, "method": method}
    variables = pipeline.init(pipeline.request(FRONT_END, model, mesh, rng, inputs, call, options))
    others = sorted(c for c in variables if c != "params" and jax.tree.leaves(variables[c]))
    if others:
        raise EscaleError(
            f"the model has variable collections {others} besides 'params', which a TrainState "
            "would drop; use init_sharded(...) and init_opt_state(tx, variables['params']) and "
            "keep the other collections yourself."
        )
    params = variables["params"]
    opt_state = create_checked(tx, params, shard_over)
    # A Python int would be traced as a weakly typed scalar, and the int32 array the first
    # step returns would make a jitted step compile a second time.
    step = jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, PartitionSpec()))
    apply_fn = model.apply
    if gathered_over is not None:
        apply_fn = gathering_apply(apply_fn, params, gathered_over)
    return TrainState(step=step, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt_state)


@dataclasses.dataclass(frozen=True)
class LinenCall(pipeline.ModelCall):
    """A Linen model's call: ``model.init(rng, *args, method=method, **kwargs)``.

    Attributes:
        method: The method ``model.init`` calls (``None`` for ``__call__``), taken out of the
            entry point's keywords: Linen's alone.
    """

    method: Callable[..., Any] | str | None = None


class LinenFrontEnd:
    """The pipeline's Linen side: ``model.init`` traced, jitted and returned unboxed."""

    name = "linen"
    trace_needs_mesh = True

    def check(self, call: pipeline.ModelCall) -> LinenCall:
        """Takes ``method=`` out of the keywords; checks it and the inputs against the model."""
        kwargs = dict(call.kwargs)
        method = kwargs.pop("method", None)
        _check_method(call.model, method)
        _check_inputs(call.model, method, call.args, kwargs)
        return LinenCall(call.model, call.rng, call.args, kwargs, method)

    def trace(self, call: LinenCall, mesh: Mesh, options: InitOptions) -> pipeline.Traced:
        """``jax.eval_shape`` of ``model.init`` with its boxes, under ``mesh`` and the rules."""
        init = _initializer(call, unbox=False)
        # Under the Auto twin: Flax's boxes constrain each parameter as the model reads it,
        # which on Explicit axes would assert the unsharded value's sharding instead.
        with (
            sharding_context(with_auto_axes(mesh), options.rules),
            annotating() as annotator,
        ):
            abstract = jax.eval_shape(init, call.rng, *call.args)
        treedef, items = annotated_leaves(abstract, sources=annotator.sources)
        return pipeline.Traced(treedef, tuple(items), tuple(annotator.unused()))

    def initializer(
        self, call: LinenCall, options: InitOptions
    ) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
        """``model.init`` returning plain arrays; the rng and inputs are its arguments."""
        del options
        return _initializer(call, unbox=True), (call.rng, *call.args), (call.method, call.kwargs)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """Nothing besides the mesh and rules."""
        return contextlib.nullcontext()

    def finish(self, variables: Any, plan: ShardingPlan, traced: pipeline.Traced) -> Any:
        """The variables as they are."""
        del plan, traced
        return variables


FRONT_END = LinenFrontEnd()


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise EscaleTypeError(
            f"model must be a flax.linen.Module instance, got {model!r}; for an NNX model use "
            "flax_escale.init_sharded and flax_escale.nnx.init_optimizer."
        )


def _check_method(model: nn.Module, method: Any) -> None:
    # Flax would say ApplyModuleInvalidMethodError for 3, and raise an AttributeError for the
    # name of a method the class lacks.
    if method is None or (callable(method) and not isinstance(method, str)):
        return
    cls = type(model)
    if isinstance(method, str) and callable(getattr(cls, method, None)):
        return
    fields = {field.name for field in dataclasses.fields(cls)}
    own = [
        name
        for name in dir(cls)
        if (name == "__call__" or not (name.startswith("_") or hasattr(nn.Module, name)))
        and name not in fields
        and inspect.isfunction(getattr(cls, name, None))
    ]
    hint = f"pass one of its methods ({', '.join(map(repr, own))})" if own else "pass None"
    if not isinstance(method, str):
        raise EscaleTypeError(
            f"method must be None, a function or the name of a method of {cls.__name__}, got "
            f"{check.describe(method)}; {hint}."
        )
    raise EscaleError(f"method {method!r} is not a method of {cls.__name__}; {hint}.")


# model.init's own keywords, which it does not pass on to the method.
_INIT_KEYWORDS = frozenset({"mutable", "capture_intermediates"})


def _check_inputs(model: nn.Module, method: Any, args: tuple, kwargs: dict) -> None:
    # Checked here: a missing input otherwise surfaces as Python's error from inside the
    # traced init, which says nothing of where the inputs come from.
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        if not (hasattr(leaf, "shape") or isinstance(leaf, (bool, int, float, complex))):
            raise EscaleTypeError(
                f"model: example input inputs{jax.tree_util.keystr(path)} is "
                f"{check.describe(leaf)}, which model.init cannot trace as an array; pass "
                "arrays (or jax.ShapeDtypeStruct) as inputs, and settings as the module's "
                "attributes."
            )
    name = "__call__" if method is None else method
    if not isinstance(name, str):
        return  # a function given as method: Flax passes it the module too
    try:
        signature = inspect.signature(getattr(model, name))
    except (TypeError, ValueError):
        return  # nothing to read; the call will say
    keywords = {key: value for key, value in kwargs.items() if key not in _INIT_KEYWORDS}
    try:
        signature.bind(*args, **keywords)
    except TypeError as error:
        plain = [
            p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
        ]
        shown = f"{type(model).__name__}.{name}{inspect.Signature(plain)}"
        raise EscaleTypeError(
            f"model: {shown} cannot be called with the {len(args)} example input(s) "
            f"{'and the keywords ' + ', '.join(keywords) + ' ' if keywords else ''}given "
            f"({error}); pass the example inputs after rng, as init_sharded(model, mesh, rng, "
            "*inputs), and its keyword arguments by name."
        ) from None


def _initializer(call: LinenCall, *, unbox: bool) -> Callable[..., Any]:
    model, method, init_kwargs = call.model, call.method, call.kwargs

    def init(rng: Any, *inputs: Any) -> Any:
        variables = model.init(rng, *inputs, method=method, **init_kwargs)
        return jax.tree.map(unbox_leaf, variables, is_leaf=is_box) if unbox else variables

    return init
