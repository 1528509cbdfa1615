"""``sharded_module`` for Linen: logical names attached to parameters as they are created.

A decorated class declares ``{path pattern: logical axes}``. While a model initializes, a Flax
method interceptor looks at each module's parameters right after the module's method ran and
boxes every unannotated one that a pattern of an enclosing decorated module matches in
``nn.LogicallyPartitioned`` (innermost declaring module first). Boxing inside the method, not
afterwards, is what lets ``nn.scan`` add its stacked axis to the names. Values are untouched,
and outside initialization nothing runs at all.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import flax.linen as nn
from flax.core import meta

from flax_escale._frontend import (
    AxesPatterns,
    DeclaringMixin,
    declare,
    record,
    unused_pattern_note,
)
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


class Annotator:
    """Boxes parameters as modules create them; records what it did, for the sharding plan.

    Attributes:
        owners: Decorated modules seen, by path.
        sources: For each annotated parameter path, the class and pattern that annotated it.
        matched: ``(owner, pattern)`` pairs that annotated at least one parameter.
        kept: For each ``(owner, pattern)``, the parameters it matched that keep the
            annotation the model gives them.
    """

    def __init__(self) -> None:
        self.owners: dict[tuple[str, ...], AxesPatterns] = {}
        self.sources: dict[str, str] = {}
        self.matched: set[tuple[str, str]] = set()
        self.kept: dict[tuple[str, str], list[str]] = {}

    def __call__(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if module.scope is None or not module.is_initializing():
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        patterns = getattr(type(module), _PATTERNS, None)
        if patterns is not None:
            self.owners[path] = patterns
        try:
            out = next_fun(*args, **kwargs)
        except Exception:
            _refuse_axis_named_twice(module, path)
            raise
        self._annotate(module, path)
        return out

    def _annotate(self, module: nn.Module, path: tuple[str, ...]) -> None:
        variables = module.variables
        axes_metadata = variables.get("params_axes", {})
        for name, value in variables.get("params", {}).items():
            if isinstance(value, Mapping):
                continue
            full = (*path, name)
            if isinstance(value, meta.AxisMetadata) or f"{name}_axes" in axes_metadata:
                # Annotated by the model itself: it keeps that annotation (overrides= replaces
                # it), and a pattern that matches it is told so rather than "matched nothing".
                owned = self._owner(full)
                if owned is not None and (found := owned[1].match("/".join(full[owned[0] :]))):
                    where = "params/" + "/".join(full)
                    self.kept.setdefault((owned[1].owner, found[0]), []).append(where)
                continue
            found = self._lookup(full, value.shape)
            if found is None:
                continue
            owner, pattern, names = found
            module.put_variable("params", name, nn.LogicallyPartitioned(value, names))
            self.sources["params/" + "/".join(full)] = f"{owner}[{pattern!r}]"
            self.matched.add((owner, pattern))

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
                f"matched no parameter (its annotated parameters: {self._params_of(owner)}).",
            )
            for owner, patterns in seen.items()
            for pattern in patterns.patterns
            if (owner, pattern) not in self.matched
        ]

    def _params_of(self, owner: str) -> str:
        roots = ["/".join(p) for p, pats in self.owners.items() if pats.owner == owner]
        found = sorted(
            path for path in self.sources if any(path.startswith(f"params/{r}") for r in roots)
        )
        if not found:
            return "none annotated"
        shown = ", ".join(found[:4])
        return shown + (f", ... ({len(found)} in all)" if len(found) > 4 else "")


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
    """Annotates parameters of decorated modules created inside; yields the annotator.

    Re-entrant: inside an active one, yields that one. ``init_sharded`` enters it so that the
    plan can report where every annotation came from and which patterns matched nothing.
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


class ShardedMixin(DeclaringMixin):
    """Inherit it (before ``nn.Module``) to declare parameters' logical axes as a class attribute.

    ``patterns`` has the form :func:`sharded_module` takes. Subclasses inherit the patterns
    of their parents and may add their own, which are tried first.

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

    Linen specifics: during ``model.init`` matched parameters are boxed in
    ``nn.LogicallyPartitioned`` right after each module method returns, so everything that
    understands Flax's logical partitioning understands them; at any other time nothing runs,
    so the module works with no mesh. Parameters Flax already annotates
    (``nn.with_logical_partitioning``, ``nn.with_partitioning``, ``param_with_axes``) keep their
    annotation. Inside ``nn.scan`` give ``metadata_params={nn.PARTITION_NAME: "layers"}``: the
    stacked axis is named ``layers``, unsharded by the default rules.

    Use it as ``@sharded_module({...})``, ``@sharded_module(patterns={...})``, or bare on a
    :class:`ShardedMixin`-style class that sets a ``patterns`` class attribute.

    Args:
        cls: The class (bare use), or the ``patterns`` mapping.
        patterns: ``{pattern: logical axes}``.

    Returns:
        The class itself, decorated (or a decorator when called with the mapping).

    Raises:
        EscaleTypeError: If the class is not a Linen module or the mapping is malformed.

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
