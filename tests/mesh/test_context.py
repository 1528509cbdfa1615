import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from support import MESHES

from flax_escale import MeshError, NoMeshError, create_mesh
from flax_escale.eformer import get_axes_size_in_mesh, get_mesh_axis_names, names_in_current_mesh
from flax_escale.errors import EscaleTypeError
from flax_escale.mesh import current_mesh


@pytest.fixture
def mesh():
    return create_mesh(MESHES["dp2_fsdp2_tp2"])


def test_no_mesh_is_a_clear_error():
    with pytest.raises(NoMeshError, match=r"No mesh is set.*jax.set_mesh\(mesh\).*mesh=\.\.\."):
        current_mesh()


def test_set_mesh_is_seen_outside_jit(mesh):
    with jax.set_mesh(mesh):
        assert current_mesh() is mesh


def test_set_mesh_is_seen_inside_jit_as_the_abstract_mesh(mesh):
    seen = []

    @jax.jit
    def f(x):
        seen.append(current_mesh())
        return x

    with jax.set_mesh(mesh):
        f(jnp.ones(2))
    assert isinstance(seen[0], AbstractMesh)
    assert seen[0] == mesh.abstract_mesh


def test_legacy_mesh_context_is_seen(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            assert current_mesh() is mesh
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
        (P.UNCONSTRAINED, 1),
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
    with pytest.raises(EscaleTypeError, match=r"axis_names must be .*got tuple \('dp', 2\)"):
        get_axes_size_in_mesh(("dp", 2), mesh)
    with pytest.raises(NoMeshError):
        get_axes_size_in_mesh("dp")


def test_abstract_mesh_works_as_mesh(mesh):
    assert get_axes_size_in_mesh(("dp", "tp"), mesh.abstract_mesh) == 4
    assert get_mesh_axis_names(mesh.abstract_mesh) == list(mesh.axis_names)


# --- the one reading of a spec entry (flax_escale._specs.mesh_axes_of) ---------------------


@pytest.mark.parametrize(
    ("entry", "axes"),
    [
        (None, ()),
        (P.UNCONSTRAINED, ()),
        ("tp", ("tp",)),
        ("fsdp", ("fsdp",)),  # never letter by letter
        (("fsdp", "sp"), ("fsdp", "sp")),
        (["dp", "fsdp"], ("dp", "fsdp")),
        ((), ()),
    ],
)
def test_mesh_axes_of_reads_every_entry_form(entry, axes):
    from flax_escale._specs import mesh_axes_of

    assert mesh_axes_of(entry) == axes


@pytest.mark.parametrize(
    ("entry", "got"),
    [
        (3, "int 3"),
        (("dp", 3), r"tuple \('dp', 3\)"),
        ({"dp"}, r"set \{'dp'\}"),
        (P("dp"), r"(PartitionSpec|P) (PartitionSpec|P)\('dp',\)"),
        ((("dp",),), r"tuple \(\('dp',\),\)"),
    ],
)
def test_mesh_axes_of_refuses_anything_else_naming_the_argument(entry, got):
    from flax_escale._specs import mesh_axes_of

    with pytest.raises(EscaleTypeError, match=r"my_arg must be None, a mesh axis name.*got " + got):
        mesh_axes_of(entry, argument="my_arg")


def test_every_module_reads_entries_with_the_one_function():
    from flax_escale import _specs as axes
    from flax_escale.eformer import _mesh as eformer_mesh
    from flax_escale.resolve import _fit as fit
    from flax_escale.t5x import _chunks as chunks

    assert fit.mesh_axes_of is axes.mesh_axes_of
    assert chunks.mesh_axes_of is axes.mesh_axes_of
    assert eformer_mesh.mesh_axes_of is axes.mesh_axes_of
