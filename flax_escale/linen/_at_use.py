"""Parameters gathered over the data axes where a Linen model reads them.

FSDP keeps each parameter split over the axes the batch is split over and gathers it whole
before use. XLA infers that gather from the layouts around each use; in a model with no
activation constraints, the parameter's split can win the inference instead, and the
partitioner then replicates an activation to split it again (its "involuntary full
rematerialization"). Gathering at use writes FSDP's gather down: Flax unboxes every parameter
a module reads (``Scope.param``), so a box whose unbox constrains the value to its sharding
without the data axes puts the gather exactly there, layer by layer inside ``nn.scan`` too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import struct
from flax.core import meta
from jax.sharding import PartitionSpec

from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.plan._optimizer import sharding_of_param
from flax_escale.resolve import RulesLike, as_logical_rules
from flax_escale.sharding._constraint import apply_spec

__all__ = ["data_axes", "gathering_apply"]

# The logical names whose mesh axes split the batch: a parameter is gathered over them.
_DATA_NAMES = ("batch", "sequence")


def data_axes(rules: RulesLike) -> frozenset[str]:
    """The mesh axes ``rules`` split activations' batch and sequence over.

    Raises:
        EscaleError: If the rules split them over no mesh axis: there is nothing to gather
            over, and ``gather_at_use`` would do nothing.

    Example:
        >>> import flax_escale as fe
        >>> from flax_escale.linen._at_use import data_axes
        >>> sorted(data_axes(fe.PartitionAxis()))
        ['dp', 'fsdp', 'sp']
        >>> sorted(data_axes([("batch", "data")]))
        ['data']
    """
    logical = as_logical_rules(rules)
    axes = frozenset(
        axis for name, entry in logical if name in _DATA_NAMES for axis in mesh_axes_of(entry)
    )
    if not axes:
        raise EscaleError(
            f"gather_at_use: the rules {list(logical)} split 'batch' and 'sequence' over no mesh "
            "axis, so there is nothing to gather the parameters over; add a rule such as "
            "('batch', 'fsdp'), or leave gather_at_use off."
        )
    return axes


class _GatheredAtUse(meta.AxisMetadata, struct.PyTreeNode):
    # The box Flax unboxes where a module reads the parameter. ``stored`` and ``gathered``
    # follow nn.scan's slicing (remove_axis) and stacking (add_axis) of the value.
    value: Any
    mesh: Any = struct.field(pytree_node=False)
    stored: PartitionSpec = struct.field(pytree_node=False)
    gathered: PartitionSpec = struct.field(pytree_node=False)

    def unbox(self) -> Any:
        # The stored layout first, so that the gradient, flowing back through both, returns
        # to it (reduce-scattered) whatever the step's own out_shardings say.
        stored = apply_spec(self.value, self.stored, self.mesh)
        return apply_spec(stored, self.gathered, self.mesh)

    def replace_boxed(self, val: Any) -> _GatheredAtUse:
        return self.replace(value=val)

    def add_axis(self, index: int, params: dict[Any, Any]) -> _GatheredAtUse:
        return self.replace(
            stored=_inserted(self.stored, index), gathered=_inserted(self.gathered, index)
        )

    def remove_axis(self, index: int, params: dict[Any, Any]) -> _GatheredAtUse:
        return self.replace(
            stored=_removed(self.stored, index), gathered=_removed(self.gathered, index)
        )


def _inserted(spec: PartitionSpec, index: int) -> PartitionSpec:
    entries = list(spec) + [None] * max(0, index - len(spec))
    entries.insert(index, None)
    return PartitionSpec(*entries)


def _removed(spec: PartitionSpec, index: int) -> PartitionSpec:
    entries = list(spec)
    if index < len(entries):
        del entries[index]
    return PartitionSpec(*entries)


def _without(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
    entries = []
    for entry in spec:
        kept = tuple(a for a in mesh_axes_of(entry) if a not in axes)
        entries.append(kept[0] if len(kept) == 1 else (kept or None))
    return PartitionSpec(*entries)


def gathering_apply(
    apply_fn: Callable[..., Any], params: Any, axes: frozenset[str]
) -> Callable[..., Any]:
    """``apply_fn`` with each parameter gathered over ``axes`` where the model reads it.

    Args:
        apply_fn: The model's ``apply``.
        params: The parameters (arrays or ``jax.ShapeDtypeStruct``) with their
            ``NamedSharding``: the layout each is stored in.
        axes: The mesh axes to gather over (:func:`data_axes`).

    Returns:
        ``apply(variables, *args, **kwargs)``, called as ``apply_fn`` is, for parameters of
        the structure of ``params``.
    """
    shardings = jax.tree.map(sharding_of_param, params)
    structure = jax.tree.structure(params)

    @functools.wraps(apply_fn)
    def apply(variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        given = variables.get("params") if isinstance(variables, Mapping) else None
        if given is None or jax.tree.structure(given) != structure:
            found = (
                "no 'params'"
                if given is None
                else f"params of structure {jax.tree.structure(given)}"
            )
            raise EscaleTypeError(
                f"apply_fn (gather_at_use=True) was made for params of structure {structure} "
                f"and was given {found}; call it with the state's own params, or call the "
                "model's apply for others."
            )
        boxed = jax.tree.map(
            lambda value, s: _GatheredAtUse(value, s.mesh, s.spec, _without(s.spec, axes)),
            given,
            shardings,
        )
        return apply_fn({**variables, "params": boxed}, *args, **kwargs)

    return apply
