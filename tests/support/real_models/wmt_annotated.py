"""The wmt rewrite as a user shards it without editing it: a subclass that only declares.

Flax's wmt example carries no sharding annotation; the subclass below changes nothing of the
model's code and declares, by path pattern, the logical names of its parameters (t5x's
vocabulary, through ``PartitionAxis().with_aliases("t5x")``).
"""

import flax_escale as fe
from support.real_models.wmt_model import Transformer

__all__ = ["AnnotatedTransformer"]


class AnnotatedTransformer(Transformer):
    """The example's class, unchanged; the subclass only carries the declaration below."""


fe.sharded_module(
    {
        "shared_embedding/embedding": ("vocab", "embed"),
        "(query|key|value)/kernel": ("embed", "heads", "kv"),
        "out/kernel": ("heads", "kv", "embed"),
        "Dense_0/kernel": ("embed", "mlp"),
        "Dense_0/bias": ("mlp",),
        "Dense_1/kernel": ("mlp", "embed"),
        "Dense_1/bias": ("embed",),
        "(scale|bias)": ("embed",),  # every LayerNorm (the Dense biases matched above)
    }
)(AnnotatedTransformer)
