"""What the context-parallel model tests share (NNX and Linen): rotary embeddings by position,
plain softmax attention to compare with, the loss, and a batch of packed documents."""

import jax
import jax.numpy as jnp
import numpy as np

BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, DIM = 2, 32, 16, 8, 4, 4


def rotary(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotates pairs of features by each token's own position (so a reordered batch keeps it)."""
    half = x.shape[-1] // 2
    angles = positions[..., None] * 10_000.0 ** (-jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def plain_attention(q, k, v, positions, segment_ids):
    """Softmax attention over the whole sequence, masked by position and document."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = positions[:, None, :, None] >= positions[:, None, None, :]
    if segment_ids is not None:
        mask &= segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def heads_whole(y: jax.Array) -> jax.Array:
    """``y`` with its heads whole on an Explicit mesh, before the output projection sums them
    (JAX refuses a contraction over a split dimension there); on an Auto mesh, as it is."""
    if jax.sharding.AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types:
        return y
    spec = tuple(jax.typeof(y).sharding.spec)
    return jax.sharding.reshard(y, jax.sharding.PartitionSpec(*spec[:2]))


def mse(out, labels):
    return jnp.mean((out - labels) ** 2)


def batch(segments: bool):
    """Inputs, labels, each token's position in its document and (packed) document ids."""
    x, labels = jax.random.normal(jax.random.key(1), (2, BATCH, SEQ, HIDDEN))
    if not segments:
        return x, labels, jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ)), None
    starts = np.zeros((BATCH, SEQ), np.int32)
    starts[0, [0, 5, 20]] = starts[1, [0, 11]] = 1
    segment_ids = np.cumsum(starts, axis=1)
    first = np.maximum.accumulate(np.where(starts == 1, np.arange(SEQ), 0), axis=1)
    return x, labels, jnp.asarray(np.arange(SEQ) - first), jnp.asarray(segment_ids)
