"""Layer 4: the static plan, every array's sharding worked out before anything exists.

One reader of annotations (Flax's boxes, ``param_with_axes``, NNX metadata, ``sharded_module``
declarations), one plan of the specs they resolve to (:class:`ShardingPlan`), optimizer state
following its parameter, and Flax's idiom ``logical_to_mesh_sharding`` on the same path.
Placing arrays by these shardings at run time is :mod:`flax_escale.sharding`'s.
"""

from flax_escale.plan._annotation import Annotation, read_annotation
from flax_escale.plan._build import build_plan
from flax_escale.plan._diff import ArrayChange, PlanDiff
from flax_escale.plan._entry import PlanEntry
from flax_escale.plan._leaves import AnnotatedLeaf, annotated_leaves, arrays_only
from flax_escale.plan._optimizer import init_opt_state, opt_state_shardings
from flax_escale.plan._plan import ShardingPlan, UnknownPathError
from flax_escale.plan._resolving import IDLE_AXES_MIN_BYTES, USE_IDLE_AXES
from flax_escale.plan._tree import logical_to_mesh_sharding

__all__ = [
    "IDLE_AXES_MIN_BYTES",
    "USE_IDLE_AXES",
    "AnnotatedLeaf",
    "Annotation",
    "ArrayChange",
    "PlanDiff",
    "PlanEntry",
    "ShardingPlan",
    "UnknownPathError",
    "annotated_leaves",
    "arrays_only",
    "build_plan",
    "init_opt_state",
    "logical_to_mesh_sharding",
    "opt_state_shardings",
    "read_annotation",
]
