"""eformer's questions about the current mesh and its axes, answered by the core.

In JAX, the current mesh is ``jax.sharding.get_abstract_mesh()`` (``jax.sharding.get_mesh()``
outside ``jax.jit``), its axes are ``mesh.axis_names`` and ``mesh.shape``, and inside
``jax.shard_map`` a group of axes has ``jax.lax.axis_size`` and ``jax.lax.axis_index``. eformer
names these questions itself; these are its names, answered by the library's current mesh
(``jax.set_mesh`` first, then the legacy ``with mesh:``) with the library's errors.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import MeshAxes
from flax_escale.errors import EscaleTypeError, MeshError, NoMeshError
from flax_escale.mesh import current_mesh

__all__ = [
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "get_mesh_axis_size",
    "get_submesh_device_index",
    "names_in_current_mesh",
]


def get_incontext_mesh(raise_error: bool = True) -> Mesh | AbstractMesh:
    """The current mesh; with ``raise_error=False``, an empty ``Mesh`` when there is none.

    The mesh is found as :func:`flax_escale.mesh.current_mesh` finds it: ``jax.set_mesh``
    first, then the legacy ``with mesh:`` (eformer sees only the legacy one). As in eformer,
    the mesh given when there is none is empty (``mesh.empty`` is true, it has no axes and no
    devices), so code that tests ``mesh.empty`` or reads ``mesh.axis_names`` runs unchanged.

    Args:
        raise_error: Raise when no mesh is set (eformer raises ``AssertionError`` there; this
            raises :class:`~flax_escale.NoMeshError`, a ``ValueError``).

    Returns:
        The current ``Mesh`` (its ``AbstractMesh`` while tracing), or the empty ``Mesh``.

    Raises:
        NoMeshError: If no mesh is set and ``raise_error`` is true.
        EscaleTypeError: If ``raise_error`` is not a bool.

    Example:
        >>> import jax
        >>> from flax_escale import eformer as escale
        >>> none = escale.get_incontext_mesh(raise_error=False)
        >>> none.empty, none.axis_names
        (True, ())
        >>> mesh = escale.create_mesh()
        >>> with jax.set_mesh(mesh):
        ...     escale.get_incontext_mesh() is mesh
        True
    """
    raise_error = check.flag(raise_error, "raise_error")
    try:
        return current_mesh()
    except NoMeshError:
        if raise_error:
            raise
        return _EMPTY_MESH


# What JAX itself holds as the mesh outside any `with mesh:`, and what eformer hands back.
_EMPTY_MESH = Mesh(np.empty((), dtype=object), ())


def names_in_current_mesh(*names: str) -> bool:
    """Tells whether the current mesh has every one of the given axis names.

    Args:
        *names: Mesh axis names.

    Returns:
        ``True`` if a mesh is set and has all the names; ``False`` otherwise, including when
        no mesh is set.

    Raises:
        EscaleTypeError: If a name is not a string (a tuple of names passed as one argument).

    Example:
        >>> import jax
        >>> from flax_escale import create_mesh
        >>> from flax_escale.eformer import names_in_current_mesh
        >>> with jax.set_mesh(create_mesh()):
        ...     names_in_current_mesh("fsdp", "tp"), names_in_current_mesh("model")
        (True, False)
        >>> names_in_current_mesh("fsdp")
        False
    """
    for name in names:
        if not isinstance(name, str):
            raise EscaleTypeError(
                f"names_in_current_mesh takes mesh axis names as separate string arguments, got "
                f"{check.describe(name)}; pass names_in_current_mesh('dp', 'tp'), or "
                "names_in_current_mesh(*names) for a sequence."
            )
    try:
        mesh = current_mesh()
    except NoMeshError:
        return False
    return set(names) <= set(mesh.axis_names)


def get_mesh_axis_names(mesh: Mesh | AbstractMesh | None = None) -> list[str]:
    """Returns the axis names of ``mesh`` (default: the current mesh), in mesh order.

    Raises:
        NoMeshError: If ``mesh`` is omitted and no mesh is set.
        EscaleTypeError: If ``mesh`` is not a mesh.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.eformer import get_mesh_axis_names
        >>> get_mesh_axis_names(create_mesh())
        ['dp', 'fsdp', 'ep', 'tp', 'sp']
    """
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return list(mesh.axis_names)  # the empty mesh included, as in eformer: []
    mesh = check.optional_mesh(mesh)
    return list((current_mesh() if mesh is None else mesh).axis_names)


def get_axes_size_in_mesh(axis_names: MeshAxes, mesh: Mesh | AbstractMesh | None = None) -> int:
    """Returns the number of devices along one mesh axis, or the product over several.

    Args:
        axis_names: An axis name, a tuple or list of names, or ``None`` (size 1).
        mesh: The mesh; defaults to the current mesh.

    Returns:
        The size of the axis, or the product of the sizes of the axes.

    Raises:
        MeshError: If an axis is not in the mesh.
        EscaleTypeError: If ``axis_names`` is not a string, a tuple or list of strings or
            ``None``, or ``mesh`` is not a mesh.
        NoMeshError: If ``mesh`` is omitted and no mesh is set.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.eformer import get_axes_size_in_mesh
        >>> mesh = create_mesh((2, 2, 1, 2, 1))
        >>> get_axes_size_in_mesh("tp", mesh), get_axes_size_in_mesh(("dp", "fsdp"), mesh)
        (2, 4)
    """
    names = mesh_axes_of(axis_names, argument="axis_names")
    mesh = check.optional_mesh(mesh)
    mesh = current_mesh() if mesh is None else mesh
    shape = dict(mesh.shape)
    unknown = [n for n in names if n not in shape]
    if unknown:
        raise MeshError(
            f"axis_names: axis {unknown[0]!r} is not in the mesh {shape}; use one of "
            f"{tuple(shape)}."
        )
    return math.prod(shape[n] for n in names)


def as_axis_name_tuple(axis_names: MeshAxes) -> tuple[str, ...]:
    """:func:`~flax_escale._specs.mesh_axes_of`, for an argument called ``axis_names``."""
    return mesh_axes_of(axis_names, argument="axis_names")


def _unbound(function: str, names: tuple[str, ...], error: NameError) -> MeshError:
    return MeshError(
        f"{function}({names!r}) must run inside jax.shard_map (or another transform that binds "
        f"the mesh axes {names}): {error}. Outside shard_map, use "
        "flax_escale.eformer.get_axes_size_in_mesh(axis_names, mesh) for sizes."
    )


def get_mesh_axis_size(axis_names: MeshAxes) -> int:
    """Returns the number of devices along the given mesh axes, inside ``jax.shard_map``.

    Args:
        axis_names: An axis name, a sequence of names (sizes multiply), or ``None`` / ``()``
            (size 1).

    Returns:
        The size, as a Python integer.

    Raises:
        MeshError: If called where the axes are not bound (outside ``shard_map``).

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import eformer as escale
        >>> def sizes(x):
        ...     axes = ["dp", ("dp", "tp"), ()]
        ...     return x + jnp.array([escale.get_mesh_axis_size(a) for a in axes])
        >>> mesh = escale.create_mesh((2, 4), ("dp", "tp"))
        >>> jax.shard_map(sizes, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(jnp.zeros(3))
        Array([2., 8., 1.], dtype=float32)
    """
    names = mesh_axes_of(axis_names, argument="axis_names")
    try:
        return math.prod(jax.lax.axis_size(n) for n in names)
    except NameError as error:
        raise _unbound("get_mesh_axis_size", names, error) from error


def get_submesh_device_index(axis_names: MeshAxes) -> jax.Array | int:
    """Returns this device's linear index over the given mesh axes, inside ``jax.shard_map``.

    The first axis is the most significant (row-major), so over ``("dp", "tp")`` with
    ``tp=4`` the device at ``dp=1, tp=2`` has index ``6``.

    Args:
        axis_names: An axis name or a sequence of names, major to minor; ``None`` / ``()``
            gives ``0``.

    Returns:
        The index, a traced integer scalar (``0`` for no axes).

    Raises:
        MeshError: If called where the axes are not bound (outside ``shard_map``).

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax_escale import create_mesh
        >>> from flax_escale.eformer import get_submesh_device_index
        >>> mesh = create_mesh((2, 4), ("dp", "tp"))
        >>> def body(x):
        ...     return x + get_submesh_device_index(("dp", "tp"))
        >>> jax.shard_map(body, mesh=mesh, in_specs=P(("dp", "tp")),
        ...               out_specs=P(("dp", "tp")))(jnp.zeros(8, jnp.int32))
        Array([0, 1, 2, 3, 4, 5, 6, 7], dtype=int32)
    """
    names = mesh_axes_of(axis_names, argument="axis_names")
    if not names:
        return 0
    try:
        return jax.lax.axis_index(names)
    except NameError as error:
        raise _unbound("get_submesh_device_index", names, error) from error
