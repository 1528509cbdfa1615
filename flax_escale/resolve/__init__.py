"""Layer 3: logical axes (+ shape and mesh) to ``PartitionSpec``."""

from flax_escale.resolve._complete import Completion, complete_spec
from flax_escale.resolve._fit import Correction, fit_spec
from flax_escale.resolve._logical import (
    LogicalAxes,
    logical_to_mesh_axes,
    resolve_logical_axes,
)
from flax_escale.resolve._mesh_axes import fit_mesh_axes
from flax_escale.resolve._resolution import PassedOver, Resolution, enforce
from flax_escale.resolve._rules import RulesLike, as_logical_rules

__all__ = [
    "Completion",
    "Correction",
    "LogicalAxes",
    "PassedOver",
    "Resolution",
    "RulesLike",
    "as_logical_rules",
    "complete_spec",
    "enforce",
    "fit_mesh_axes",
    "fit_spec",
    "logical_to_mesh_axes",
    "resolve_logical_axes",
]
