"""The current mesh, and questions about a mesh's axes."""

from __future__ import annotations

import math

import jax
from jax.sharding import AbstractMesh, Mesh

from flax_escale._compat import legacy_mesh
from flax_escale.errors import EscaleTypeError, MeshError, NoMeshError
from flax_escale.mesh import _validate as check
from flax_escale.mesh._axes import MeshAxisNames, mesh_axes_of
from flax_escale.mesh._validate import describe

__all__ = [
    "MeshAxisNames",
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "names_in_current_mesh",
    "with_auto_axes",
]


def get_incontext_mesh() -> Mesh | AbstractMesh:
    """Returns the mesh of the current context.

    A mesh set with ``jax.set_mesh`` is found first: outside ``jax.jit`` as the concrete
    ``Mesh``, inside a traced function as the ``AbstractMesh`` (that is all JAX keeps there).
    A mesh entered with the deprecated ``with mesh:`` is found too.

    Returns:
        The current ``Mesh``, or its ``AbstractMesh`` while tracing.

    Raises:
        NoMeshError: If no mesh is set.

    Example:
        >>> import jax
        >>> from flax_escale import create_mesh
        >>> from flax_escale.mesh import get_incontext_mesh
        >>> mesh = create_mesh()
        >>> with jax.set_mesh(mesh):
        ...     get_incontext_mesh() is mesh
        True
    """
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        try:
            concrete = jax.sharding.get_mesh()
        except ValueError:  # raised while tracing: only the abstract mesh exists there
            return abstract
        return abstract if concrete.empty else concrete
    legacy = legacy_mesh()
    if legacy is None:
        raise NoMeshError(
            "No mesh is set in the current context. Enter one with `with jax.set_mesh(mesh):` "
            "(build it with flax_escale.create_mesh), or pass mesh=... explicitly."
        )
    return legacy


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
        >>> from flax_escale.mesh import names_in_current_mesh
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
                f"{describe(name)}; pass names_in_current_mesh('dp', 'tp'), or "
                "names_in_current_mesh(*names) for a sequence."
            )
    try:
        mesh = get_incontext_mesh()
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
        >>> from flax_escale.mesh import get_mesh_axis_names
        >>> get_mesh_axis_names(create_mesh())
        ['dp', 'fsdp', 'ep', 'tp', 'sp']
    """
    mesh = check.optional_mesh(mesh)
    return list((get_incontext_mesh() if mesh is None else mesh).axis_names)


def get_axes_size_in_mesh(
    axis_names: MeshAxisNames, mesh: Mesh | AbstractMesh | None = None
) -> int:
    """Returns the number of devices along one mesh axis, or the product over several.

    Args:
        axis_names: An axis name, a tuple or list of names, or ``None`` (size 1).
        mesh: The mesh; defaults to the current mesh.

    Returns:
        The size of the axis, or the product of the sizes of the axes.

    Raises:
        MeshError: If an axis is not in the mesh.
        EscaleTypeError: If ``axis_names`` is not a string, a tuple or list of strings or
            ``None`` (see :func:`~flax_escale.mesh._axes.mesh_axes_of`), or ``mesh`` is not a
            mesh.
        NoMeshError: If ``mesh`` is omitted and no mesh is set.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.mesh import get_axes_size_in_mesh
        >>> mesh = create_mesh((2, 2, 1, 2, 1))
        >>> get_axes_size_in_mesh("tp", mesh), get_axes_size_in_mesh(("dp", "fsdp"), mesh)
        (2, 4)
    """
    names = mesh_axes_of(axis_names, argument="axis_names")
    mesh = check.optional_mesh(mesh)
    mesh = get_incontext_mesh() if mesh is None else mesh
    shape = dict(mesh.shape)
    unknown = [n for n in names if n not in shape]
    if unknown:
        raise MeshError(
            f"axis_names: axis {unknown[0]!r} is not in the mesh {shape}; use one of "
            f"{tuple(shape)}."
        )
    return math.prod(shape[n] for n in names)


def as_axis_name_tuple(axis_names: MeshAxisNames) -> tuple[str, ...]:
    """:func:`~flax_escale.mesh._axes.mesh_axes_of`, for an argument called ``axis_names``."""
    return mesh_axes_of(axis_names, argument="axis_names")


def with_auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``Auto``: the same devices and names, for tracing initializers.

    Under a mesh with ``Explicit`` axes JAX adds a sharding to every intermediate value, which
    changes how XLA fuses an initializer's arithmetic and so its rounding; traced under the Auto
    twin (outputs still placed on ``mesh``), the values are bit-equal to ``jax.jit(init)``.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.mesh import with_auto_axes
        >>> explicit = create_mesh((1, 8, 1, 1, 1), axis_types="explicit")
        >>> auto = with_auto_axes(explicit)
        >>> auto.devices.tolist() == explicit.devices.tolist(), set(map(str, auto.axis_types))
        (True, {'AxisType.Auto'})
    """
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return mesh if tuple(mesh.axis_types) == auto else mesh.update(axis_types=auto)
