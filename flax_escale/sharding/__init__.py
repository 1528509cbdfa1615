"""Layer 4: applying shardings to arrays and trees."""

from flax_escale.sharding._annotation import (
    Annotation,
    annotated_leaves,
    arrays_only,
    read_annotation,
)
from flax_escale.sharding._auto import MeshPartitionHelper, auto_partition_spec
from flax_escale.sharding._constraint import apply_spec, with_sharding_constraint
from flax_escale.sharding._context import use_sharding
from flax_escale.sharding._inspect import (
    ShardingAnalysis,
    analyze_sharding_strategy,
    extract_shardings,
    get_names_from_partition_spec,
    get_partition_spec,
)
from flax_escale.sharding._logical import constrain
from flax_escale.sharding._optimizer import init_opt_state, opt_state_shardings
from flax_escale.sharding._plan import IDLE_AXES_MIN_BYTES, PlanEntry, ShardingPlan, build_plan
from flax_escale.sharding._rules import (
    PartitionRuleError,
    create_pattern_based_partition_spec,
    match_partition_rules,
)
from flax_escale.sharding._transfer import make_shard_and_gather_fns, reshard_tree
from flax_escale.sharding._tree import logical_to_mesh_sharding

__all__ = [
    "IDLE_AXES_MIN_BYTES",
    "Annotation",
    "MeshPartitionHelper",
    "PartitionRuleError",
    "PlanEntry",
    "ShardingAnalysis",
    "ShardingPlan",
    "analyze_sharding_strategy",
    "annotated_leaves",
    "apply_spec",
    "arrays_only",
    "auto_partition_spec",
    "build_plan",
    "constrain",
    "create_pattern_based_partition_spec",
    "extract_shardings",
    "get_names_from_partition_spec",
    "get_partition_spec",
    "init_opt_state",
    "logical_to_mesh_sharding",
    "make_shard_and_gather_fns",
    "match_partition_rules",
    "opt_state_shardings",
    "read_annotation",
    "reshard_tree",
    "use_sharding",
    "with_sharding_constraint",
]
