"""The Flax NNX front end: declare logical axes on modules, build them sharded.

Example:
    >>> from flax import nnx
    >>> from flax_escale import create_mesh, init_sharded, sharded_module
    >>> @sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    ... class Up(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.wi = nnx.Linear(8, 16, use_bias=False, rngs=rngs)
    >>> mesh = create_mesh((1, 4, 1, 2, 1))
    >>> init_sharded(Up, mesh, 0).wi.kernel.get_value().sharding.spec
    P(('fsdp', 'sp'), 'tp')
"""

from flax_escale._frontend._init_cache import clear_init_cache, init_cache_info
from flax_escale.nnx._annotate import LOGICAL_AXES, ShardedMixin, stacked
from flax_escale.nnx._init import init_optimizer
from flax_escale.nnx._pipeline import pipeline_stack
from flax_escale.nnx._stack import stack_layers

__all__ = [
    "LOGICAL_AXES",
    "ShardedMixin",
    "clear_init_cache",
    "init_cache_info",
    "init_optimizer",
    "pipeline_stack",
    "stack_layers",
    "stacked",
]
