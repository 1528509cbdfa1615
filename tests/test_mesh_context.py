import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from flax_escale import (
    MeshError,
    NoMeshError,
    create_mesh,
    get_axes_size_in_mesh,
    get_incontext_mesh,
    get_mesh_axis_names,
    names_in_current_mesh,
)
from flax_escale.errors import EscaleTypeError


@pytest.fixture
def mesh():
    return create_mesh((2, 2, 1, 2, 1))


def test_no_mesh_is_a_clear_error():
    with pytest.raises(NoMeshError, match=r"No mesh is set.*jax.set_mesh\(mesh\).*mesh=\.\.\."):
        get_incontext_mesh()


def test_set_mesh_is_seen_outside_jit(mesh):
    with jax.set_mesh(mesh):
        assert get_incontext_mesh() is mesh


def test_set_mesh_is_seen_inside_jit_as_the_abstract_mesh(mesh):
    seen = []

    @jax.jit
    def f(x):
        seen.append(get_incontext_mesh())
        return x

    with jax.set_mesh(mesh):
        f(jnp.ones(2))
    assert isinstance(seen[0], AbstractMesh)
    assert seen[0] == mesh.abstract_mesh


def test_legacy_mesh_context_is_seen(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            assert get_incontext_mesh() is mesh
            assert names_in_current_mesh("dp", "tp")


def test_names_in_current_mesh(mesh):
    assert not names_in_current_mesh("dp")
    with jax.set_mesh(mesh):
        assert names_in_current_mesh()
        assert names_in_current_mesh("dp", "fsdp", "ep", "tp", "sp")
        assert not names_in_current_mesh("dp", "model")


def test_get_mesh_axis_names(mesh):
    assert get_mesh_axis_names(mesh) == ["dp", "fsdp", "ep", "tp", "sp"]
    with jax.set_mesh(create_mesh((2, 4), ("data", "model"))):
        assert get_mesh_axis_names() == ["data", "model"]
        # An explicit mesh wins over the context.
        assert get_mesh_axis_names(mesh) == ["dp", "fsdp", "ep", "tp", "sp"]
    with pytest.raises(NoMeshError):
        get_mesh_axis_names()


@pytest.mark.parametrize(
    ("axes", "size"),
    [
        ("dp", 2),
        ("tp", 2),
        ("ep", 1),
        (("dp", "fsdp"), 4),
        (["dp", "fsdp", "tp"], 8),
        ((), 1),
        (None, 1),
    ],
)
def test_get_axes_size_in_mesh(mesh, axes, size):
    assert get_axes_size_in_mesh(axes, mesh) == size
    with jax.set_mesh(mesh):
        assert get_axes_size_in_mesh(axes) == size


def test_get_axes_size_in_mesh_errors(mesh):
    with pytest.raises(MeshError, match=r"axis 'model' is not in the mesh \{'dp': 2.*use one of"):
        get_axes_size_in_mesh(("dp", "model"), mesh)
    with pytest.raises(EscaleTypeError, match=r"axis_names must be .*got int 3"):
        get_axes_size_in_mesh(3, mesh)
    with pytest.raises(NoMeshError):
        get_axes_size_in_mesh("dp")


def test_abstract_mesh_works_as_mesh(mesh):
    assert get_axes_size_in_mesh(("dp", "tp"), mesh.abstract_mesh) == 4
    assert get_mesh_axis_names(mesh.abstract_mesh) == list(mesh.axis_names)
