"""The current mesh, as every function of the library finds it."""

from __future__ import annotations

import jax
from jax.sharding import AbstractMesh, Mesh

from flax_escale._compat import legacy_mesh
from flax_escale.errors import NoMeshError

__all__ = ["current_mesh", "with_auto_axes"]


def current_mesh() -> Mesh | AbstractMesh:
    """Returns the mesh of the current context.

    A mesh set with ``jax.set_mesh`` is found first: outside ``jax.jit`` as the concrete
    ``Mesh``, inside a traced function as the ``AbstractMesh`` (that is all JAX keeps there).
    A mesh entered with the deprecated ``with mesh:`` is found too. Like JAX's, the context
    is per thread: a thread sees only the meshes entered in it.

    Returns:
        The current ``Mesh``, or its ``AbstractMesh`` while tracing.

    Raises:
        NoMeshError: If no mesh is set.

    Example:
        >>> import jax
        >>> from flax_escale import create_mesh
        >>> from flax_escale.mesh import current_mesh
        >>> mesh = create_mesh()
        >>> with jax.set_mesh(mesh):
        ...     current_mesh() is mesh
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
            "(build it with flax_escale.create_mesh), or pass mesh=... explicitly. The context "
            "is per thread: a thread started inside `jax.set_mesh` or `use_sharding` does not "
            "inherit it, so enter it in that thread too."
        )
    return legacy


def with_auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis ``Auto``: the same devices and names, for tracing initializers.

    Under a mesh with ``Explicit`` axes JAX adds a sharding to every intermediate value, which
    changes how XLA fuses an initializer's arithmetic and so its rounding; traced under the Auto
    twin (outputs still placed on ``mesh``), the values are ``jax.jit(init)``'s: bit for bit
    where the shards keep the last dimension whole, within a few ulp where it is split (XLA:CPU
    from jaxlib 0.12 rounds transcendental functions differently on narrow shards).

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
