"""NNX models and optimizers created directly in their sharded layout."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._frontend import _pipeline as pipeline
from flax_escale._paths import flatten_with_paths
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.nnx._annotate import collecting_unused
from flax_escale.nnx._signature import binding_error, shown, signature
from flax_escale.plan import PlanEntry, ShardingPlan, annotated_leaves
from flax_escale.plan._optimizer import follow_shardings
from flax_escale.plan._resolving import STACKED_NAMES

__all__ = ["FRONT_END", "NnxFrontEnd", "OptimizerLayout", "init_optimizer", "optimizer_layout"]


def _sharding_metadata(entry: PlanEntry) -> dict[str, Any]:
    # The resolved mesh axes, except that an unsharded dimension and a stack's dimension (even
    # on a pipeline's stage axis) keep their logical names, mapped to their axes by the
    # variable's own sharding_rules: NNX's scan/vmap find their stacked axis name ("layers") in
    # out_sharding, and NNX's own lookup then still gives the resolved spec.
    names = entry.resolution.logical_axes or (None,) * len(entry.shape)
    spec = _pad(entry.spec, len(entry.shape))
    kept = [
        isinstance(name, str) and (axes is None or name in STACKED_NAMES)
        for axes, name in zip(spec, names, strict=True)
    ]
    out_sharding = tuple(
        name if keep else axes for axes, name, keep in zip(spec, names, kept, strict=True)
    )
    local = tuple((n, axes) for n, axes, keep in zip(names, spec, kept, strict=True) if keep)
    return {"out_sharding": out_sharding, "sharding_rules": local}


def init_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    wrt: Any = nnx.Param,
    shard_over: Sequence[str] = (),
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)``, its state created directly in its sharding.

    A state leaf takes the sharding of the variable it tracks, as
    :func:`~flax_escale.opt_state_shardings` gives it (Adafactor's factored statistics without
    the factored dimension; also split over ``shard_over``, ZeRO-1 style, when given); other
    leaves (the step, counts) are replicated. One ``jax.jit`` with ``out_shardings``: nothing
    is materialized whole.

    Args:
        model: A module whose tracked variables are sharded (from
            :func:`~flax_escale.init_sharded`).
        tx: The optax transformation.
        wrt: Which variables the optimizer updates, an NNX filter as ``nnx.Optimizer`` takes
            it; it must select at least one.
        shard_over: Mesh axes to also split optimizer state over, such as ``("dp",)``.

    Returns:
        The optimizer.

    Raises:
        EscaleTypeError: If ``model`` is not an NNX module or its variables are not sharded on
            one mesh, ``tx`` is not an optax transformation, or ``wrt`` is not an NNX filter
            (a function of other than ``(path, value)``, say).
        EscaleError: If ``wrt`` selects none of the model's variables: the optimizer would
            update nothing.

    Example:
        >>> import optax
        >>> from flax import nnx
        >>> from flax_escale import create_mesh
        >>> from flax_escale import init_sharded, sharded_module
        >>> from flax_escale.nnx import init_optimizer
        >>> mesh = create_mesh((2, 4, 1, 1, 1))
        >>> @sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
        ... class Up(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.wi = nnx.Linear(8, 16, use_bias=False, rngs=rngs)
        >>> opt = init_optimizer(init_sharded(Up, mesh, 0), optax.adam(1e-3), shard_over=("dp",))
        >>> opt.opt_state[0].mu["wi"]["kernel"].get_value().sharding.spec  # tp=1 splits nothing
        P(('fsdp', 'sp', 'dp'), None)
    """
    if not isinstance(model, nnx.Module):
        built = (
            f"; build it first, e.g. init_sharded({model.__name__}, mesh, 0)"
            if isinstance(model, type)
            else "; pass the module flax_escale.init_sharded returned"
        )
        raise EscaleTypeError(
            f"model must be a flax.nnx.Module, got {check.describe(model)}{built}."
        )
    tx = check.transformation(tx, "tx")
    _check_wrt(wrt, model)
    layout = optimizer_layout(model, tx, wrt=wrt, shard_over=check.names(shard_over, "shard_over"))
    with nnx.use_eager_sharding(False):
        init = jax.jit(lambda s: nnx.state(layout.make(s)), out_shardings=layout.shardings)
        opt_state = init(layout.state)
    return nnx.merge(layout.graphdef, opt_state)


