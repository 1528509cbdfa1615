"""``PartitionAxis``: the logical-axis vocabulary and its translation into Flax rules."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import jax

from flax_escale._specs import MeshAxes
from flax_escale.axes._aliases import Aliases, merge_aliases
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["LogicalRules", "MeshAxes", "PartitionAxis"]


LogicalRules: TypeAlias = tuple[tuple[str, MeshAxes], ...]
"""Ordered ``(logical name, mesh axes)`` pairs, as ``flax.linen.logical_axis_rules`` takes."""

_MESH_FIELDS = (
    "data_parallel_axis",
    "fully_sharded_data_parallel_axis",
    "tensor_parallel_axis",
    "sequence_parallel_axis",
    "expert_parallel_axis",
)
# Names that are usually larger than the hidden size: they get the tensor-parallel axis first, so
# that hidden_state falls back to (fsdp, sp) when it shares an array with one of them.
# Fields that are not logical names: the mesh-axis names, and the aliases.
_NOT_LOGICAL = (*_MESH_FIELDS, "pipeline_parallel_axis", "aliases", "ep_as_fsdp")
_WIDE = ("vocab", "head", "kv_head", "mlp_intermediate", "expert")
# Logical names that only the generation (decode) rules look up in generation_* fields.
_GENERATION = (
    "batch",
    "query_sequence",
    "head",
    "kv_head",
    "key_sequence",
    "attention_dim",
    "attention_kv_dim",
)
# eformer spells the generation fields decode_*: accepted as aliases, never stored twice.
_DECODE_ALIASES = {f"decode_{name}_axis": f"generation_{name}_axis" for name in _GENERATION}
# Defaults that follow another field's value rather than a mesh-axis name (as eformer's do).
_FOLLOWS = {"generation_kv_head_axis": "kv_head_axis"}

_Class = TypeVar("_Class", bound=type)


def _canonical_names(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every ``decode_*`` alias renamed to its ``generation_*`` field."""
    renamed = dict(kwargs)
    for alias, field in _DECODE_ALIASES.items():
        if alias not in renamed:
            continue
        if field in renamed:
            raise EscaleError(
                f"PartitionAxis: {alias} and {field} name the same field; give only one of them."
            )
        renamed[field] = renamed.pop(alias)
    return renamed


def _decode_aliases(cls: _Class) -> _Class:
    # The dataclass __init__ stays the one constructor; the aliases are renamed on the way in,
    # and read back as properties, so they are neither fields nor part of equality and hash.
    init: Callable[..., None] = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **_canonical_names(kwargs))

    # The signature lists the aliases too, with their fields' defaults (None for the decode
    # fields that default to unsharded, `...` for the derived ones), so that help() and
    # introspection see them.
    signature = inspect.signature(init)
    aliases = [
        inspect.Parameter(
            alias,
            inspect.Parameter.KEYWORD_ONLY,
            default=signature.parameters[field].default,
            annotation=Any,
        )
        for alias, field in _DECODE_ALIASES.items()
    ]
    __init__.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), *aliases]
    )
    cls.__init__ = __init__
    for alias, field in _DECODE_ALIASES.items():
        getter = functools.partial(_read_field, name=field)
        setattr(cls, alias, property(getter, doc=f"eformer's name for ``{field}``."))
    return cls


def _read_field(self: Any, name: str) -> Any:
    return getattr(self, name)


