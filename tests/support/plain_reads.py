"""What a model's own code reads of the parameters the library declares axes for.

:func:`plain` checks, while a model runs, that what it read is the plain array it reads without
the library; the Linen model here reads its parameters as GPT-2 does (its head tied to its
embedding by ``variables[...]["embedding"].T``, as transformers' ``FlaxGPT2LMHeadModule``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

import flax_escale as fe

IDS = (jnp.arange(2 * 8).reshape(2, 8) * 5) % 32
"""Token ids the tied-head models take: a batch of 2 sequences of 8, a vocabulary of 32."""


def plain(x):
    """``x``, checked to be what the model reads without the library: an array, not a box."""
    assert isinstance(x, jax.Array), f"the model read a {type(x).__name__}, not an array"
    return x


def spec_of(tree, path):
    """The partition spec of the array at ``path`` (``"params/a/b"``) in a tree of dicts."""
    for key in path.split("/"):
        tree = tree[key]
    return tree.sharding.spec


class Transformer(nn.Module):
    def setup(self):
        self.wte = nn.Embed(32, 16)
        self.h = nn.Dense(16)
        self.ln_f = nn.LayerNorm()

    def __call__(self, ids):
        return self.ln_f(nn.relu(self.h(self.wte(ids))))


class TiedLmHead(nn.Module):
    """A GPT-2-like head tied to the embedding, as a model from elsewhere: undecorated."""

    def setup(self):
        self.transformer = Transformer()

    def __call__(self, ids):
        hidden = self.transformer(ids)
        embedding = plain(self.transformer.variables["params"]["wte"]["embedding"])
        return hidden @ embedding.T


GPT_AXES = {
    "wte/embedding": ("vocab", "hidden_state"),
    "h/kernel": ("hidden_state", "mlp_intermediate"),
    "h/bias": ("mlp_intermediate",),
}


@fe.sharded_module(GPT_AXES)
class OurTiedLmHead(TiedLmHead):  # decorating a subclass, as for a model from elsewhere
    pass
