"""Layer 2: the logical-axis vocabulary and rule sets."""

from flax_escale.axes._aliases import VOCABULARIES
from flax_escale.axes._partition_axis import LogicalRules, MeshAxes, PartitionAxis
from flax_escale.axes._t5x import AxisNames, standard_logical_axis_rules

__all__ = [
    "VOCABULARIES",
    "AxisNames",
    "LogicalRules",
    "MeshAxes",
    "PartitionAxis",
    "standard_logical_axis_rules",
]
