"""Layer 2: the logical-axis vocabulary and rule sets."""

from flax_escale._moved import moved_names as _moved_names
from flax_escale.axes._aliases import VOCABULARIES
from flax_escale.axes._partition_axis import LogicalRules, MeshAxes, PartitionAxis

__all__ = [
    "VOCABULARIES",
    "LogicalRules",
    "MeshAxes",
    "PartitionAxis",
]

# t5x's names moved to flax_escale.t5x; the old names work for one more release, with a
# DeprecationWarning.
__getattr__ = _moved_names(
    __name__,
    {
        "AxisNames": "flax_escale.t5x.AxisNames",
        "standard_logical_axis_rules": "flax_escale.t5x.standard_logical_axis_rules",
    },
)
