"""Layer 2: the logical-axis vocabulary and rule sets."""

from flax_escale.axes._aliases import VOCABULARIES
from flax_escale.axes._partition_axis import LogicalRules, MeshAxes, PartitionAxis

__all__ = [
    "VOCABULARIES",
    "LogicalRules",
    "MeshAxes",
    "PartitionAxis",
]