def _check_wrt(wrt: Any, model: nnx.Module) -> None:
    # Flax answers a filter it cannot read with an error of its own format string, calls a
    # function of the wrong arity deep inside nnx.state, and from a filter that selects nothing
    # (a string is a tag, not a collection name) builds an optimizer that silently never trains.
    hint = "pass nnx.Param (the default) or a filter selecting the variables to train"
    _check_filter(wrt, wrt, hint)
    if jax.tree.leaves(nnx.state(model, wrt)):
        return
    kinds = sorted(
        {type(v).__name__ for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    )
    holds = f"it holds {', '.join(kinds)}" if kinds else "it holds no variables"
    tag = (
        " (a string selects variables by tag, not by collection name)"
        if isinstance(wrt, str)
        else ""
    )
    raise EscaleError(
        f"wrt {check.describe(wrt)} selects none of the model's variables ({holds}){tag}, so "
        f"the optimizer would update nothing; {hint}."
    )


def _check_filter(part: Any, wrt: Any, hint: str) -> None:
    if isinstance(part, (list, tuple)):
        for each in part:
            _check_filter(each, wrt, hint)
        return
    if isinstance(part, (str, type, bool)) or part is None or part is Ellipsis:
        return
    if not callable(part):
        raise EscaleTypeError(
            f"wrt must be an NNX filter (a Variable type such as nnx.Param, a tag string, a "
            f"function of (path, value), or a list of them), got {check.describe(wrt)}; {hint}."
        )
    error = binding_error(part, ("path", "value"), {})
    if error is not None:
        raise EscaleTypeError(
            f"wrt {shown(part)} is called with (path, value) for each variable "
            f"({error}); give the function exactly those 2 parameters, or {hint}."
        )


class OptimizerLayout(NamedTuple):
    """What :func:`init_optimizer` builds an optimizer from, before building it.

    Attributes:
        make: Builds the optimizer from the model's state.
        state: The model's state.
        graphdef: The optimizer's graph definition.
        abstract: The optimizer's state, as ``jax.ShapeDtypeStruct`` leaves.
        shardings: The sharding of every leaf of ``abstract``.
    """

    make: Callable[[Any], nnx.Optimizer]
    state: Any
    graphdef: Any
    abstract: Any
    shardings: Any


def optimizer_layout(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    wrt: Any = nnx.Param,
    shard_over: tuple[str, ...] = (),
) -> OptimizerLayout:
    """The optimizer :func:`init_optimizer` would build, traced only; arguments are its own.

    The arguments are taken as checked (``model`` a module, ``tx`` a transformation,
    ``shard_over`` a tuple of names). The model's variables may hold arrays or
    ``jax.ShapeDtypeStruct`` with shardings.
    """
    graphdef, state = nnx.split(model)
    tracked = []
    for path, variable in _variables(model):
        sharding = getattr(variable.get_value(), "sharding", None)
        if not isinstance(sharding, NamedSharding):
            raise EscaleTypeError(
                f"variable {path!r} is not sharded with a NamedSharding ({sharding!r}); build "
                "the model with flax_escale.init_sharded first."
            )
        tracked.append((path, variable.get_value().shape, sharding))
    meshes = {sharding.mesh for _, _, sharding in tracked}
    if len(meshes) != 1:
        raise EscaleTypeError(f"the variables are sharded on {len(meshes)} meshes, not one.")

    def make(state: Any) -> nnx.Optimizer:
        return nnx.Optimizer(nnx.merge(graphdef, state), tx, wrt=wrt)

    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(make, state)
        opt_graphdef, abstract_state = nnx.split(abstract)
        shardings = follow_shardings(abstract_state, tracked, meshes.pop(), shard_over=shard_over)
    return OptimizerLayout(make, state, opt_graphdef, abstract_state, shardings)


class NnxFrontEnd:
    """The pipeline's NNX side: the constructor traced, jitted and merged into a module."""

    name = "nnx"
    trace_needs_mesh = False

    def check(self, call: pipeline.ModelCall) -> pipeline.ModelCall:
        """Checks that the constructor takes the call's arguments and ``rngs=``.

        Raises:
            EscaleTypeError: If its signature does not take ``args``, ``kwargs`` and ``rngs=``.
        """
        _check_constructor(call.model, call.args, dict(call.kwargs))
        return call

    def trace(
        self, call: pipeline.ModelCall, mesh: Mesh | None = None, options: Any = None
    ) -> pipeline.Traced:
        """``nnx.eval_shape`` of the constructor, with no mesh: it depends on none."""
        del mesh, options
        # No mesh while tracing: with one, nnx.eval_shape resolves Flax out_sharding names
        # with NNX's own lookup, which the library's rules (fallbacks repeat a name) make fail.
        with nnx.use_eager_sharding(False), collecting_unused() as notes:
            abstract = nnx.eval_shape(_constructor(call), call.rng)
        treedef, items = annotated_leaves(nnx.state(abstract))
        return pipeline.Traced(treedef, tuple(items), tuple(notes), abstract)

    def initializer(
        self, call: pipeline.ModelCall, options: Any
    ) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
        """The constructor returning its state; the keys are its argument."""
        del options
        create = _constructor(call)
        return (lambda keys: nnx.state(create(keys))), (call.rng,), (call.args, call.kwargs)

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """Flax's eager sharding off: the plan's ``out_shardings`` place every variable."""
        return nnx.use_eager_sharding(False)

    def finish(self, variables: Any, plan: ShardingPlan, traced: pipeline.Traced) -> nnx.Module:
        """The module, each variable's metadata naming its resolved spec."""
        module = nnx.merge(nnx.split(traced.abstract)[0], variables)
        for entry, (_, variable) in zip(plan, _variables(module), strict=True):
            variable.set_metadata(**_sharding_metadata(entry))
        return module


FRONT_END = NnxFrontEnd()


def _check_constructor(model: Any, args: tuple, kwargs: dict) -> None:
    # Checked here, not left to the call: that happens while tracing, where Python's error
    # names neither the argument nor how the entry points call the model.
    if "rngs" in kwargs:
        raise EscaleTypeError(
            f"model {shown(model)} gets its rngs from rng, but rngs= (a "
            f"{type(kwargs['rngs']).__name__}) was passed as one of its keyword arguments too; "
            "drop it and pass its seed or key as rng."
        )
    error = binding_error(model, args, {**kwargs, "rngs": None})
    if error is None:
        return
    given = f"{len(args)} positional argument(s)" + (
        f" and the keywords {', '.join(kwargs)}" if kwargs else ""
    )
    example = model.__name__ if isinstance(model, type) else "Model"
    if _takes_rngs(model):
        hint = (
            "pass its other arguments after rng, as init_sharded(model, mesh, rng, *args, "
            f"**kwargs), or a factory such as lambda rngs: {example}(..., rngs=rngs)"
        )
    else:
        hint = (
            "it must take the keyword argument rngs: give it an rngs parameter, or pass a "
            f"factory such as lambda rngs: {example}(..., rngs=rngs)"
        )
    raise EscaleTypeError(
        f"model {shown(model)} cannot be built as model(*args, rngs=nnx.Rngs(rng), **kwargs) with "
        f"{given} ({error}); {hint}."
    )


def _takes_rngs(model: Any) -> bool:
    while isinstance(model, functools.partial):
        model = model.func
    return any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD
        or (
            parameter.name == "rngs"
            and parameter.kind is not inspect.Parameter.POSITIONAL_ONLY
            and parameter.kind is not inspect.Parameter.VAR_POSITIONAL
        )
        for parameter in signature(model).parameters.values()
    )


def _constructor(call: pipeline.ModelCall) -> Callable[[Any], nnx.Module]:
    model, args, kwargs = call.model, call.args, call.kwargs

    def create(rng: Any) -> nnx.Module:
        rngs = nnx.Rngs(**rng) if isinstance(rng, dict) else nnx.Rngs(rng)
        module = model(*args, rngs=rngs, **kwargs)
        if not isinstance(module, nnx.Module):
            raise EscaleTypeError(
                f"model {shown(model)} returned a {type(module).__name__}, not an NNX module; "
                "pass a class or function whose call builds the nnx.Module (a container of "
                "modules, such as a dict, goes inside a module's attribute)."
            )
        return module

    return create


def _variables(module: nnx.Module) -> list[tuple[str, nnx.Variable]]:
    _, state = nnx.split(module)
    live = {"/".join(str(k) for k in path): v for path, v in nnx.iter_graph(module)}
    return [(path, live[path]) for path, _, _ in flatten_with_paths(state)[0]]


def _pad(spec: PartitionSpec, rank: int) -> list[Any]:
    return [*spec, *([None] * (rank - len(spec)))]
