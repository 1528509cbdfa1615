"""The Flax Linen front end: declare logical axes on modules, initialize them sharded.

Example:
    >>> import flax.linen as nn
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from flax_escale import create_mesh, init_sharded, sharded_module
    >>> @sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    ... class Up(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         return nn.Dense(16, use_bias=False)(x)
    >>> mesh = create_mesh((1, 4, 1, 2, 1))
    >>> params = init_sharded(Up(), mesh, jax.random.key(0), jnp.ones((2, 8)))["params"]
    >>> params["Dense_0"]["kernel"].sharding.spec
    P(('fsdp', 'sp'), 'tp')
"""

from flax_escale._frontend._init_cache import clear_init_cache, init_cache_info
from flax_escale.linen._annotate import ShardedMixin
from flax_escale.linen._init import init_train_state
from flax_escale.linen._pipeline import pipelined
from flax_escale.linen._train import jit_train_step

__all__ = [
    "ShardedMixin",
    "clear_init_cache",
    "init_cache_info",
    "init_train_state",
    "jit_train_step",
    "pipelined",
]
