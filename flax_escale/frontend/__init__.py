"""Deprecated: the front ends' machinery is private (``flax_escale._frontend``).

What a user reaches for is at the top level (``sharded_module``, ``init_sharded``,
``plan_sharding``, ``lower_init``) and in ``flax_escale.linen`` / ``flax_escale.nnx``. The
names this package exported still work for one release, with a ``DeprecationWarning``.
"""

from flax_escale import _frontend as _private
from flax_escale._moved import moved_names as _moved_names

__all__: list[str] = []

__getattr__ = _moved_names(
    __name__,
    {
        name: f"flax_escale._frontend.{name}; the front ends' machinery is private now"
        for name in _private.__all__
    },
)
