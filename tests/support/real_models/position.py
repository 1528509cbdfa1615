"""The sinusoidal position table that Flax's lm1b and wmt examples both add to their embeddings."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np


def sinusoidal_init(max_len: int = 2048, min_scale: float = 1.0, max_scale: float = 10000.0):
    """An initializer giving the fixed sine/cosine table of shape ``(1, max_len, features)``."""

    def init(key: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> jnp.ndarray:
        del key, dtype
        features = shape[-1]
        half = features // 2
        positions = np.arange(max_len, dtype=np.float64)[:, None]
        step = -np.log(max_scale / min_scale) / (half - 1)
        frequencies = min_scale * np.exp(np.arange(half) * step)
        table = np.zeros((max_len, features), np.float32)
        table[:, :half] = np.sin(positions * frequencies)
        table[:, half : 2 * half] = np.cos(positions * frequencies)
        return jnp.asarray(table[None])

    return init


class AddPositionEmbs(nn.Module):
    """Adds the sinusoidal table (or a learned ``pos_embedding`` when ``posemb_init`` is set).

    ``config`` is either example's ``TransformerConfig`` (``max_len``, ``posemb_init``).
    """

    config: Any

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, inputs_positions: jnp.ndarray | None = None):
        config = self.config
        assert inputs.ndim == 3, inputs.shape
        table_shape = (1, config.max_len, inputs.shape[-1])
        if config.posemb_init is None:
            table = sinusoidal_init(max_len=config.max_len)(None, table_shape)
        else:
            table = self.param("pos_embedding", config.posemb_init, table_shape)
        table = table[:, : inputs.shape[1], :]
        if inputs_positions is None:
            return inputs + table
        return inputs + jnp.take(table[0], inputs_positions, axis=0)
