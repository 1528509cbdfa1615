"""The boxes ``sharded_module`` puts on Linen parameters, and the annotator active on a thread.

:class:`Declared` is what ``model.init`` returns on a declared parameter; :class:`Carried` is a
declared parameter leaving a Flax lifted transform. The names a box records go to the annotator
of the initialization under way (:func:`active`), which only the annotator module sets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import struct
from flax.core import meta

from flax_escale.errors import EscaleError

__all__ = ["Carried", "Declared", "Names", "Path", "active", "rebuilt", "remember", "set_active"]

Path = tuple[str, ...]
Names = tuple[str | None, ...]

_state = threading.local()


def active() -> Any:
    """The ``Annotator`` of the initialization under way on this thread, or ``None``."""
    return getattr(_state, "annotator", None)


def set_active(annotator: Any) -> None:
    """Makes ``annotator`` this thread's active one (``None``: none)."""
    _state.annotator = annotator


class Declared(nn.LogicallyPartitioned):
    """Flax's logical box, on the parameters ``sharded_module`` declared names for.

    What ``model.init`` returns; told apart from the model's own boxes so that ``apply`` and
    ``bind`` of a decorated class, and a later initialization, hand the model the plain array.
    ``source`` is the declaring class and pattern, static, so that it survives a Flax
    ``nn.jit`` whose kept trace replays the box without running the model's code again.
    """

    source: tuple[str, str] | None = struct.field(pytree_node=False, default=None)


class Carried(struct.PyTreeNode, meta.AxisMetadata[Any]):
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

    def replace_boxed(self, val: Any) -> Carried:
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
        remember(self.path, tuple(names))
        return self.value

    def remove_axis(self, index: int, params: dict[Any, Any]) -> Any:
        """Records the names without the axis a transform takes away; returns the array."""
        del params
        remember(self.path, self.names[:index] + self.names[index + 1 :])
        return self.value


def remember(path: Path, names: Names) -> None:
    """Records a parameter's names, by rank, with the active annotator (if any)."""
    annotator = active()
    if annotator is not None:
        annotator.known[(path, len(names))] = names


def rebuilt(
    tree: Mapping[str, Any], base: Path, change: Callable[[Path, Any], Any]
) -> dict[str, Any] | None:
    """The nested parameters with ``change`` applied to each leaf; ``None`` if none changed.

    Subtrees without a change stay the same objects.
    """
    new, changed = {}, False
    for name, value in tree.items():
        if isinstance(value, Mapping):
            sub = rebuilt(value, (*base, name), change)
            new[name] = value if sub is None else sub
        else:
            new[name] = change((*base, name), value)
        changed = changed or new[name] is not value
    return new if changed else None


def without_declared(variables: Any) -> Any:
    """``variables`` with every :class:`Declared` box replaced by its array."""

    def declared(x: Any) -> bool:
        return isinstance(x, Declared)

    return jax.tree.map(lambda x: x.value if declared(x) else x, variables, is_leaf=declared)
