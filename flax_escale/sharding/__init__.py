"""Layer 4: applying shardings to arrays and trees."""

from flax_escale._moved import moved_names as _moved_names
from flax_escale.sharding._annotation import (
    Annotation,
    annotated_leaves,
    arrays_only,
    read_annotation,
)
from flax_escale.sharding._auto import spec_from_shape
from flax_escale.sharding._constraint import apply_spec, with_sharding_constraint
from flax_escale.sharding._context import use_sharding
from flax_escale.sharding._logical import constrain
from flax_escale.sharding._optimizer import init_opt_state, opt_state_shardings
from flax_escale.sharding._plan import IDLE_AXES_MIN_BYTES, PlanEntry, ShardingPlan, build_plan
from flax_escale.sharding._rules import PartitionRuleError, specs_from_regex
from flax_escale.sharding._transfer import make_shard_and_gather_fns, reshard_tree
from flax_escale.sharding._tree import logical_to_mesh_sharding

__all__ = [
    "IDLE_AXES_MIN_BYTES",
    "Annotation",
    "PartitionRuleError",
    "PlanEntry",
    "ShardingPlan",
    "annotated_leaves",
    "apply_spec",
    "arrays_only",
    "build_plan",
    "constrain",
    "init_opt_state",
    "logical_to_mesh_sharding",
    "make_shard_and_gather_fns",
    "opt_state_shardings",
    "read_annotation",
    "reshard_tree",
    "spec_from_shape",
    "specs_from_regex",
    "use_sharding",
    "with_sharding_constraint",
]

# eformer's names moved to flax_escale.eformer, and the two core functions that had eformer's
# names have their own; the old names work for one more release, with a DeprecationWarning.
__getattr__ = _moved_names(
    __name__,
    {
        "MeshPartitionHelper": "flax_escale.eformer.MeshPartitionHelper; its "
        "create_partition_spec takes candidate methods in priority order, and places or skips "
        "them instead of raising",
        "ShardingAnalysis": "flax_escale.eformer.ShardingAnalysis; or the figures of "
        "flax_escale.sharding_report",
        "analyze_sharding_strategy": "flax_escale.eformer.analyze_sharding_strategy; or "
        "flax_escale.sharding_report(tree, mesh, show=False)",
        "auto_partition_spec": "flax_escale.sharding.spec_from_shape; eformer's "
        "auto_partition_spec(x, mesh, names, min_sharding_size, reverse) is "
        "flax_escale.eformer.auto_partition_spec",
        "create_pattern_based_partition_spec": "flax_escale.eformer."
        "create_pattern_based_partition_spec",
        "extract_shardings": "flax_escale.eformer.extract_shardings",
        "get_names_from_partition_spec": "flax_escale.eformer.get_names_from_partition_spec",
        "get_partition_spec": "flax_escale.eformer.get_partition_spec",
        "match_partition_rules": "flax_escale.sharding.specs_from_regex; eformer's "
        "match_partition_rules, whose strict=False ignores min_size, is "
        "flax_escale.eformer.match_partition_rules",
    },
)