@jax.tree_util.register_static
@_decode_aliases
@dataclasses.dataclass(frozen=True)
class PartitionAxis:
    """Which mesh axes each logical axis of parameters and activations is sharded over.

    The first five fields name the mesh axes. The others map a logical axis (the field name
    without ``_axis``) to a mesh axis, a tuple of mesh axes, or ``None``. A logical field left
    unset is derived from the mesh-axis names, so renaming ``tensor_parallel_axis`` renames every
    default that uses it. Instances are immutable and hashable (a static value under
    ``jax.jit``); :meth:`replace` makes a changed copy.

    The ``generation_*`` fields are the decode-time mapping; eformer's names for them,
    ``decode_batch_axis``, ``decode_head_axis``, ``decode_kv_head_axis`` and the others, are
    accepted as constructor keywords and read as attributes (they are not extra fields).
    ``generation_kv_head_axis`` defaults to ``kv_head_axis``'s value; ``attention_kv_dim_axis``
    (the dimension inside each key/value head) is unsharded by default.

    Mixture-of-experts models name two more things. ``expert_batch`` is the batch inside an
    expert layer once tokens are dispatched to their experts (``(expert, expert_batch, ...)``):
    ``batch``'s axes without ``ep``, since ``ep`` then splits the experts. ``ep_as_fsdp=True``
    lets ``ep`` act as ``fsdp`` outside the experts: ``batch`` defaults to
    ``(fsdp, dp, ep)``, so the devices of one expert group do not repeat each other's
    attention and dense layers, and the fallback of the weights that are not experts becomes
    ``(fsdp, sp, ep)`` (then ``(fsdp, sp)`` where the array's expert dimension holds ``ep``).
    It is off by default so that a model without experts keeps the specs above; MoE models
    turn it on (``bench/b10_moe.py`` measures both).

    Pipelines (:mod:`flax_escale.pipeline`) are opt-in: ``pipeline_parallel_axis="pp"`` names
    the stage mesh axis. Then ``layers``, the stacked dimension of a layer stack, defaults to
    it (each stage's layers are born on their stage), and ``batch`` defaults to the data axes
    and it, so that outside a pipeline the stage axis splits the batch as data parallelism
    does. Without it (the default) no rule names a stage axis and the 5-axis specs above are
    unchanged.

    :meth:`logical_axis_rules` turns the mapping into ordered Flax rules, used for parameters and
    activations alike.

    Example:
        >>> from flax_escale import PartitionAxis
        >>> paxis = PartitionAxis()
        >>> paxis.batch_axis, paxis.hidden_state_axis
        (('fsdp', 'dp'), 'tp')
        >>> PartitionAxis(tensor_parallel_axis="model").head_axis
        'model'
        >>> decode = PartitionAxis(decode_batch_axis="dp")
        >>> decode.generation_batch_axis, decode.decode_batch_axis, decode.decode_kv_head_axis
        ('dp', 'dp', 'tp')
        >>> moe = PartitionAxis(ep_as_fsdp=True)
        >>> moe.batch_axis, moe.expert_batch_axis
        (('fsdp', 'dp', 'ep'), ('fsdp', 'dp'))
        >>> staged = PartitionAxis(pipeline_parallel_axis="pp")
        >>> staged.layers_axis, staged.batch_axis, staged.mesh_axis_names
        ('pp', ('fsdp', 'dp', 'pp'), ('pp', 'dp', 'fsdp', 'ep', 'tp', 'sp'))
    """

    data_parallel_axis: str = "dp"
    fully_sharded_data_parallel_axis: str = "fsdp"
    tensor_parallel_axis: str = "tp"
    sequence_parallel_axis: str = "sp"
    expert_parallel_axis: str = "ep"
    pipeline_parallel_axis: str | None = None

    batch_axis: Any = ...
    sequence_axis: Any = ...
    query_sequence_axis: Any = ...
    head_axis: Any = ...
    kv_head_axis: Any = ...
    key_sequence_axis: Any = ...
    hidden_state_axis: Any = ...
    mlp_intermediate_axis: Any = ...
    vocab_axis: Any = ...
    expert_axis: Any = ...
    expert_gate_axis: Any = None
    expert_batch_axis: Any = ...
    attention_dim_axis: Any = None
    attention_kv_dim_axis: Any = None
    bias_head_sequence_axis: Any = None
    bias_key_sequence_axis: Any = None
    layers_axis: Any = ...

    generation_batch_axis: Any = None
    generation_query_sequence_axis: Any = None
    generation_head_axis: Any = ...
    generation_kv_head_axis: Any = ...
    generation_key_sequence_axis: Any = ...
    generation_attention_dim_axis: Any = None
    generation_attention_kv_dim_axis: Any = None

    # Foreign logical names and the library names whose rules they take; see with_aliases().
    aliases: Aliases = ()
    # Whether ep also splits what is not an expert, as fsdp does; see the class docstring.
    ep_as_fsdp: bool = False

    # Fields given explicitly, so that replace() re-derives the others from new mesh-axis names.
    _given: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.ep_as_fsdp, bool):
            raise EscaleTypeError(
                f"PartitionAxis.ep_as_fsdp must be True or False, got {self.ep_as_fsdp!r}."
            )
        for name in _MESH_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise EscaleError(
                    f"PartitionAxis.{name} must be a mesh axis name (a non-empty string), got "
                    f"{value!r}."
                )
        pp = self.pipeline_parallel_axis
        if pp is not None and (not isinstance(pp, str) or not pp):
            raise EscaleError(
                "PartitionAxis.pipeline_parallel_axis must be a mesh axis name (a non-empty "
                f"string) or None, got {pp!r}."
            )
        defaults = self._derived_defaults()
        given = set()
        for field in dataclasses.fields(self):
            if not field.init or field.name in _NOT_LOGICAL:
                continue
            value = getattr(self, field.name)
            if value is ... and field.name in _FOLLOWS:
                value = getattr(self, _FOLLOWS[field.name])  # an earlier field, already set
            elif value is ...:
                value = defaults[field.name]
            else:
                given.add(field.name)
            object.__setattr__(self, field.name, _check_mesh_axes(field.name, value))
        object.__setattr__(self, "_given", frozenset(given))

    def _derived_defaults(self) -> dict[str, MeshAxes]:
        tp, sp = self.tensor_parallel_axis, self.sequence_parallel_axis
        data = (self.fully_sharded_data_parallel_axis, self.data_parallel_axis)
        # A stage axis joins the data axes: it splits the batch wherever no pipeline runs (a
        # pipeline's stages take it back for themselves), so no device repeats another's work.
        pp = () if self.pipeline_parallel_axis is None else (self.pipeline_parallel_axis,)
        batch = (*data, self.expert_parallel_axis) if self.ep_as_fsdp else data
        return {
            "batch_axis": (*batch, *pp),
            "layers_axis": self.pipeline_parallel_axis,
            "expert_batch_axis": data,
            "sequence_axis": sp,
            "query_sequence_axis": sp,
            "head_axis": tp,
            "kv_head_axis": tp,
            "key_sequence_axis": sp,
            "hidden_state_axis": tp,
            "mlp_intermediate_axis": tp,
            "vocab_axis": tp,
            "expert_axis": self.expert_parallel_axis,
            "generation_head_axis": tp,
            "generation_key_sequence_axis": sp,
        }

    def replace(self, **changes: Any) -> PartitionAxis:
        """Returns a copy with ``changes``; unset logical fields are derived anew.

        Example:
            >>> from flax_escale import PartitionAxis
            >>> PartitionAxis().replace(tensor_parallel_axis="model").vocab_axis
            'model'
            >>> custom = PartitionAxis(vocab_axis=None)
            >>> custom.replace(tensor_parallel_axis="model").vocab_axis is None
            True
            >>> custom.replace(decode_head_axis="sp").generation_head_axis
            'sp'
        """
        changes = _canonical_names(changes)
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self) if f.init})
        if unknown:
            raise EscaleError(f"PartitionAxis has no field {unknown[0]!r}.")
        kept = {name: getattr(self, name) for name in (*_NOT_LOGICAL, *self._given)}
        # type(self): a subclass's copy keeps the subclass's defaults.
        return type(self)(**{**kept, **changes})

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        """The mesh-axis names in mesh order, the stage axis (when set) first.

        ``dp, fsdp, ep, tp, sp`` follow. The stage axis comes first because it is the outermost
        axis of a pipeline's mesh, the one that crosses hosts (its traffic is activations, the
        least of any axis).
        """
        pp = () if self.pipeline_parallel_axis is None else (self.pipeline_parallel_axis,)
        return (
            *pp,
            self.data_parallel_axis,
            self.fully_sharded_data_parallel_axis,
            self.expert_parallel_axis,
            self.tensor_parallel_axis,
            self.sequence_parallel_axis,
        )

    def logical_axis_rules(self, *, generation: bool = False) -> LogicalRules:
        """Translates the mapping into ordered Flax logical-axis rules.

        The wide names (``vocab``, ``head``, ``kv_head``, ``mlp_intermediate``, ``expert``) come
        before ``hidden_state``, and fallback rules send ``hidden_state`` and the wide names to
        ``(fsdp, sp)`` when their first choice is already used by the array. So one annotation
        serves parameters (FSDP + tensor parallel) and activations (batch over ``(fsdp, dp)``).
        With ``generation=True`` the ``generation_*`` fields replace their counterparts.

        The rules work with ``flax.linen.logical_axis_rules`` and
        ``flax.linen.logical_to_mesh_axes`` directly.

        Example:
            >>> import flax.linen as nn
            >>> from flax_escale import PartitionAxis
            >>> rules = PartitionAxis().logical_axis_rules()
            >>> nn.logical_to_mesh_axes(("hidden_state", "mlp_intermediate"), rules)
            P(('fsdp', 'sp'), 'tp')
            >>> nn.logical_to_mesh_axes(("batch", "sequence", "hidden_state"), rules)
            P(('fsdp', 'dp'), 'sp', 'tp')
        """
        axes = self.logical_axes(generation=generation)
        fallback = (self.fully_sharded_data_parallel_axis, self.sequence_parallel_axis)
        # With ep_as_fsdp, ep joins the fallback where the array does not already use it (an
        # expert kernel's expert dimension does), and the plain fallback follows for those.
        tiers = [(*fallback, self.expert_parallel_axis)] if self.ep_as_fsdp else []
        first = [(name, axes[name]) for name in _WIDE]
        rest = [(name, value) for name, value in axes.items() if name not in _WIDE]
        fallbacks = [
            (name, tier)
            for tier in (*tiers, fallback)
            for name in ("hidden_state", *_WIDE)
            if axes[name] is not None and axes[name] != tier
        ]
        rules = first + rest + fallbacks
        if not self.aliases:
            return tuple(rules)
        # Each alias takes its library name's rules at the same places, so the priorities
        # (and so the specs) are exactly those the library name gets.
        by_target: dict[str | None, list[str]] = {}
        for foreign, target in self.aliases:
            by_target.setdefault(target, []).append(foreign)
        aliased = [
            (name, target)
            for rule_name, target in rules
            for name in (rule_name, *by_target.get(rule_name, ()))
        ]
        return tuple(aliased + [(foreign, None) for foreign in by_target.get(None, ())])

    def with_aliases(self, *vocabularies: str | Mapping[str, str | None]) -> PartitionAxis:
        """A copy that also knows foreign logical names, each sharded like a library name.

        Models name their axes in the vocabulary of the code they come from. Each vocabulary
        is a built-in name, ``"t5x"`` (t5x's names, which Flax's lm1b and wmt examples use:
        ``embed``, ``mlp``, ``heads``, ``kv``, ``joined_kv``, ``length``, ...) or
        ``"maxtext"`` (``activation_batch``, ``activation_embed``, ``embed``, ``q_heads``,
        ``kv_heads``, ...), or a mapping ``{foreign name: library name or None}`` (``None``:
        known and unsharded). In :meth:`logical_axis_rules` every alias gets its library
        name's rules at the same priority, so ``("embed", "mlp")`` resolves exactly as
        ``("hidden_state", "mlp_intermediate")``. A later vocabulary's alias of a name wins;
        the library's own names cannot be redefined (set their fields instead).
        ``flax_escale.axes.VOCABULARIES`` lists the built-in ones.

        Raises:
            EscaleError: For an unknown vocabulary, an alias to a name the library does not
                have, or an alias that redefines a library name.
            EscaleTypeError: If a vocabulary is neither a name nor a mapping of names.

        Example:
            >>> from flax_escale import PartitionAxis, logical_to_mesh_axes
            >>> rules = PartitionAxis().with_aliases("t5x", {"ffn": "mlp_intermediate"})
            >>> logical_to_mesh_axes(("embed", "mlp"), rules)
            P(('fsdp', 'sp'), 'tp')
            >>> logical_to_mesh_axes(("embed", "ffn"), rules)
            P(('fsdp', 'sp'), 'tp')
            >>> logical_to_mesh_axes(("batch", "length", "embed"), rules)
            P(('fsdp', 'dp'), 'sp', 'tp')
        """
        native = frozenset(self.logical_axes())
        merged = merge_aliases(self.aliases, vocabularies, native)
        return self.replace(aliases=merged)

    def logical_axes(self, *, generation: bool = False) -> dict[str, MeshAxes]:
        """Maps each logical name to its mesh axes, for training or generation.

        Example:
            >>> from flax_escale import PartitionAxis
            >>> PartitionAxis().logical_axes(generation=True)["batch"] is None
            True
        """
        axes = {
            field.name.removesuffix("_axis"): getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.init
            and field.name not in _NOT_LOGICAL
            and not field.name.startswith("generation_")
        }
        if generation:
            for name in _GENERATION:
                axes[name] = getattr(self, f"generation_{name}_axis")
        return axes


def _check_mesh_axes(field: str, value: Any) -> MeshAxes:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise EscaleError(
        f"PartitionAxis.{field} must be a mesh axis name, a non-empty sequence of names, or "
        f"None; got {value!r}."
    )
