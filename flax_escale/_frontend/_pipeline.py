"""The one init pipeline both Flax APIs go through.

trace the abstract variables -> read their annotations -> apply ``overrides=`` -> plan ->
lower the initializer with ``out_shardings`` -> compile (kept) -> run -> finish.

A Flax API implements only what differs, the :class:`FrontEnd` protocol: how a model is
checked and traced, the function that initializes it, and how its result is finished. The
public entry points check their arguments once, into a :class:`Request`; every stage below
takes checked values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._frontend._init_cache import run_cached
from flax_escale._frontend._options import InitOptions
from flax_escale._frontend._overrides import apply_overrides
from flax_escale.mesh._agreement import agree_on_mesh
from flax_escale.mesh._context import with_auto_axes
from flax_escale.plan import AnnotatedLeaf, ShardingPlan
from flax_escale.plan._build import plan_checked
from flax_escale.sharding._use_sharding import sharding_context

__all__ = [
    "FrontEnd",
    "ModelCall",
    "Request",
    "Traced",
    "as_keys",
    "checked_call",
    "init",
    "lower",
    "plan",
    "plan_variables",
    "request",
]


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """A model and what it is built from.

    Attributes:
        model: Linen: the module instance; NNX: the module class or a callable taking
            ``rngs=``.
        rng: The randomness, checked, every seed made a key.
        args: Linen: example inputs of ``model.init``; NNX: constructor arguments.
        kwargs: Linen: ``model.init``'s keywords; NNX: constructor keywords.
    """

    model: Any
    rng: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def as_keys(rng: Any) -> Any:
    """``rng`` with every int seed made a key (a dict of them by stream name, too).

    Seeds become keys before tracing: ``nnx.Rngs`` cannot take a traced integer, and Linen's
    ``init`` takes keys only.

    Example:
        >>> import jax
        >>> from flax_escale._frontend._pipeline import as_keys
        >>> keys = as_keys({"params": 0, "dropout": jax.random.key(1)})
        >>> jax.random.key_data(keys["params"]).tolist() == jax.random.key_data(
        ...     jax.random.key(0)).tolist()
        True
    """
    if isinstance(rng, dict):
        return {name: as_keys(seed) for name, seed in rng.items()}
    is_seed = isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)
    return jax.random.key(int(rng)) if is_seed else rng


@dataclasses.dataclass(frozen=True)
class Traced:
    """A model's variables traced without creating any (the first stage).

    Attributes:
        treedef: The structure of the variables as the initializer returns them.
        items: ``(path, abstract array, annotation)`` per variable, in flattening order.
        notes: What the tracing noticed that concerns no single variable (patterns that
            matched nothing).
        abstract: What the front end needs to finish (NNX: the abstract module).
    """

    treedef: Any
    items: tuple[AnnotatedLeaf, ...]
    notes: tuple[str, ...] = ()
    abstract: Any = None


class FrontEnd(Protocol):
    """What a Flax API implements for the pipeline: only what differs between Linen and NNX."""

    name: str
    """``"linen"`` or ``"nnx"``: part of the kept programs' key."""
    trace_needs_mesh: bool
    """Whether tracing depends on the mesh (Linen's constraints see it; NNX's do not)."""

    def check(self, call: ModelCall) -> ModelCall:
        """Checks the call of a model of this front end's kind; returns the call it runs."""

    def trace(self, call: ModelCall, mesh: Mesh, options: InitOptions) -> Traced:
        """The abstract variables and their annotations (``mesh`` may be unused)."""

    def initializer(
        self, call: ModelCall, options: InitOptions
    ) -> tuple[Callable[..., Any], tuple[Any, ...], Any]:
        """The function to jit, its dynamic arguments, and what else keys its program."""

    def tracing(self) -> contextlib.AbstractContextManager[Any]:
        """A context the initializer is lowered in, besides the mesh and rules."""

    def finish(self, variables: Any, plan: ShardingPlan, traced: Traced) -> Any:
        """What the user receives, from the initializer's sharded output."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked call of an entry point: the front end, the call, the mesh and the options."""

    front_end: FrontEnd
    call: ModelCall
    mesh: Mesh
    options: InitOptions


