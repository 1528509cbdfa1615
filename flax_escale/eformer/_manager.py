"""eformer's ``PartitionManager``: activation sharding by logical names, over ``constrain``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale.axes import LogicalRules, PartitionAxis
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.resolve import logical_to_mesh_axes
from flax_escale.sharding import constrain

__all__ = ["PartitionManager"]

# eformer's runtime modes (its plain names and its constants' values): True for the decode
# ones, which use the PartitionAxis generation_* (decode_*) fields.
_MODES = {
    "train": False,
    "prefill": False,
    "decode": True,
    "insert": True,
    "__train__": False,
    "__prefill__": False,
    "__autoregressive__": True,
    "__insert__": True,
}
# The values of eformer's semantic axis constants (eformer.common_types), as logical names.
_EFORMER_NAMES = {
    "__BATCH__": "batch",
    "__LENGTH__": "sequence",
    "__QUERY_LENGTH__": "query_sequence",
    "__KV_LENGTH__": "key_sequence",
    "__EMBED__": "hidden_state",
    "__HEAD__": "head",
    "__KV_HEAD__": "kv_head",
    "__MLP_INTERMEDIATE__": "mlp_intermediate",
    "__VOCAB__": "vocab",
    "__EXPERT__": "expert",
    "__EXPERT_GATE__": "expert_gate",
    "__HEAD_DIM__": "attention_dim",
    "__KV_HEAD_DIM__": "attention_kv_dim",
    "__BIAS_HEAD_SEQ__": "bias_head_sequence",
    "__BIAS_KV_SEQ__": "bias_key_sequence",
    "_": None,
}


@dataclasses.dataclass(frozen=True)
class PartitionManager:
    """Shards activations by logical axis names with one :class:`~flax_escale.PartitionAxis`.

    ``shard`` is :func:`flax_escale.constrain` with the partition axis's rules, so activations
    resolve exactly as parameters do (shape-aware; what cannot apply is dropped with a
    :class:`~flax_escale.ShardingCorrectionWarning`, or raises with ``auto_correct=False``).
    Axis names are the library's logical names (``"batch"``, ``"sequence"``,
    ``"hidden_state"``, ...), the values of eformer's constants (``"__BATCH__"``, ...), or
    ``None`` / ``"_"`` for an unsharded dimension. ``mode`` is ``"train"`` (also ``"prefill"``)
    or ``"decode"`` (also ``"insert"``), eformer's mode constants' values, or a dimension index:
    decode when that dimension has size 1, as in eformer. Decode uses the ``generation_*``
    (``decode_*``) fields.

    Attributes:
        paxis: The partition axis.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import eformer as escale
        >>> manager = escale.PartitionManager(escale.PartitionAxis())
        >>> manager.resolve(["batch", "sequence", "hidden_state"])
        P(('fsdp', 'dp'), 'sp', 'tp')
        >>> manager.resolve(["batch", "query_sequence", "hidden_state"], mode="decode")
        P(('fsdp', 'dp'), None, 'tp')
        >>> mesh = escale.create_mesh((1, 4, 1, 2, 1))
        >>> with jax.set_mesh(mesh):
        ...     y = jax.jit(lambda x: manager.shard(x, ["batch", None, "hidden_state"]))(
        ...         jnp.ones((8, 3, 16)))
        >>> y.addressable_shards[0].data.shape
        (2, 3, 8)
    """

    paxis: PartitionAxis

    def __post_init__(self) -> None:
        if not isinstance(self.paxis, PartitionAxis):
            check.instance(self.paxis, PartitionAxis, "paxis", "PartitionAxis()")

    def resolve(
        self,
        axes: Sequence[str | None],
        mode: str | int = "train",
        *,
        shape: Sequence[int] | None = None,
        mesh: Mesh | AbstractMesh | None = None,
    ) -> PartitionSpec:
        """The ``PartitionSpec`` of logical ``axes`` (shape-aware when ``shape`` is given).

        Args:
            axes: One logical name (or ``None``) per dimension.
            mode: The runtime mode, or a dimension index of ``shape`` (see the class).
            shape: The array shape.
            mesh: The mesh; defaults to the current mesh, if any.

        Returns:
            The spec, through :func:`flax_escale.logical_to_mesh_axes`.

        Raises:
            EscaleError: For a name outside the vocabulary, an unknown mode, or a dimension
                index without ``shape``.
            EscaleTypeError: If ``axes`` is a string rather than a sequence of names.
        """
        rules = self._rules(mode, shape)
        return logical_to_mesh_axes(self._names(axes), rules, shape=shape, mesh=mesh)

    def shard(
        self,
        x: jax.Array,
        axes: Sequence[str | None],
        mode: str | int = "train",
        *,
        auto_correct: bool = True,
        mesh: Mesh | AbstractMesh | None = None,
    ) -> jax.Array:
        """Constrains ``x`` by the logical ``axes`` of its dimensions (see the class).

        Args:
            x: The activation.
            axes: One logical name (or ``None``) per dimension of ``x``.
            mode: The runtime mode, or a dimension index of ``x``.
            auto_correct: Drop mesh axes that cannot apply (with a warning); ``False`` raises
                :class:`~flax_escale.ShardingResolutionError` instead.
            mesh: The mesh; defaults to the current mesh (no mesh: ``x`` is returned as is).

        Returns:
            ``x``, constrained.

        Raises:
            EscaleError: If ``axes`` do not name every dimension of ``x``, or ``mode`` is
                neither a mode name nor a dimension index of ``x``.
        """
        names = self._names(axes)
        shape = getattr(x, "shape", None)
        if shape is not None and len(names) != len(shape):
            raise EscaleError(
                f"PartitionManager.shard: axes {names} name {len(names)} dimensions but x has "
                f"shape {tuple(shape)}; give one logical name (or None) per dimension."
            )
        rules = self._rules(mode, shape)
        return constrain(x, names, rules=rules, mesh=mesh, strict=not auto_correct)

    def _rules(self, mode: str | int, shape: Sequence[int] | None) -> LogicalRules:
        if isinstance(mode, int) and not isinstance(mode, bool):
            if shape is None:
                raise EscaleError(
                    f"PartitionManager: mode={mode} reads the size of dimension {mode}; pass "
                    "shape= (or a mode name: 'train', 'decode')."
                )
            if not -len(shape) <= mode < len(shape):
                raise EscaleError(
                    f"PartitionManager: mode={mode} names dimension {mode}, but the shape "
                    f"{tuple(shape)} has {len(shape)}; pass a dimension index of x, or a mode "
                    f"name ({', '.join(sorted(_MODES))})."
                )
            return self.paxis.logical_axis_rules(generation=shape[mode] == 1)
        if mode not in _MODES:
            raise EscaleError(
                f"PartitionManager: unknown mode {mode!r}; use one of {sorted(_MODES)} or a "
                "dimension index."
            )
        return self.paxis.logical_axis_rules(generation=_MODES[mode])

    def _names(self, axes: Sequence[str | None]) -> tuple[str | None, ...]:
        known = self.paxis.logical_axes()
        names = []
        for axis in check.sequence(axes, "axes", "logical axis names", "('batch', None)"):
            if axis is not None and not isinstance(axis, str):
                raise EscaleTypeError(
                    f"PartitionManager: each axis is one logical name or None, got "
                    f"{type(axis).__name__} {axis!r} (several names on one dimension are "
                    "eformer-only; give that dimension one logical name with its own rule)."
                )
            name = _EFORMER_NAMES.get(axis, axis) if axis is not None else None
            if name is not None and name not in known:
                raise EscaleError(
                    f"PartitionManager: unknown logical axis {axis!r}; use the PartitionAxis "
                    f"names {sorted(known)}, eformer's constants, or None."
                )
            names.append(name)
        return tuple(names)
