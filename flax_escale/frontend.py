"""The top-level ``sharded_module`` and ``init_sharded``: one name, either Flax API."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
from jax.sharding import Mesh

from flax_escale import linen
from flax_escale.errors import EscaleTypeError

__all__ = ["init_sharded", "sharded_module"]


def sharded_module(
    cls: Any = None, /, logical_axes: Mapping[str, Sequence[str | None]] | None = None
) -> Any:
    """Declares parameters' logical axes on a Linen module class.

    Dispatches to :func:`flax_escale.linen.sharded_module`; see it for the declaration form.

    Raises:
        EscaleTypeError: If the class is not a Flax module class.

    Example:
        >>> @sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
        ... class Up(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(16)(x)
        >>> Up().init(jax.random.key(0), jnp.ones((1, 8)))["params"]["Dense_0"]["kernel"].names
        ('hidden_state', 'mlp_intermediate')
    """
    if cls is None or isinstance(cls, Mapping):
        declared = cls if logical_axes is None else logical_axes
        return lambda target: sharded_module(target, logical_axes=declared)
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        return linen.sharded_module(cls, logical_axes=logical_axes)
    raise EscaleTypeError(
        f"sharded_module decorates Flax module classes (flax.linen.Module), got {cls!r}."
    )


def init_sharded(model: Any, mesh: Mesh, rng: Any, *args: Any, **kwargs: Any) -> Any:
    """Initializes a model directly in its sharded layout.

    For a ``flax.linen.Module`` instance this is :func:`flax_escale.linen.init_sharded`.

    Raises:
        EscaleTypeError: If ``model`` is not a Flax model.
    """
    if isinstance(model, nn.Module):
        return linen.init_sharded(model, mesh, rng, *args, **kwargs)
    raise EscaleTypeError(f"init_sharded takes a flax.linen.Module instance, got {model!r}.")