def request(
    front_end: FrontEnd,
    model: Any,
    mesh: Any,
    rng: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: InitOptions,
) -> Request:
    """One call of an entry point, checked: the mesh once, the model and its arguments once.

    ``front_end`` is the one the dispatcher chose for the kind of ``model`` (that check is its);
    ``options`` are checked already, where the entry point took them.
    """
    return Request(
        front_end, checked_call(front_end, model, rng, args, kwargs), check.mesh(mesh), options
    )


def checked_call(
    front_end: FrontEnd, model: Any, rng: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ModelCall:
    """Checks the model's arguments once, for any number of meshes; seeds become keys."""
    check.rng(rng)
    return front_end.check(ModelCall(model, as_keys(rng), args, kwargs))


def plan(request: Request, traced: Traced | None = None) -> tuple[Traced, ShardingPlan]:
    """Traces (unless ``traced`` is given), applies the overrides and plans every variable."""
    front_end, options = request.front_end, request.options
    if traced is None:
        traced = front_end.trace(request.call, request.mesh, options)
    return traced, plan_variables(traced.treedef, traced.items, request.mesh, options, traced.notes)


def plan_variables(
    treedef: Any,
    items: Sequence[AnnotatedLeaf],
    mesh: Mesh,
    options: InitOptions,
    notes: tuple[str, ...] = (),
) -> ShardingPlan:
    """Applies the overrides to annotated variables and plans them: the planning stage.

    For callers that read the variables themselves (a train state given to the t5x
    ``Partitioner``); the entry points come through :func:`plan`.
    """
    items, unused = apply_overrides(items, options.overrides)
    return plan_checked(
        treedef,
        items,
        mesh,
        options.rules,
        strict=options.strict,
        notes=(*notes, *unused),
        use_idle_axes=options.use_idle_axes,
    )


def lower(
    request: Request, traced: Traced | None = None
) -> tuple[Traced, ShardingPlan, jax.stages.Lowered]:
    """Plans, then lowers the initializer with the plan's ``out_shardings``."""
    agree_on_mesh(request.mesh)
    traced, made = plan(request, traced)
    function, arguments, _ = request.front_end.initializer(request.call, request.options)
    jitted = jax.jit(function, out_shardings=made.shardings())
    with _lowering(request):
        return traced, made, jitted.lower(*arguments)


def init(request: Request) -> Any:
    """Creates the variables in their shardings; the compiled initializer is kept.

    The same model (by ``==``) on the same mesh, with the same options, static arguments and
    dynamic arguments of the same shapes, dtypes and shardings, runs the kept program.
    """
    front_end, call = request.front_end, request.call
    _, arguments, static = front_end.initializer(call, request.options)
    key = (front_end.name, request.mesh, request.options, static)

    def build() -> tuple[Traced, ShardingPlan, jax.stages.Compiled]:
        traced, made, lowered = lower(request)
        return traced, made, lowered.compile()

    def run(built: tuple[Traced, ShardingPlan, jax.stages.Compiled]) -> Any:
        traced, made, compiled = built
        return traced, made, compiled(*arguments)

    traced, made, variables = run_cached(call.model, key, arguments, build, run)
    return front_end.finish(variables, made, traced)


@contextlib.contextmanager
def _lowering(request: Request) -> Iterator[None]:
    # Under the mesh's Auto twin: the values of the same initializer jitted on one device (on
    # Explicit axes JAX would shard every intermediate and change XLA's fusions).
    with (
        sharding_context(with_auto_axes(request.mesh), request.options.rules),
        request.front_end.tracing(),
    ):
        yield
