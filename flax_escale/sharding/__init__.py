"""Layer 4: applying shardings to arrays and trees."""

from flax_escale.sharding.constraint import apply_spec, with_sharding_constraint
from flax_escale.sharding.context import use_sharding
from flax_escale.sharding.logical import constrain
from flax_escale.sharding.optimizer import init_opt_state, opt_state_shardings
from flax_escale.sharding.plan import Annotation, PlanEntry, ShardingPlan, build_plan

__all__ = [
    "Annotation",
    "PlanEntry",
    "ShardingPlan",
    "apply_spec",
    "build_plan",
    "constrain",
    "init_opt_state",
    "opt_state_shardings",
    "use_sharding",
    "with_sharding_constraint",
]
