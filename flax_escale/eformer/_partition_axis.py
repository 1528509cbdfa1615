"""eformer's ``PartitionAxis``: the library's, with eformer's defaults for decoding.

The library's :class:`~flax_escale.PartitionAxis` keeps the batch unsharded while decoding
(``generation_batch_axis=None``) and gives the decode heads and key sequence the mesh axes'
own defaults. eformer derives those decode fields (batch, heads, key/value heads, key
sequence) from their training fields instead, so that a decode step is laid out like a
training step unless told otherwise; its decode query sequence and attention dimensions
default to ``None``, as the library's do. This class is the library's with only those defaults
changed; everything that takes a ``PartitionAxis`` takes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from flax_escale import axes
from flax_escale._specs import MeshAxes
from flax_escale.axes._partition_axis import _decode_aliases

__all__ = ["PartitionAxis"]

# The decode fields that take their training field's value when not given (as in eformer);
# generation_kv_head_axis already does so in the library.
_FOLLOW = {
    "generation_batch_axis": "batch_axis",
    "generation_head_axis": "head_axis",
    "generation_key_sequence_axis": "key_sequence_axis",
}


@jax.tree_util.register_static
@_decode_aliases
@dataclasses.dataclass(frozen=True)
class PartitionAxis(axes.PartitionAxis):
    """The library's :class:`~flax_escale.PartitionAxis` with eformer's decode defaults.

    Every ``decode_*`` field left unset takes its training field's value: ``decode_batch_axis``
    is ``batch_axis``'s (``('fsdp', 'dp')`` by default), ``decode_head_axis``,
    ``decode_kv_head_axis`` and ``decode_key_sequence_axis`` those of ``head_axis``,
    ``kv_head_axis`` and ``key_sequence_axis``; ``decode_query_sequence_axis``,
    ``decode_attention_dim_axis`` and ``decode_attention_kv_dim_axis`` default to ``None``
    (unsharded while decoding) whatever their training fields are, as eformer's do. The
    ``decode_*`` names are eformer's for the library's ``generation_*`` fields; both are
    accepted as keywords and read as attributes.

    An instance is a :class:`~flax_escale.PartitionAxis`, so the library's functions, Flax's
    rules (:meth:`~flax_escale.PartitionAxis.logical_axis_rules`) and :class:`PartitionManager`
    take it. It differs from eformer's in one way: :meth:`~flax_escale.PartitionAxis.replace`
    derives the fields never given from the new values (``replace(batch_axis='dp')`` moves
    ``decode_batch_axis`` too), where eformer's keeps the values derived when the first one was
    built.

    Example:
        >>> from flax_escale import eformer as escale
        >>> paxis = escale.PartitionAxis()
        >>> paxis.decode_batch_axis, paxis.decode_head_axis
        (('fsdp', 'dp'), 'tp')
        >>> escale.PartitionAxis(batch_axis="dp", head_axis="sp").decode_batch_axis
        'dp'
        >>> decode = escale.PartitionAxis(decode_batch_axis=None).logical_axes(generation=True)
        >>> decode["batch"] is None
        True
    """

    generation_batch_axis: Any = ...
    generation_head_axis: Any = ...
    generation_key_sequence_axis: Any = ...

    def _derived_defaults(self) -> dict[str, MeshAxes]:
        # Called before the fields are resolved: a training field still unset is the `...`
        # placeholder, and its own default is then the decode field's too.
        defaults = super()._derived_defaults()
        for decode, training in _FOLLOW.items():
            given = getattr(self, training)
            defaults[decode] = defaults[training] if given is ... else given
        return defaults
