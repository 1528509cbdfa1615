"""Synthetic next-token data for the examples: tokens counting upwards modulo the vocabulary."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp


def batches(vocab: int, batch: int, seq: int, seed: int = 0) -> Iterator[jax.Array]:
    """Endless ``(batch, seq + 1)`` token arrays counting up from random starts."""
    key = jax.random.key(seed)
    while True:
        key, sub = jax.random.split(key)
        start = jax.random.randint(sub, (batch, 1), 0, vocab)
        yield (start + jnp.arange(seq + 1)) % vocab
