"""The top-level ``sharded_module`` and ``init_sharded``: one name, either Flax API."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
from flax import nnx
from jax.sharding import Mesh

from flax_escale import linen
from flax_escale import nnx as escale_nnx
from flax_escale.errors import EscaleTypeError

__all__ = ["init_sharded", "sharded_module"]


def sharded_module(
    cls: Any = None, /, logical_axes: Mapping[str, Sequence[str | None]] | None = None
) -> Any:
    """Declares parameters' logical axes on a Linen or NNX module class.

    Dispatches to :func:`flax_escale.linen.sharded_module` or
    :func:`flax_escale.nnx.sharded_module`, which share the declaration form.

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
    if isinstance(cls, type) and issubclass(cls, nnx.Module):
        return escale_nnx.sharded_module(cls, logical_axes=logical_axes)
    raise EscaleTypeError(
        "sharded_module decorates Flax module classes (flax.linen.Module or flax.nnx.Module), "
        f"got {cls!r}."
    )


def init_sharded(model: Any, mesh: Mesh, rng: Any, *args: Any, **kwargs: Any) -> Any:
    """Initializes a model directly in its sharded layout.

    A ``flax.linen.Module`` instance goes to :func:`flax_escale.linen.init_sharded` (and the
    variables are returned); an NNX module class or a callable taking ``rngs=`` goes to
    :func:`flax_escale.nnx.init_sharded` (and the module is returned).

    Raises:
        EscaleTypeError: If ``model`` is neither.
    """
    if isinstance(model, nn.Module):
        return linen.init_sharded(model, mesh, rng, *args, **kwargs)
    if callable(model) and not isinstance(model, nnx.Module):
        return escale_nnx.init_sharded(model, mesh, rng, *args, **kwargs)
    raise EscaleTypeError(
        "init_sharded takes a flax.linen.Module instance, or an NNX module class (or a callable "
        f"taking rngs=), got {model!r}."
    )
