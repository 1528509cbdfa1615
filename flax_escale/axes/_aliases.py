"""Foreign logical-axis vocabularies, as aliases of the library's names.

Models name their axes in the vocabulary of the codebase they come from: t5x's (which Flax's
own lm1b and wmt examples use), MaxText's, or their own. An alias maps such a name onto a
library name (``"embed"`` to ``"hidden_state"``) or onto ``None`` (a name that is known and
unsharded); :meth:`~flax_escale.PartitionAxis.with_aliases` then gives every alias the rules of
its library name, at the same priority.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["VOCABULARIES", "Aliases", "merge_aliases", "suggest_alias"]

Aliases = tuple[tuple[str, str | None], ...]
"""``(foreign name, library name or None)`` pairs, in the order they were given."""

# t5x's names: those of its standard rules (t5x/partitioning.py) and of its mixture-of-experts
# rules (t5x/contrib/moe/partitioning.py; expert_group is from its earlier releases). batch,
# vocab, layers and expert are the library's own names, with the same meaning.
_T5X = {
    "embed": "hidden_state",
    "mlp": "mlp_intermediate",
    "heads": "head",
    # Inside one head: t5x leaves it unsharded, as the library does with attention_dim.
    "kv": "attention_dim",
    # heads x head_dim flattened into one dimension: it splits like the heads.
    "joined_kv": "head",
    "length": "sequence",
    "stack": "layers",
    "expert_mlp": "mlp_intermediate",
    # The groups of dispatched tokens inside an expert layer: the batch that leaves ep alone.
    "expert_group": "expert_batch",
    # Each expert's share of those groups, which t5x splits over its data axis: the same batch.
    "expert_replicas": "expert_batch",
    "relpos_buckets": None,
    "abspos_buckets": None,
    "mlp_activations": None,
    "unmodeled": None,
}
# MaxText's names: every name of the logical_axis_rules of its base config (MaxText 0.2.4,
# configs/base.yml), in that file's order, then those of its code that no base rule names, then
# those of other releases' base configs. vocab and layers are the library's own names.
# MaxText's mesh axes read as the library's: data is dp; fsdp and fsdp_transpose are fsdp;
# context and its variants are sp; tensor, tensor_sequence and autoregressive are tp; expert is
# ep; stage (the pipeline) is what layers_axis names. A name MaxText leaves unsplit on purpose,
# and that has no library name of that meaning, maps to None.
_MAXTEXT = {
    # Circular pipelining: the groups of layers each stage runs in turn.
    "circular_repeats": None,
    # The vocabulary embedding and the logits.
    "activation_embed_and_logits_batch": "batch",
    # Batch and sequence flattened into one dimension (MaxText's vocabulary tiling); the batch
    # is its outer part, so it splits as the batch does.
    "activation_embed_and_logits_batch_sequence": "batch",
    "activation_vocab": "vocab",
    # The hidden dimension of the token embedding and of the logits kernel: beside vocab, which
    # holds tp, it falls back to (fsdp, sp) as MaxText puts it on fsdp.
    "embed_vocab": "hidden_state",
    # Attention.
    "activation_batch_attn": "batch",
    "activation_input_length_attn": "sequence",
    "activation_heads": "head",
    "activation_kv_heads": "kv_head",
    # The length of queries, keys and values alike inside attention.
    "activation_length_attn": "sequence",
    "activation_q_length": "query_sequence",
    # MaxText gathers the keys' length for its context parallelism; here it is the library's
    # key_sequence, whose axes PartitionAxis sets.
    "activation_kv_length": "key_sequence",
    "activation_embed_attn": "hidden_state",
    "activation_kv": "attention_dim",
    "activation_kv_batch": "batch",
    "activation_kv_head_dim": "attention_kv_dim",
    "heads": "head",
    "q_heads": "head",
    "kv_heads": "kv_head",
    # q, k and v stacked in one fused kernel: three entries, never split.
    "qkv": None,
    "kv": "attention_dim",
    "kv_head_dim": "attention_kv_dim",
    # Multi-head latent attention: the low-rank latent enters the up-projections as the hidden
    # size enters a dense layer (MaxText splits it over fsdp, as embed); the down-projections'
    # output dimension, which a norm then reads whole, stays unsplit.
    "q_lora": "hidden_state",
    "q_lora_up_proj": None,
    "kv_lora": "hidden_state",
    "kv_lora_up_proj": None,
    # Mixture of experts; the "_moe" names are those of the expert layer itself.
    "activation_batch_moe": "batch",
    "activation_length_moe": "sequence",
    "activation_norm_length_moe": "sequence",
    "activation_embed_moe": "hidden_state",
    "activation_mlp_moe": "mlp_intermediate",
    "activation_exp": "expert",
    "exp": "expert",
    "mlp_moe": "mlp_intermediate",
    "embed_moe": "hidden_state",
    # Dense layers and the model's structure.
    "activation_mlp": "mlp_intermediate",
    "activation_batch": "batch",
    "activation_length": "sequence",
    "activation_norm_length": "sequence",
    "activation_embed": "hidden_state",
    # The pipeline stages of activations share the mesh axis of the stacked layers.
    "activation_stage": "layers",
    "mlp": "mlp_intermediate",
    # Gated DeltaNet's projections: heads x head dim flattened, as t5x's joined_kv.
    "gdn_head": "head",
    "embed": "hidden_state",
    # Normalization scales: small vectors, replicated as the library's own are.
    "norm": None,
    # DiLoCo's independent model replicas, on a mesh axis of their own the library's meshes
    # do not have.
    "diloco": None,
    # The width of Engram's retrieved memory, projected back to the hidden size as an MLP's
    # inner width is.
    "engram_dim": "mlp_intermediate",
    # Scanned stacks of some of the layers: stacked layers, as layers (unsplit by default, as
    # MaxText leaves them).
    "dense_layers": "layers",
    "moe_layers": "layers",
    "local_layers": "layers",
    # The few parallel branches of hyper-connections' residual stream.
    "mhc": None,
    # Inference: prefill, decode and the key-value cache.
    "prefill_activation_length": "sequence",
    "prefill_activation_norm_length": "sequence",
    "activation_prefill_kv_batch": "batch",
    "decode_batch": "batch",
    # A decode step's one new token: nothing to split.
    "decode_length": None,
    "cache_heads": "kv_head",
    "paged_kv_heads": "kv_head",
    "cache_batch_prefill": "batch",
    "cache_batch": "batch",
    # Latent attention caches one latent per token where others cache heads: nothing to split.
    "cache_heads_none": None,
    "cache_kv": "attention_kv_dim",
    "cache_sequence": "key_sequence",
    # A paged cache's pages and their slots: the pool of memory, not the sequence of one request.
    "num_pages": None,
    "tokens_per_page": None,
    "paged_kv_head_dim_size": "attention_kv_dim",
    "mlp_no_fsdp": "mlp_intermediate",
    # The experts' dimension, which that rule puts on fsdp while MaxText gathers the experts'
    # kernels in two steps; the library's experts are on ep.
    "exp_with_fsdp": "expert",
    # MaxText's code names the scales of a quantized cache without a base rule: they follow
    # the cache.
    "cache_scale_batch": "batch",
    "cache_scale_sequence": "key_sequence",
    "cache_scale_heads": "kv_head",
    "cache_scale_kv": "attention_kv_dim",
    # The base configs of other releases (0.1.0, 0.2.0, 0.2.5) name these too. The "_no_exp"
    # batch leaves the expert axis to the experts, as expert_batch does.
    "activation_batch_no_exp": "expert_batch",
    "activation_length_no_exp": "sequence",
    "activation_q_length_no_exp": "query_sequence",
    "activation_kv_batch_no_exp": "expert_batch",
    "embed_no_exp": "hidden_state",
    # The hidden dimension of expert kernels while MaxText gathers them (its tp-like
    # tensor_transpose axis alone).
    "embed_tensor_transpose": "hidden_state",
    "activation_attn_length": "sequence",
    "activation_attn_length_no_exp": "sequence",
    "activation_attn_embed": "hidden_state",
    "embed_attn": "hidden_state",
    "embed_router": "hidden_state",
    "segment_ids_batch": "batch",
}

VOCABULARIES: Mapping[str, Mapping[str, str | None]] = MappingProxyType(
    {"t5x": MappingProxyType(_T5X), "maxtext": MappingProxyType(_MAXTEXT)}
)
"""The built-in foreign vocabularies by name: ``"t5x"`` (also Flax's lm1b and wmt examples)
and ``"maxtext"``; each maps foreign names to library names (``None``: unsharded)."""


def merge_aliases(
    current: Aliases,
    vocabularies: tuple[str | Mapping[str, str | None], ...],
    native: frozenset[str],
) -> Aliases:
    """``current`` extended with ``vocabularies``, in order; a later alias of a name wins.

    Raises:
        EscaleError: If a vocabulary name is unknown, or an alias targets a name the library
            does not have or redefines one of the library's own names.
        EscaleTypeError: If a vocabulary is neither a name nor a mapping of names.
    """
    merged = dict(current)
    for vocabulary in vocabularies:
        if isinstance(vocabulary, str):
            if vocabulary not in VOCABULARIES:
                raise EscaleError(
                    f"with_aliases: unknown vocabulary {vocabulary!r}; the built-in ones are "
                    f"{sorted(VOCABULARIES)}, or pass a mapping {{foreign name: library name}}."
                )
            vocabulary = VOCABULARIES[vocabulary]
        if not isinstance(vocabulary, Mapping):
            raise EscaleTypeError(
                "with_aliases takes vocabulary names such as 't5x' or mappings "
                f"{{foreign name: library name}}, got {vocabulary!r}."
            )
        for foreign, target in vocabulary.items():
            _check(foreign, target, native)
            if foreign != target:
                merged[foreign] = target
    return tuple(merged.items())


def _check(foreign: object, target: object, native: frozenset[str]) -> None:
    if not isinstance(foreign, str) or not foreign:
        raise EscaleTypeError(
            f"with_aliases: an alias must be a non-empty string, got {foreign!r} "
            f"(mapped to {target!r})."
        )
    if target is not None and not isinstance(target, str):
        raise EscaleTypeError(
            f"with_aliases: alias {foreign!r} must map to a library logical name or None, got "
            f"{target!r}."
        )
    if target is not None and target not in native:
        raise EscaleError(
            f"with_aliases: alias {foreign!r} maps to {target!r}, which is not a library logical "
            f"name; use one of {sorted(native)} (or None for an unsharded name)."
        )
    if foreign in native and foreign != target:
        raise EscaleError(
            f"with_aliases: {foreign!r} is one of the library's own logical names; aliasing it "
            f"to {target!r} would change what it means for every model. Set the "
            f"PartitionAxis field {foreign}_axis instead."
        )


def suggest_alias(name: str) -> str | None:
    """How to make an unknown logical name known, if a built-in vocabulary has it."""
    for vocabulary, aliases in VOCABULARIES.items():
        if name in aliases:
            target = aliases[name]
            meaning = "unsharded" if target is None else f"sharded like {target!r}"
            return (
                f"it is {vocabulary}'s name: rules=PartitionAxis().with_aliases({vocabulary!r}) "
                f"makes it {meaning}"
            )
    return None
