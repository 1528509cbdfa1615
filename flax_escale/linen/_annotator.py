"""The annotator: records declared names as Linen modules create parameters, boxes them later.

It is a Flax method interceptor, active during one initialization (:func:`annotating`). It
looks at each module's parameters right after the module's method ran and records, for every
unannotated one that a pattern of an enclosing decorated module matches (innermost declaring
module first), its logical names on the side; it puts them on (a :class:`Declared` box) only
where no model code looks any more, and reports the patterns that matched nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import numpy as np
from flax.core import meta
from flax.core.scope import Scope

from flax_escale._frontend import AxesPatterns, unused_pattern_note
from flax_escale._frontend._patterns import shown_paths
from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError
from flax_escale.linen._boxes import (
    Carried,
    Declared,
    Names,
    Path,
    active,
    rebuilt,
    set_active,
)

__all__ = ["PATTERNS", "Annotator", "annotating"]

PATTERNS = "__escale_patterns__"
"""The class attribute holding a decorated class's compiled patterns."""

STACK_HINT = (
    "inside nn.scan, name the per-layer dimensions: the stacked one is added by "
    "metadata_params={nn.PARTITION_NAME: 'layers'}"
)


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
        # Where Carried boxes land once a lifted transform returns: the scope tree that
        # called it and the path of the transformed module.
        self._landing: list[tuple[Scope, Path]] = []

    def __call__(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if module.scope is None or not module.is_initializing():
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        patterns = getattr(type(module), PATTERNS, None)
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
            if isinstance(value, (Mapping, Carried, Declared)):
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
        patterns = getattr(cls, PATTERNS, None)
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
        new = rebuilt(params, (), functools.partial(self._finished, axes))
        if new is None:
            return params
        return new if isinstance(params, dict) else type(params)(new)

    def _finished(self, axes: Any, full: Path, value: Any) -> Any:
        self.seen[full] = None
        if isinstance(value, (Carried, Declared)):
            names = tuple(value.names)
            self.known[(full, len(names))] = names
            self._credit(full, value.source)
            if isinstance(value, Declared):
                return value
            return Declared(value.value, names, source=value.source)
        if isinstance(value, meta.AxisMetadata) or _axes_given(axes, full):
            self._keep(full)
            return value
        names = self._declared_names(full, value)
        if names is None:
            return value
        return Declared(value, names, source=self.origins.get(full))

    def _boxed(self, carried: bool, full: Path, value: Any) -> Any:
        # Where no model code looks any more: the declared names on the parameter.
        if isinstance(value, (Carried, Declared)):
            names, array = tuple(value.names), value.value
        elif isinstance(value, meta.AxisMetadata):
            return value
        else:
            names, array = self.known.get((full, np.ndim(value))), value
            if names is None:
                return value
        source = self.origins.get(full)
        if carried:
            return Carried(array, names, full, source)
        return value if isinstance(value, Declared) else Declared(array, names, source=source)

    def _unboxed(self, full: Path, value: Any) -> Any:
        # Before model code runs again: the plain array of a box the library put on.
        if not isinstance(value, (Carried, Declared)):
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
        new = rebuilt(tree, (*scope.path, *under), change)
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
            "/".join(full[depth:]), shape, shown_path="/".join(full), stack_hint=STACK_HINT
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
    running = active()
    if running is not None:
        yield running
        return
    annotator = Annotator()
    set_active(annotator)
    try:
        with nn.intercept_methods(annotator):
            yield annotator
    finally:
        set_active(None)
