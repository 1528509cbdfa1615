"""Layer 4: placing arrays by their shardings at run time.

Constraints inside a traced function (``constrain``, ``with_sharding_constraint``), the rules a
jitted step sees (``use_sharding``), moving trees between layouts (shard and gather functions,
``reshard_tree``), regex partition rules and shape-only specs. The static plan the shardings come
from is :mod:`flax_escale.plan`'s.
"""

from flax_escale._moved import moved_names as _moved_names
from flax_escale.sharding._auto import spec_from_shape
from flax_escale.sharding._constraint import apply_spec, with_sharding_constraint
from flax_escale.sharding._context import use_sharding
from flax_escale.sharding._logical import constrain
from flax_escale.sharding._rules import PartitionRuleError, specs_from_regex
from flax_escale.sharding._shard_map import logical_shard_map
from flax_escale.sharding._transfer import make_shard_and_gather_fns, reshard_tree

__all__ = [
    "PartitionRuleError",
    "apply_spec",
    "constrain",
    "logical_shard_map",
    "make_shard_and_gather_fns",
    "reshard_tree",
    "spec_from_shape",
    "specs_from_regex",
    "use_sharding",
    "with_sharding_constraint",
]

# The static plan moved to flax_escale.plan and eformer's names to flax_escale.eformer, and the
# two core functions that had eformer's names have their own; the old names work for one more
# release, with a DeprecationWarning.
__getattr__ = _moved_names(
    __name__,
    {
        "IDLE_AXES_MIN_BYTES": "flax_escale.plan.IDLE_AXES_MIN_BYTES",
        "Annotation": "flax_escale.plan.Annotation",
        "PlanEntry": "flax_escale.plan.PlanEntry",
        "ShardingPlan": "flax_escale.plan.ShardingPlan",
        "annotated_leaves": "flax_escale.plan.annotated_leaves",
        "arrays_only": "flax_escale.plan.arrays_only",
        "build_plan": "flax_escale.plan.build_plan",
        "init_opt_state": "flax_escale.plan.init_opt_state",
        "logical_to_mesh_sharding": "flax_escale.plan.logical_to_mesh_sharding",
        "opt_state_shardings": "flax_escale.plan.opt_state_shardings",
        "read_annotation": "flax_escale.plan.read_annotation",
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
