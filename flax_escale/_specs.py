"""The one reading of what a ``PartitionSpec`` entry names: a tuple of mesh axis names.

A spec entry (and any argument that names mesh axes the same way) is ``None``, one axis name,
or a tuple or list of names. Every module that looks inside spec entries reads them here, so a
string is never taken apart letter by letter and a malformed entry is refused the same way
everywhere.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from jax.sharding import AxisType, PartitionSpec

from flax_escale.errors import EscaleTypeError

__all__ = ["MeshAxes", "mesh_axes_of", "mesh_text", "without_unit_explicit_axes"]

MeshAxes: TypeAlias = str | tuple[str, ...] | None
"""Where one array dimension goes: a mesh axis, several (sharded over their product), or none."""


def mesh_axes_of(entry: Any, *, argument: str = "a PartitionSpec entry") -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names, as a tuple.

    ``None`` and ``PartitionSpec.UNCONSTRAINED`` name no axis; a string names one; a tuple or
    list of strings names each of them, in order.

    Args:
        entry: The entry.
        argument: What ``entry`` is, as the error message should call it.

    Returns:
        The axis names (empty for ``None`` and ``UNCONSTRAINED``).

    Raises:
        EscaleTypeError: For anything else, naming ``argument`` and the value.

    Example:
        >>> from flax_escale._specs import mesh_axes_of
        >>> mesh_axes_of(("fsdp", "sp")), mesh_axes_of("tp"), mesh_axes_of(None)
        (('fsdp', 'sp'), ('tp',), ())
        >>> mesh_axes_of(3, argument="axis_names")
        Traceback (most recent call last):
        ...
        flax_escale.errors.EscaleTypeError: axis_names must be None, a mesh axis name, or ...
    """
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(name, str) for name in entry):
        return tuple(entry)
    raise EscaleTypeError(
        f"{argument} must be None, a mesh axis name, or a tuple or list of mesh axis names; "
        f"got {type(entry).__name__} {entry!r}."
    )


def mesh_text(sizes: Any) -> str:
    """A mesh shape (``mesh.shape`` or an ``{axis: size}`` dict) as ``dp=1, fsdp=4, ...``.

    Example:
        >>> from flax_escale._specs import mesh_text
        >>> mesh_text({"fsdp": 4, "tp": 2})
        'fsdp=4, tp=2'
    """
    return ", ".join(f"{axis}={size}" for axis, size in sizes.items())


def without_unit_explicit_axes(spec: PartitionSpec, mesh: Any) -> PartitionSpec:
    """``spec`` without the ``Explicit`` mesh axes of size 1.

    On Explicit axes an array's type records the axes it is split over, and JAX counts a size-1
    axis as one: a cumulative sum over a dimension "split" over ``sp`` of size 1 is refused. The
    placement is the same without them. Auto axes are left as they are.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax_escale import create_mesh
        >>> from flax_escale._specs import without_unit_explicit_axes
        >>> mesh = create_mesh((1, 8, 1, 1, 1), axis_types="explicit")
        >>> without_unit_explicit_axes(P(("fsdp", "dp"), "sp"), mesh)
        P('fsdp', None)
    """
    unit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit and mesh.shape[name] == 1
    }
    if not unit:
        return spec
    entries = []
    for entry in spec:
        kept = tuple(a for a in mesh_axes_of(entry) if a not in unit)
        if entry is PartitionSpec.UNCONSTRAINED or kept == mesh_axes_of(entry):
            entries.append(entry)
        else:
            entries.append(kept[0] if len(kept) == 1 else kept or None)
    return PartitionSpec(*entries)
