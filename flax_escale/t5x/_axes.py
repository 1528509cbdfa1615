"""t5x's standard logical-axis rules, and its ``AxisNames`` leaf type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import MeshAxes
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["AxisNames", "standard_logical_axis_rules"]


class AxisNames(tuple):
    """A tuple of logical axis names that pytree utilities treat as one leaf.

    A plain tuple of names in a tree of annotations would be flattened into its strings; this
    subclass is not registered as a pytree node, so it stays whole. It compares equal to the
    tuple of its names and to the ``PartitionSpec`` of its names (``==`` and ``!=``, with
    ``PartitionSpec``'s meaning), as t5x's did when ``PartitionSpec`` was a tuple; its hash is
    the tuple's.

    Example:
        >>> import jax
        >>> from jax.sharding import PartitionSpec
        >>> from flax_escale.t5x import AxisNames
        >>> names = AxisNames("embed", "mlp")
        >>> jax.tree_util.tree_leaves({"kernel": names})
        [AxisNames('embed', 'mlp')]
        >>> names == PartitionSpec("embed", "mlp"), names == ("embed", "mlp")
        (True, True)
    """

    __slots__ = ()

    def __new__(cls, *names: str | None) -> AxisNames:
        """Builds the tuple from the names given as separate arguments.

        Raises:
            EscaleTypeError: For an entry that is not a logical name, a tuple of names or None.
        """
        return super().__new__(cls, check.logical_names(names, "AxisNames"))

    def __eq__(self, other: object) -> bool:
        # t5x's users compare logical axes with PartitionSpecs of names (Flax's get_axis_names
        # gives those); PartitionSpec is no longer a tuple, so the comparison is made here.
        if isinstance(other, PartitionSpec):
            return PartitionSpec(*self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    # Defining __eq__ would otherwise make the class unhashable.
    __hash__ = tuple.__hash__

    def __repr__(self) -> str:
        return f"AxisNames{tuple.__repr__(self)}" if len(self) != 1 else f"AxisNames({self[0]!r})"


_ONE_D_PARAMS_ONE_D_ACTIVATIONS = (
    ("batch", "data"),
    ("vocab", "model"),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
)
_MODEL_PARALLEL = (
    ("batch", "data"),
    ("vocab", "model"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("joined_kv", "model"),
)
_BY_DIMS = {
    (1, 1): _ONE_D_PARAMS_ONE_D_ACTIVATIONS,
    (2, 1): (*_MODEL_PARALLEL, ("embed", "model")),
    (1, 2): (*_MODEL_PARALLEL, ("embed", "data")),
    (2, 2): (*_MODEL_PARALLEL, ("embed", "model"), ("embed", "data")),
}
_REPLICATED = (
    ("relpos_buckets", None),
    ("abspos_buckets", None),
    ("length", None),
    ("layers", None),
    ("stack", None),
    ("mlp_activations", None),
)


def standard_logical_axis_rules(
    activation_partitioning_dims: int = 1,
    parameter_partitioning_dims: int = 1,
    additional_rules: Sequence[tuple[str, MeshAxes]] | None = None,
    *,
    data_axis: MeshAxes = "data",
    model_axis: MeshAxes = "model",
) -> list[tuple[str, MeshAxes]]:
    """Returns t5x's standard rules for its logical names, over t5x's ``data`` and ``model``.

    Args:
        activation_partitioning_dims: 2 also shards activations' ``embed`` over ``model``.
        parameter_partitioning_dims: 2 also shards parameters' ``embed`` over ``data``.
        additional_rules: Rules appended after the standard ones.
        data_axis: The mesh axes that play t5x's ``data`` axis, e.g. ``("fsdp", "dp")`` on the
            library's default mesh.
        model_axis: The mesh axes that play t5x's ``model`` axis, e.g. ``"tp"``.

    Returns:
        The rules, in priority order, as a list of ``(logical name, mesh axes)``.

    Raises:
        EscaleError: For dims other than 1 or 2.
        EscaleTypeError: For dims that are not ints, ``additional_rules`` that are not
            ``(logical name, mesh axes)`` pairs, or a ``data_axis`` or ``model_axis`` that is
            not a mesh axis name, a tuple of names or ``None``.

    Example:
        >>> from flax_escale.t5x import standard_logical_axis_rules
        >>> standard_logical_axis_rules()[:3]
        [('batch', 'data'), ('vocab', 'model'), ('embed', None)]
        >>> standard_logical_axis_rules(data_axis=("fsdp", "dp"), model_axis="tp")[:2]
        [('batch', ('fsdp', 'dp')), ('vocab', 'tp')]
    """
    key = (activation_partitioning_dims, parameter_partitioning_dims)
    # 1.0 or True would find the entry of 1: only ints are looked up.
    ints = all(type(dims) is int for dims in key)
    if not ints or key not in _BY_DIMS:
        raise (EscaleError if ints else EscaleTypeError)(
            f"`activation_partitioning_dims` = {activation_partitioning_dims!r} "
            f"`parameter_partitioning_dims` = {parameter_partitioning_dims!r} is not supported: "
            "each must be 1 or 2 (an int); pass e.g. standard_logical_axis_rules(1, 2)."
        )
    extra = _additional(additional_rules)
    targets = {
        "data": _mesh_axes("data_axis", data_axis),
        "model": _mesh_axes("model_axis", model_axis),
    }
    standard = [(name, targets.get(target, target)) for name, target in _BY_DIMS[key]]
    return [*standard, *_REPLICATED, *extra]


def _additional(rules: Any) -> tuple[tuple[str, MeshAxes], ...]:
    if rules is None:
        return ()
    example = "[('expert', 'model')]"
    pairs = check.pairs(rules, "additional_rules", "(logical name, mesh axes)", example)
    for pair in pairs:
        if pair[1] is not PartitionSpec.UNCONSTRAINED:
            mesh_axes_of(pair[1], argument=f"additional_rules: the mesh axes of {pair!r}")
    return pairs


def _mesh_axes(argument: str, value: Any) -> MeshAxes:
    # A single name stays a name, as t5x writes its rules.
    if value is None or isinstance(value, str):
        return value
    return mesh_axes_of(value, argument=f"standard_logical_axis_rules: {argument}")
