"""The one reader of sharding annotations, whatever wrote them.

An array's annotation can come from many places: Linen boxes (``nn.with_logical_partitioning``
gives ``nn.LogicallyPartitioned`` with logical names and maybe its own rules;
``nn.with_partitioning`` gives ``nn.Partitioned`` with mesh axes), t5x's ``param_with_axes``
(names kept beside the parameters in the ``params_axes`` collection), NNX variable metadata
(this library's ``logical_axes``; Flax's ``out_sharding``, formerly ``sharding_names``, with the
variable's own ``sharding_rules``), and the library's ``sharded_module`` declarations (which
write one of those). Every consumer (both front ends' plans and inits, the partitioner, the
report, ``check_sharded``) reads them here, so the same annotation gives the same spec through
every entry point.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from flax.linen import partitioning

from flax_escale import _checks as check
from flax_escale._dataclasses import replace_checked
from flax_escale.axes import LogicalRules
from flax_escale.resolve import as_logical_rules

__all__ = [
    "AXES",
    "GRAPH",
    "LOGICAL",
    "LOGICAL_AXES",
    "MESH",
    "OTHER_BOX",
    "PLAIN",
    "VARIABLE",
    "Annotation",
    "kind_of",
    "kind_of_type",
    "read_annotation",
]

LOGICAL_AXES = "logical_axes"
"""The NNX variable-metadata key holding a variable's logical axes (set by ``sharded_module``)."""


@dataclasses.dataclass(frozen=True)
class Annotation:
    """How one array was annotated: logical names or mesh axes, and where that came from.

    Attributes:
        logical_axes: One logical name (or ``None``) per dimension, if annotated logically.
        mesh_axes: One spec entry per dimension, if annotated directly in mesh axes.
        source: Who annotated it, for reports (a ``sharded_module`` pattern, a Flax box, ...).
        rules: Rules the annotation carries itself, replacing the plan's (a Linen
            ``nn.LogicallyPartitioned`` with ``rules``).
        local_rules: Rules that go before the plan's (an NNX variable's ``sharding_rules``).
        names_may_be_mesh_axes: A logical name that no rule maps but that is a mesh axis stands
            for that axis (NNX ``out_sharding`` semantics, as in Flax).
        follows: For optimizer state: the path of the parameter it tracks and the parameter's
            dimensions it keeps; it takes the parameter's resolved spec on those dimensions.
    """

    logical_axes: tuple[Any, ...] | None = None
    mesh_axes: tuple[Any, ...] | None = None
    source: str = ""
    rules: LogicalRules | None = None
    local_rules: LogicalRules = ()
    names_may_be_mesh_axes: bool = False
    follows: tuple[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        # A string would read as one logical name per letter. A tuple of names and Nones (what
        # every reader makes, tens of thousands of times for a large model) is valid as it is.
        names = self.logical_axes
        if names is not None and (
            type(names) is not tuple or not all(type(n) is str or n is None for n in names)
        ):
            names = check.logical_names(names, "Annotation: logical_axes")
            object.__setattr__(self, "logical_axes", names)

    @property
    def axes(self) -> tuple[Any, ...]:
        """The per-dimension entries, logical or mesh, whichever the annotation has."""
        if self.logical_axes is not None:
            return self.logical_axes
        return self.mesh_axes or ()

    def rules_with(self, rules: LogicalRules, mesh_axis_names: tuple[str, ...]) -> LogicalRules:
        """The rules this annotation resolves with, given the plan's ``rules`` and mesh."""
        own = rules if self.rules is None else self.rules
        identity = tuple((a, a) for a in mesh_axis_names) if self.names_may_be_mesh_axes else ()
        return self.local_rules + own + identity

    def following(self, path: str, kept: tuple[int, ...]) -> Annotation:
        """The annotation of state that tracks this parameter (at ``path``), keeping ``kept``."""
        axes = tuple(self.axes[d] for d in kept)
        logical = self.logical_axes is not None
        # (its entries were checked when this annotation was)
        return replace_checked(
            self,
            logical_axes=axes if logical else None,
            mesh_axes=self.mesh_axes if logical else axes,
            source=f"{self.source} (follows {path})",
            follows=(path, kept),
        )


def read_annotation(leaf: Any, *, source: str | None = None) -> Annotation | None:
    """The annotation a leaf carries, or ``None``.

    Args:
        leaf: A Linen box (``nn.LogicallyPartitioned``, ``nn.Partitioned``), an NNX
            ``Variable`` (``logical_axes``, ``out_sharding`` / ``sharding_names`` and
            ``sharding_rules`` metadata) or anything else (no annotation).
        source: Names who made the annotation, for reports (a ``sharded_module`` pattern).

    Returns:
        The :class:`Annotation`, or ``None``.

    Example:
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> from flax_escale.plan import read_annotation
        >>> box = nn.LogicallyPartitioned(jnp.zeros((8, 4)), ("embed", "mlp"))
        >>> read_annotation(box).logical_axes
        ('embed', 'mlp')
        >>> read_annotation(nn.Partitioned(jnp.zeros((8, 4)), ("fsdp", None))).mesh_axes
        ('fsdp', None)
    """
    if source is not None:
        check.string(source, "read_annotation: source", "'sharded_module'")
    kind = kind_of(leaf)
    if kind == LOGICAL:
        rules = None if leaf.rules is None else as_logical_rules(leaf.rules)
        return Annotation(
            tuple(leaf.names), source=source or "nn.with_logical_partitioning", rules=rules
        )
    if kind == MESH:
        return Annotation(mesh_axes=tuple(leaf.names), source=source or "nn.with_partitioning")
    if kind == VARIABLE:
        return _variable_annotation(leaf.get_metadata(), source)
    return None


def _variable_annotation(metadata: Mapping[str, Any], source: str | None) -> Annotation | None:
    names = metadata.get(LOGICAL_AXES)
    if names is not None:
        return Annotation(tuple(names), source=source or "sharded_module")
    names = metadata.get("out_sharding") or metadata.get("sharding_names")
    if not names:
        return None
    local = metadata.get("sharding_rules")
    return Annotation(
        tuple(names),
        source=source or "nnx out_sharding",
        local_rules=as_logical_rules(local) if local else (),
        names_may_be_mesh_axes=True,
    )


# How a node of a tree is read, by its type (see kind_of).
PLAIN, LOGICAL, MESH, OTHER_BOX, VARIABLE, GRAPH, AXES = range(7)


@functools.lru_cache(maxsize=1024)
def kind_of_type(kind: type) -> int | None:
    """How a node of this type is read (``PLAIN``, ``LOGICAL``, ...); ``None``: ask the node.

    Kept per type: ``isinstance`` against Flax's classes goes through ABC and NNX metaclass
    hooks, too slow to ask for every node of a large tree.
    """
    if issubclass(kind, jax.core.Tracer):
        return None  # NNX counts some tracers as variables: it depends on the instance
    if issubclass(kind, nn.LogicallyPartitioned):
        return LOGICAL
    if issubclass(kind, nn.Partitioned):
        return MESH
    if issubclass(kind, meta.AxisMetadata):
        return OTHER_BOX
    if issubclass(kind, nnx.Variable):
        return VARIABLE
    if issubclass(kind, (nnx.Module, nnx.Optimizer)):
        return GRAPH
    return AXES if issubclass(kind, partitioning.AxisMetadata) else PLAIN


def kind_of(x: Any) -> int:
    """How the node ``x`` is read (see :func:`kind_of_type`)."""
    found = kind_of_type(type(x))
    if found is None:
        return VARIABLE if isinstance(x, nnx.Variable) else PLAIN
    return found
