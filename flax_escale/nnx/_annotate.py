"""``sharded_module`` for NNX: logical names attached to a module's variables as it is built.

After a decorated class's ``__init__`` runs, every variable of the module (its own and those of
Flax layers it holds) that no inner decorated module annotated, and that Flax's own
``out_sharding`` metadata does not annotate, is matched against the class's patterns; a match
sets the variable's ``logical_axes`` metadata. Nothing else changes: the values the model's own
code reads (``self.wte.embedding[...]``, in ``__init__`` or ``__call__``) are the arrays it
reads undecorated, and no ``out_sharding`` is set, so Flax's eager sharding never runs on these
names and the module builds and runs with no mesh whatever Flax's eager-sharding setting is.
``init_sharded`` resolves the names and then writes the resolved mesh specs into
``out_sharding``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from flax import nnx

from flax_escale import _checks as check
from flax_escale._frontend import (
    AxesPatterns,
    DeclaringMixin,
    declare,
    record,
    unused_pattern_note,
)
from flax_escale._frontend._patterns import shown_paths
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._annotation import LOGICAL_AXES

__all__ = ["LOGICAL_AXES", "ShardedMixin", "collecting_unused", "sharded_module", "stacked"]


_PATTERNS = "__escale_patterns__"
_WRAPPED = "__escale_wrapped__"
_STACK_HINT = (
    "inside nnx.vmap or nnx.scan, name the per-layer dimensions and pass "
    "transform_metadata=flax_escale.nnx.stacked('layers') so the stacked one is added"
)
_state = threading.local()


def stacked(name: str = "layers") -> dict[str, str]:
    """``transform_metadata`` for ``nnx.vmap`` / ``nnx.scan`` layer stacks.

    Names the stacked axis ``name`` both in Flax's ``out_sharding`` and in the ``logical_axes``
    metadata this library attaches, so the stacked variables keep a logical name per dimension.
    ``layers`` is unsharded by the default rules.

    Example:
        >>> from flax_escale.nnx import stacked
        >>> stacked()
        {'partition_name': 'layers', 'logical_axes': 'layers'}

    Raises:
        EscaleTypeError: If ``name`` is not a string.
        EscaleError: If it is empty.
    """
    if not check.string(name, "stacked: name", "'layers'"):
        raise EscaleError(
            "stacked: name must be a non-empty logical axis name, got ''; pass e.g. 'layers'."
        )
    return {nnx.PARTITION_NAME: name, LOGICAL_AXES: name}


@contextlib.contextmanager
def collecting_unused() -> Iterator[list[str]]:
    """Collects a note for every pattern that matched no variable of its module, while inside."""
    notes: list[str] = []
    previous = getattr(_state, "notes", None)
    _state.notes = notes
    try:
        yield notes
    finally:
        _state.notes = previous


def _annotate(module: nnx.Module) -> None:
    patterns: AxesPatterns = getattr(type(module), _PATTERNS)
    matched = set()
    kept: dict[str, list[str]] = {}
    seen: list[str] = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Variable):
            continue
        key = "/".join(str(k) for k in path)
        seen.append(key)
        metadata = node.get_metadata()
        if metadata.get(LOGICAL_AXES) is not None:
            # An inner decorated module annotated it: the pattern agrees with a declaration.
            if (found := patterns.match(key)) is not None:
                matched.add(found[0])
            continue
        if metadata.get("out_sharding"):
            # The model's own annotation, which it keeps (overrides= replaces it).
            if (found := patterns.match(key)) is not None:
                kept.setdefault(found[0], []).append(key)
            continue
        found = patterns.match_array(
            key, getattr(node, "shape", ()), shown_path=key, stack_hint=_STACK_HINT
        )
        if found is not None:
            matched.add(found[0])
            node.set_metadata(LOGICAL_AXES, found[1])
    notes = getattr(_state, "notes", None)
    if notes is not None:
        notes.extend(
            unused_pattern_note(
                patterns.owner,
                pattern,
                kept.get(pattern, []),
                f"matched no variable (variables seen under it: {shown_paths(seen)}).",
            )
            for pattern in patterns.patterns
            if pattern not in matched
        )


def _annotating_init(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def wrapper(self: nnx.Module, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Only the most derived class's __init__ annotates: a parent's, run through super(),
        # returns before the subclass has made its own variables.
        if type(self).__init__ is wrapper:
            _annotate(self)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _install(cls: type, patterns: Mapping[str, Sequence[str | None]] | None) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise EscaleTypeError(
            f"flax_escale.sharded_module decorates flax.nnx.Module classes, got {cls!r}."
        )
    record(cls, patterns, _PATTERNS)
    if not hasattr(cls.__init__, _WRAPPED):
        cls.__init__ = _annotating_init(cls.__init__)  # type: ignore[method-assign]


class ShardedMixin(DeclaringMixin):
    """Inherit it (before ``nnx.Module``) to declare variables' logical axes as a class attribute.

    ``patterns`` has the form :func:`~flax_escale.sharded_module` takes; subclasses add patterns
    that are tried before their parents'.

    Example:
        >>> from flax import nnx
        >>> from flax_escale.nnx import ShardedMixin
        >>> class Mlp(ShardedMixin, nnx.Module):
        ...     patterns = {"wi/kernel": ("hidden_state", "mlp_intermediate")}
        ...
        ...     def __init__(self, rngs):
        ...         self.wi = nnx.Linear(4, 16, rngs=rngs)
        >>> Mlp(nnx.Rngs(0)).wi.kernel.get_metadata("logical_axes")
        ('hidden_state', 'mlp_intermediate')
    """

    install = staticmethod(_install)


def sharded_module(
    cls: Any = None,
    /,
    patterns: Mapping[str, Sequence[str | None]] | None = None,
) -> Any:
    """:func:`flax_escale.sharded_module` for NNX modules, where the declaration is described.

    NNX specifics: paths are attribute names and list indices joined by ``/`` (as
    ``blocks/0/kernel``); a match sets the variable's ``logical_axes`` metadata once the
    most-derived ``__init__`` has run; variables already carrying Flax's ``out_sharding``
    (``nnx.with_partitioning``) keep it. For layer stacks built with ``nnx.vmap`` /
    ``nnx.scan``, pass ``transform_metadata=stacked()``.

    Args:
        cls: The class (bare use, with a ``patterns`` class attribute), or the mapping.
        patterns: ``{pattern: logical axes}``.

    Returns:
        The class itself, decorated (or a decorator when called with the mapping).

    Raises:
        EscaleTypeError: If the class is not an NNX module or the mapping is malformed.

    Example:
        >>> from flax import nnx
        >>> from flax_escale import sharded_module
        >>> @sharded_module({"kernel": ("hidden_state", "vocab"), "bias": ("vocab",)})
        ... class Head(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.out = nnx.Linear(8, 32, rngs=rngs)
        >>> Head(nnx.Rngs(0)).out.kernel.get_metadata("logical_axes")
        ('hidden_state', 'vocab')
    """
    return declare(cls, patterns, install=_install, mixin=ShardedMixin, decorator=sharded_module)
