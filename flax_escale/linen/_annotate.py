"""``sharded_module`` for Linen: logical names kept beside the parameters, out of the model's sight.

A decorated class declares ``{path pattern: logical axes}``. While a model initializes, a Flax
method interceptor looks at each module's parameters right after the module's method ran and
records, for every unannotated one that a pattern of an enclosing decorated module matches
(innermost declaring module first), its logical names on the side: the parameter stays the plain
array it was, so what the model's own code reads (a tied embedding's ``.T``, a child's variables
in ``setup``) is what it reads without the library. The names go onto the parameters
(``nn.LogicallyPartitioned``) only where no model code looks any more: when the outermost call
of the model returns, so ``model.init`` returns them boxed; and when a Flax lifted transform
(``nn.scan``, ``nn.vmap``, ``nn.remat``, ...) takes a body's variables out, in a private box
that lets ``nn.scan`` and ``nn.vmap`` name their stacked axis and then comes out as the plain
array again. And ``model.init`` of a decorated class takes a last look at what it returns, so
that a parameter is annotated whatever runs the model's calls: a ``nn.jit`` around the model's
own ``__call__`` (which Flax's interceptors never see, and whose kept trace replays without
running the model's code), a method Flax does not wrap. Outside initialization nothing runs
at all.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import flax.linen as nn
import jax
import numpy as np
from flax import struct
from flax.core import meta
from flax.core.scope import Scope

from flax_escale._frontend import (
    AxesPatterns,
    DeclaringMixin,
    declare,
    record,
    unused_pattern_note,
)
from flax_escale._frontend._patterns import shown_paths
from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["ShardedMixin", "annotating", "sharded_module"]

M = TypeVar("M", bound=type[nn.Module])

_PATTERNS = "__escale_patterns__"
_WRAPPED = "__escale_wrapped__"
_state = threading.local()
_STACK_HINT = (
    "inside nn.scan, name the per-layer dimensions: the stacked one is added by "
    "metadata_params={nn.PARTITION_NAME: 'layers'}"
)

Path = tuple[str, ...]
Names = tuple[str | None, ...]


class _Declared(nn.LogicallyPartitioned):
    """Flax's logical box, on the parameters ``sharded_module`` declared names for.

    What ``model.init`` returns; told apart from the model's own boxes so that ``apply`` and
    ``bind`` of a decorated class, and a later initialization, hand the model the plain array.
    ``source`` is the declaring class and pattern, static, so that it survives a Flax
    ``nn.jit`` whose kept trace replays the box without running the model's code again.
    """

    source: tuple[str, str] | None = struct.field(pytree_node=False, default=None)


class _Carried(struct.PyTreeNode, meta.AxisMetadata[Any]):
    """A declared parameter leaving a Flax lifted transform, with its names and path.

    ``nn.scan`` and ``nn.vmap`` call ``add_axis`` on every box they take out of their body:
    this one records the stacked names with the active annotator and gives back the plain
    array, so the stacked parameter reaches the enclosing module unboxed. Other transforms
    (``nn.remat``, ``nn.jit``) hand it out as it is; the annotator unboxes it at the next
    module call of the enclosing modules.
    """

    value: Any
    names: Names = struct.field(pytree_node=False)
    path: Path = struct.field(pytree_node=False)
    source: tuple[str, str] | None = struct.field(pytree_node=False, default=None)

    def unbox(self) -> Any:
        """The array."""
        return self.value

    def replace_boxed(self, val: Any) -> _Carried:
        """The same names around ``val``."""
        return self.replace(value=val)

    def add_axis(self, index: int, params: dict[Any, Any]) -> Any:
        """Records the names with the stacked axis added; returns the plain array."""
        if nn.PARTITION_NAME not in params:
            where = "params/" + "/".join(self.path)
            raise EscaleError(
                f"parameter {where}: a Flax transform (nn.scan or nn.vmap) stacks it along axis "
                f"{index}, and its declared logical axes {self.names} have no name for that "
                "axis; pass metadata_params={nn.PARTITION_NAME: 'layers'} to the transform."
            )
        names = list(self.names)
        names[index:index] = [None] * (index - len(names)) + [params[nn.PARTITION_NAME]]
        _remember(self.path, tuple(names))
        return self.value

    def remove_axis(self, index: int, params: dict[Any, Any]) -> Any:
        """Records the names without the axis a transform takes away; returns the array."""
        del params
        _remember(self.path, self.names[:index] + self.names[index + 1 :])
        return self.value


def _remember(path: Path, names: Names) -> None:
    annotator = getattr(_state, "annotator", None)
    if annotator is not None:
        annotator.known[(path, len(names))] = names


def _tree_of(scope: Scope) -> Scope:
    # A lifted transform runs its body in a scope tree of its own, whose root has no parent.
    while scope.parent is not None:
        scope = scope.parent
    return scope


class Annotator:
    """Records declared names as modules create parameters; boxes them where no model looks.

    Attributes:
        owners: Decorated modules seen, by path.
        sources: For each annotated parameter path, the class and pattern that annotated it.
        matched: ``(owner, pattern)`` pairs that annotated at least one parameter.
        kept: For each ``(owner, pattern)``, the parameters it matched that keep the
            annotation the model gives them.
        known: The declared names of each parameter path, by rank (a parameter stacked by
            ``nn.scan`` has one more dimension outside the scan than inside).
        origins: For each annotated parameter path, its ``(owner, pattern)``.
        seen: Every parameter path seen, in order (for the notes of unused patterns).
    """

    def __init__(self) -> None:
        self.owners: dict[Path, AxesPatterns] = {}
        self.sources: dict[str, str] = {}
        self.origins: dict[Path, tuple[str, str]] = {}
        self.seen: dict[Path, None] = {}
        self.matched: set[tuple[str, str]] = set()
        self.kept: dict[tuple[str, str], list[str]] = {}
        self.known: dict[tuple[Path, int], Names] = {}
        # The scope tree of the first call seen: the model's own (or, for a decorated module
        # met first inside a lifted transform, that transform's body).
        self._home: Scope | None = None
        # The module calls under way, innermost last, each with its scope tree.
        self._calls: list[tuple[nn.Module, Scope]] = []
        # Where _Carried boxes land once a lifted transform returns: the scope tree that
        # called it and the path of the transformed module.
        self._landing: list[tuple[Scope, Path]] = []

    def __call__(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if module.scope is None or not module.is_initializing():
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        patterns = getattr(type(module), _PATTERNS, None)
        if patterns is not None:
            self.owners[path] = patterns
        tree = _tree_of(module.scope)
        if self._home is None:
            self._home = tree
        self._land(tree)
        # The outermost call under way in a scope tree: before it no model code of that tree
        # runs, and after it none runs any more.
        outermost = all(other is not tree for _, other in self._calls)
        if outermost:
            self._rewrite(module.scope, (), self._unboxed)
        self._calls.append((module, tree))
        try:
            out = next_fun(*args, **kwargs)
        except Exception:
            _refuse_axis_named_twice(module, path)
            raise
        finally:
            self._calls.pop()
        self._land(tree)
        self._annotate(module, path)
        if outermost:
            carried = tree is not self._home
            self._rewrite(module.scope, (), functools.partial(self._boxed, carried))
            if carried and self._calls:
                self._landing.append((self._calls[-1][1], path))
        return out

    def _annotate(self, module: nn.Module, path: Path) -> None:
        variables = module.variables
        axes_metadata = variables.get("params_axes", {})
        for name, value in variables.get("params", {}).items():
            if isinstance(value, (Mapping, _Carried, _Declared)):
                continue
            full = (*path, name)
            self.seen[full] = None
            if isinstance(value, meta.AxisMetadata) or f"{name}_axes" in axes_metadata:
                self._keep(full)
            elif (full, np.ndim(value)) not in self.known:
                self._declared_names(full, value)

    def _keep(self, full: Path) -> None:
        # Annotated by the model itself: it keeps that annotation (overrides= replaces it), and
        # a pattern that matches it is told so rather than "matched nothing".
        owned = self._owner(full)
        if owned is not None and (found := owned[1].match("/".join(full[owned[0] :]))):
            where = "params/" + "/".join(full)
            kept = self.kept.setdefault((owned[1].owner, found[0]), [])
            if where not in kept:
                kept.append(where)

    def _declared_names(self, full: Path, value: Any) -> Names | None:
        # The names a declaration gives the plain parameter ``value`` at ``full``, recorded.
        names = self.known.get((full, np.ndim(value)))
        if names is not None:
            return names
        found = self._lookup(full, np.shape(value))
        if found is None:
            return None
        owner, pattern, names = found
        self.known[(full, len(names))] = tuple(names)
        self._credit(full, (owner, pattern))
        return tuple(names)

    def _credit(self, full: Path, source: tuple[str, str] | None) -> None:
        # Which class and pattern annotated the parameter at ``full``.
        if source is None or full in self.origins:
            return
        owner, pattern = source
        self.origins[full] = source
        self.sources["params/" + "/".join(full)] = f"{owner}[{pattern!r}]"
        self.matched.add(source)

    def expect(self, cls: type[nn.Module]) -> None:
        """Declares ``cls``, the class ``model.init`` was called on, the owner of the root."""
        patterns = getattr(cls, _PATTERNS, None)
        if patterns is not None:
            self.owners.setdefault((), patterns)

    def finish(self, params: Any, axes: Any) -> Any:
        """``params`` as ``model.init`` returns them: every declared parameter boxed.

        The last look, once no model code runs any more, whatever ran it: a box a Flax lifted
        transform around the model's own call still carries, a parameter made where no method
        interceptor looked, or one from a kept ``nn.jit`` trace, which replays its boxes without
        running the model's code, gets its names here.

        Args:
            params: The ``params`` collection ``model.init`` returns.
            axes: Its ``params_axes`` collection (the model's own t5x-style names), or ``{}``.
        """
        if not isinstance(params, Mapping):
            return params
        new = _rebuilt(params, (), functools.partial(self._finished, axes))
        if new is None:
            return params
        return new if isinstance(params, dict) else type(params)(new)

    def _finished(self, axes: Any, full: Path, value: Any) -> Any:
        self.seen[full] = None
        if isinstance(value, (_Carried, _Declared)):
            names = tuple(value.names)
            self.known[(full, len(names))] = names
            self._credit(full, value.source)
            if isinstance(value, _Declared):
                return value
            return _Declared(value.value, names, source=value.source)
        if isinstance(value, meta.AxisMetadata) or _axes_given(axes, full):
            self._keep(full)
            return value
        names = self._declared_names(full, value)
        if names is None:
            return value
        return _Declared(value, names, source=self.origins.get(full))

    def _boxed(self, carried: bool, full: Path, value: Any) -> Any:
        # Where no model code looks any more: the declared names on the parameter.
        if isinstance(value, (_Carried, _Declared)):
            names, array = tuple(value.names), value.value
        elif isinstance(value, meta.AxisMetadata):
            return value
        else:
            names, array = self.known.get((full, np.ndim(value))), value
            if names is None:
                return value
        source = self.origins.get(full)
        if carried:
            return _Carried(array, names, full, source)
        return value if isinstance(value, _Declared) else _Declared(array, names, source=source)

    def _unboxed(self, full: Path, value: Any) -> Any:
        # Before model code runs again: the plain array of a box the library put on.
        if not isinstance(value, (_Carried, _Declared)):
            return value
        names = tuple(value.names)
        self.known[(full, len(names))] = names
        self._credit(full, value.source)
        return value.value

    def _land(self, tree: Scope) -> None:
        # A lifted transform that does not stack (nn.remat, nn.jit) hands its body's boxes to
        # the tree that called it: unboxed at that tree's next module call or return.
        waiting = []
        for caller, path in self._landing:
            if caller is not tree:
                waiting.append((caller, path))
            elif path[: len(tree.path)] == tuple(tree.path):
                self._rewrite(tree, path[len(tree.path) :], self._unboxed)
        self._landing = waiting

    @staticmethod
    def _rewrite(scope: Scope, under: Path, change: Callable[[Path, Any], Any]) -> None:
        """Replaces each parameter below ``under`` (relative to ``scope``) by ``change``'s."""
        if not scope.is_mutable_collection("params"):
            return
        tree: Any = scope.variables().get("params", {})
        for key in under:
            tree = tree.get(key) if isinstance(tree, Mapping) else None
            if tree is None:
                return
        if not isinstance(tree, Mapping):
            return
        new = _rebuilt(tree, (*scope.path, *under), change)
        if new is None:
            return
        if under:
            for key in reversed(under[1:]):
                new = {key: new}
            scope.put_variable("params", under[0], new)
            return
        for name, value in new.items():
            if value is not tree[name]:
                scope.put_variable("params", name, value)

    def _lookup(
        self, full: tuple[str, ...], shape: tuple[int, ...]
    ) -> tuple[str, str, tuple[str | None, ...]] | None:
        owned = self._owner(full)
        if owned is None:
            return None
        depth, patterns = owned
        found = patterns.match_array(
            "/".join(full[depth:]), shape, shown_path="/".join(full), stack_hint=_STACK_HINT
        )
        return None if found is None else (patterns.owner, *found)

    def _owner(self, full: tuple[str, ...]) -> tuple[int, AxesPatterns] | None:
        # The innermost declaring module whose patterns match the path, and its depth.
        for depth in range(len(full) - 1, -1, -1):
            patterns = self.owners.get(full[:depth])
            if patterns is not None and patterns.match("/".join(full[depth:])) is not None:
                return depth, patterns
        return None

    def unused(self) -> list[str]:
        """A note for every declared pattern that matched no parameter."""
        seen = {}
        for patterns in self.owners.values():
            seen.setdefault(patterns.owner, patterns)
        return [
            unused_pattern_note(
                owner,
                pattern,
                self.kept.get((owner, pattern), []),
                f"matched no parameter (parameters seen under it: {self._params_of(owner)}; "
                f"annotated by it: {self._annotated_by(owner)}).",
            )
            for owner, patterns in seen.items()
            for pattern in patterns.patterns
            if (owner, pattern) not in self.matched
        ]

    def _params_of(self, owner: str) -> str:
        roots = [path for path, pats in self.owners.items() if pats.owner == owner]
        return shown_paths(
            sorted(
                "params/" + "/".join(full)
                for full in self.seen
                if any(full[: len(root)] == root for root in roots)
            )
        )

    def _annotated_by(self, owner: str) -> str:
        return shown_paths(
            sorted("params/" + "/".join(f) for f, (by, _) in self.origins.items() if by == owner)
        )


def _rebuilt(
    tree: Mapping[str, Any], base: Path, change: Callable[[Path, Any], Any]
) -> dict[str, Any] | None:
    # A copy of the nested parameters with change applied to each leaf; None if none changed.
    # Subtrees without a change stay the same objects.
    new, changed = {}, False
    for name, value in tree.items():
        if isinstance(value, Mapping):
            sub = _rebuilt(value, (*base, name), change)
            new[name] = value if sub is None else sub
        else:
            new[name] = change((*base, name), value)
        changed = changed or new[name] is not value
    return new if changed else None


def _axes_given(axes: Any, full: Path) -> bool:
    # Whether the model names the parameter at ``full`` itself in ``params_axes`` (t5x style).
    for key in full[:-1]:
        axes = axes.get(key) if isinstance(axes, Mapping) else None
    return isinstance(axes, Mapping) and f"{full[-1]}_axes" in axes


def _refuse_axis_named_twice(module: nn.Module, path: tuple[str, ...]) -> None:
    # nn.with_partitioning(init, ("fsdp", "fsdp")) fails inside Flax, when the new parameter is
    # unboxed, with JAX's DuplicateSpecError, which names neither the parameter nor a fix. The
    # boxed parameter is stored by then: if one names a mesh axis twice, say which.
    for name, value in module.variables.get("params", {}).items():
        if not isinstance(value, nn.Partitioned) or isinstance(value, nn.LogicallyPartitioned):
            continue
        axes = [axis for entry in value.names for axis in mesh_axes_of(entry)]
        twice = sorted({axis for axis in axes if axes.count(axis) > 1})
        if twice:
            where = "params/" + "/".join((*path, name))
            raise EscaleError(
                f"parameter {where}: its nn.with_partitioning names {tuple(value.names)!r} name "
                f"mesh axis {twice[0]!r} more than once; each mesh axis may appear once in a "
                "parameter's names: pass it for one dimension and None (or another axis) for "
                "the others."
            ) from None


@contextlib.contextmanager
def annotating() -> Iterator[Annotator]:
    """Declares the names of decorated modules' parameters created inside; yields the annotator.

    The names are kept beside the parameters and put on them when the outermost module call
    inside returns. Re-entrant: inside an active one, yields that one. ``init_sharded`` enters
    it so that the plan can report where every annotation came from and which patterns matched
    nothing.
    """
    active = getattr(_state, "annotator", None)
    if active is not None:
        yield active
        return
    annotator = Annotator()
    _state.annotator = annotator
    try:
        with nn.intercept_methods(annotator):
            yield annotator
    finally:
        _state.annotator = None


def _annotating_method(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "annotator", None) is not None or not _initializing(self):
            return method(self, *args, **kwargs)
        with annotating():
            return method(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _finishing_init(method: Callable[..., Any]) -> Callable[..., Any]:
    # Module.init_with_output (which init and lazy_init call): the class's patterns own the
    # root however the model runs its calls, and the returned parameters get a last look.
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with annotating() as annotator:
            annotator.expect(type(self))
            out, variables = method(self, *args, **kwargs)
            if isinstance(variables, Mapping) and "params" in variables:
                params = annotator.finish(variables["params"], variables.get("params_axes", {}))
                variables = type(variables)({**variables, "params": params})
            return out, variables

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _given_plain(method: Callable[..., Any]) -> Callable[..., Any]:
    # Module.apply / Module.bind, whose variables may be what model.init returned: the boxes
    # the declaration put on are taken off, so the model reads what it reads undecorated (the
    # model's own boxes stay, as Flax hands them).
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if "variables" in kwargs:
            kwargs["variables"] = _without_declared(kwargs["variables"])
        elif args:
            args = (_without_declared(args[0]), *args[1:])
        return method(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _without_declared(variables: Any) -> Any:
    def declared(x: Any) -> bool:
        return isinstance(x, _Declared)

    return jax.tree.map(lambda x: x.value if declared(x) else x, variables, is_leaf=declared)


def _initializing(module: nn.Module) -> bool:
    return module.scope is not None and module.is_initializing()


def _install(cls: type[nn.Module], patterns: Mapping[str, Sequence[str | None]] | None) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise EscaleTypeError(
            f"flax_escale.sharded_module decorates flax.linen.Module classes, got {cls!r}."
        )
    record(cls, patterns, _PATTERNS)
    for name in dir(cls):
        method = getattr(cls, name, None)
        if getattr(method, "method_handler_wrapped", False) and not hasattr(method, _WRAPPED):
            setattr(cls, name, _annotating_method(method))
    for name, wrap in (
        ("apply", _given_plain),
        ("bind", _given_plain),
        ("init_with_output", _finishing_init),
    ):
        method = getattr(cls, name)
        if not hasattr(method, _WRAPPED):
            setattr(cls, name, wrap(method))


class ShardedMixin(DeclaringMixin):
    """Inherit it (before ``nn.Module``) to declare parameters' logical axes as a class attribute.

    ``patterns`` has the form :func:`~flax_escale.sharded_module` takes. Subclasses inherit the
    patterns of their parents and may add their own, which are tried first.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale.linen import ShardedMixin
        >>> class MLP(ShardedMixin, nn.Module):
        ...     patterns = {"wi/kernel": ("hidden_state", "mlp_intermediate"),
        ...                     "wo/kernel": ("mlp_intermediate", "hidden_state")}
        ...
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(4, name="wo")(nn.Dense(16, name="wi")(x))
        >>> params = MLP().init(jax.random.key(0), jnp.ones((2, 4)))["params"]
        >>> params["wi"]["kernel"].names
        ('hidden_state', 'mlp_intermediate')
    """

    install = staticmethod(_install)


def sharded_module(
    cls: M | Mapping[str, Sequence[str | None]] | None = None,
    /,
    patterns: Mapping[str, Sequence[str | None]] | None = None,
) -> Any:
    """:func:`flax_escale.sharded_module` for Linen modules, where the declaration is described.

    Linen specifics: the model's own code never sees the declaration: during ``model.init``
    every parameter it reads (``self.variables``, a child's variables, ``self.param``) is the
    plain array, as without the decorator. ``model.init`` returns the matched parameters boxed
    in ``nn.LogicallyPartitioned``, so everything that understands Flax's logical partitioning
    understands them; at any other time nothing runs, so the module works with no mesh. The
    boxes go on when the outermost decorated call returns: an undecorated module that calls a
    decorated one during ``model.init`` and then reads that one's variables sees them boxed
    (decorate the outer module too, with no patterns if it needs none), and a module that
    reads the variables of a child it ran through ``nn.remat`` or ``nn.jit`` sees them plain
    from its next module call on. ``apply`` and ``bind`` of a decorated class take what
    ``model.init`` returned and hand the model plain arrays too. Parameters Flax
    already annotates (``nn.with_logical_partitioning``, ``nn.with_partitioning``,
    ``param_with_axes``) keep their annotation. The class's patterns reach its parameters
    however its calls run (``setup`` or compact, a ``__call__`` under ``nn.jit`` or other
    decorators): ``model.init`` matches them once more against what it returns, and a pattern
    that matches nothing is reported by ``init_sharded`` and ``plan_sharding`` with the
    parameters seen (a warning, an error when ``strict``). Inside ``nn.scan`` or ``nn.vmap`` give
    ``metadata_params={nn.PARTITION_NAME: "layers"}``: the stacked axis is named ``layers``,
    unsharded by the default rules.

    Use it as ``@sharded_module({...})``, ``@sharded_module(patterns={...})``, or bare on a
    :class:`ShardedMixin`-style class that sets a ``patterns`` class attribute.

    Args:
        cls: The class (bare use), or the ``patterns`` mapping.
        patterns: ``{pattern: logical axes}``.

    Returns:
        The class itself, decorated (or a decorator when called with the mapping).

    Raises:
        EscaleTypeError: If the class is not a Linen module or the mapping is malformed.
        EscaleError: During ``model.init``, if a pattern's logical axes do not name every
            dimension of a parameter it matches, or ``nn.scan`` / ``nn.vmap`` stacks a matched
            parameter with no ``metadata_params`` naming the new axis.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import sharded_module
        >>> @sharded_module({"kernel": ("hidden_state", "vocab"), "bias": ("vocab",)})
        ... class Head(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(32)(x)
        >>> params = Head().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
        >>> params["Dense_0"]["kernel"].names, params["Dense_0"]["bias"].names
        (('hidden_state', 'vocab'), ('vocab',))
    """
    return declare(cls, patterns, install=_install, mixin=ShardedMixin, decorator=sharded_module)
