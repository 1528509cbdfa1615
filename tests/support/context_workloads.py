"""A tiny NNX decoder layer whose attention runs ``context_attention`` when built with a
strategy, as a planner's workload with ``context_parallel``: for the context-parallel
candidates' tests."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from flax_escale.context import context_attention
from flax_escale.sizing import Workload

VOCAB, DIM, HEADS, HEAD_DIM, BATCH, SEQ = 32, 16, 2, 8, 4, 64


class Decoder(nnx.Module):
    """Embedding, one causal attention and its output projection; ``strategy=None`` leaves the
    attention to XLA (``jax.nn.dot_product_attention``)."""

    def __init__(self, rngs: nnx.Rngs, strategy: str | None = None):
        into = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        out = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("mlp_intermediate", "hidden_state")
        )
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        width = 3 * HEADS * HEAD_DIM
        self.qkv = nnx.Linear(DIM, width, kernel_init=into, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(HEADS * HEAD_DIM, DIM, kernel_init=out, use_bias=False, rngs=rngs)
        self.strategy = strategy

    def __call__(self, tokens):
        x = self.embed(tokens)
        b, s, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3 * HEADS, HEAD_DIM), 3, axis=2)
        if self.strategy is None:
            attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            attended = context_attention(q, k, v, strategy=self.strategy)
        return x + self.out(attended.reshape(b, s, HEADS * HEAD_DIM))


TOKENS = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)


def workload(strategy: str | None = None) -> Workload:
    """The decoder's workload; with a strategy, its context-parallel form (which has none)."""
    return Workload(
        functools.partial(Decoder, strategy=strategy),
        0,
        tx=optax.sgd(0.1),
        batch=(TOKENS,),
        context_parallel=None if strategy else workload,
    )


def plain() -> Workload:
    """The decoder's workload without ``context_parallel``."""
    return dataclasses.replace(workload(), context_parallel=None)
