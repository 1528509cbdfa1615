"""Layer 4: placing arrays by their shardings at run time.

Constraints inside a traced function (``constrain``, ``with_sharding_constraint``), the rules a
jitted step sees (``use_sharding``), moving trees between layouts (shard and gather functions,
``reshard_tree``), regex partition rules and shape-only specs. The static plan the shardings come
from is :mod:`flax_escale.plan`'s.
"""

from flax_escale.sharding._activation import constrain
from flax_escale.sharding._auto import spec_from_shape
from flax_escale.sharding._constraint import apply_spec, with_sharding_constraint
from flax_escale.sharding._regex_rules import PartitionRuleError, specs_from_regex
from flax_escale.sharding._shard_map import logical_shard_map
from flax_escale.sharding._transfer import make_shard_and_gather_fns, reshard_tree
from flax_escale.sharding._use_sharding import use_sharding

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
