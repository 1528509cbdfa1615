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
    "relpos_buckets": None,
    "abspos_buckets": None,
    "mlp_activations": None,
    "unmodeled": None,
}
_MAXTEXT = {
    "activation_batch": "batch",
    "activation_batch_no_exp": "expert_batch",
    "activation_embed_and_logits_batch": "batch",
    "activation_kv_batch": "batch",
    "activation_length": "sequence",
    "activation_norm_length": "sequence",
    "activation_q_length": "query_sequence",
    "activation_kv_length": "key_sequence",
    "activation_embed": "hidden_state",
    "activation_mlp": "mlp_intermediate",
    "activation_heads": "head",
    "activation_kv_heads": "kv_head",
    "activation_kv": "attention_dim",
    "activation_kv_head_dim": "attention_kv_dim",
    "activation_vocab": "vocab",
    "activation_exp": "expert",
    # MaxText's mixture-of-experts names. Its "_no_exp" batch leaves the expert axis to the
    # experts, as expert_batch does; "_moe" names are those of the expert layer itself.
    "activation_batch_moe": "batch",
    "activation_kv_batch_no_exp": "expert_batch",
    "activation_length_no_exp": "sequence",
    "activation_length_moe": "sequence",
    "activation_norm_length_moe": "sequence",
    "activation_attn_length": "sequence",
    "activation_attn_length_no_exp": "sequence",
    "activation_q_length_no_exp": "query_sequence",
    "activation_embed_moe": "hidden_state",
    "activation_mlp_moe": "mlp_intermediate",
    "activation_prefill_kv_batch": "batch",
    "embed_moe": "hidden_state",
    "mlp_moe": "mlp_intermediate",
    "mlp_no_fsdp": "mlp_intermediate",
    "activation_stage": None,
    "embed": "hidden_state",
    "embed_no_exp": "hidden_state",
    "mlp": "mlp_intermediate",
    "heads": "head",
    "q_heads": "head",
    "kv_heads": "kv_head",
    "kv": "attention_dim",
    "kv_head_dim": "attention_kv_dim",
    "exp": "expert",
    "norm": None,
    "q_lora": None,
    "kv_lora": None,
    "cache_batch": "batch",
    "cache_heads": "kv_head",
    "cache_kv": "attention_kv_dim",
    "cache_sequence": "key_sequence",
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
