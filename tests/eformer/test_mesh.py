import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import MeshError, create_mesh
from flax_escale import eformer as escale
from flax_escale.eformer import get_mesh_axis_size, get_submesh_device_index


@pytest.fixture
def mesh():
    return create_mesh((2, 2, 2), ("dp", "fsdp", "tp"))


def _per_device(mesh, fn):
    """Runs fn on every device of the mesh and returns its 8 results in mesh order."""
    axes = tuple(mesh.axis_names)
    body = lambda x: x + fn()  # noqa: E731
    out = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes))(
        jnp.zeros(mesh.size, jnp.int32)
    )
    return np.asarray(out)


@pytest.mark.parametrize(
    ("axes", "size"),
    [("dp", 2), (("dp", "tp"), 4), (["dp", "fsdp", "tp"], 8), ((), 1), (None, 1)],
)
def test_get_mesh_axis_size(mesh, axes, size):
    np.testing.assert_array_equal(_per_device(mesh, lambda: get_mesh_axis_size(axes)), size)


@pytest.mark.parametrize(
    ("axes", "expected"),
    [
        ("tp", [0, 1] * 4),
        ("dp", [0] * 4 + [1] * 4),
        (("dp", "tp"), [0, 1, 0, 1, 2, 3, 2, 3]),
        (("tp", "dp"), [0, 2, 0, 2, 1, 3, 1, 3]),
        (("dp", "fsdp", "tp"), list(range(8))),
        ((), [0] * 8),
    ],
)
def test_get_submesh_device_index(mesh, axes, expected):
    np.testing.assert_array_equal(
        _per_device(mesh, lambda: get_submesh_device_index(axes)), expected
    )


def test_outside_shard_map_is_a_clear_error():
    with pytest.raises(
        MeshError, match=r"get_mesh_axis_size\(\('tp',\)\) must run inside jax.shard_map"
    ):
        get_mesh_axis_size("tp")
    with pytest.raises(
        MeshError, match=r"get_submesh_device_index\(\('dp', 'tp'\)\) must run inside"
    ):
        get_submesh_device_index(("dp", "tp"))


def test_get_incontext_mesh_errors_and_the_legacy_context():
    with pytest.raises(ValueError, match=r"No mesh is set in the current context"):
        escale.get_incontext_mesh()
    mesh = escale.create_mesh()
    with pytest.warns(DeprecationWarning, match=r"`with mesh:` context manager"), mesh:
        found = escale.get_incontext_mesh(raise_error=False)
    assert found is mesh


def test_get_incontext_mesh_outside_a_mesh_is_an_empty_mesh():
    empty = escale.get_incontext_mesh(raise_error=False)
    assert isinstance(empty, Mesh)
    assert empty.empty
    assert empty.size == 0
    assert empty.axis_names == ()
    assert dict(empty.shape) == {}
    assert empty == Mesh(np.empty((), dtype=object), ())  # JAX's own "no mesh"
    assert escale.get_mesh_axis_names(empty) == []
    mesh = escale.create_mesh()
    with jax.set_mesh(mesh):
        assert escale.get_incontext_mesh(raise_error=False) is mesh


@pytest.mark.parametrize(
    "call",
    [
        lambda m: escale.extract_shardings({"w": np.zeros(8)}, m),
        lambda m: escale.analyze_sharding_strategy({"w": np.zeros(8)}, {"w": P()}, m),
        lambda m: escale.MeshPartitionHelper(m),
        # The core's functions check every mesh they are given the same way.
        lambda m: fe.with_sharding_constraint(np.zeros(8), P(), mesh=m),
        lambda m: escale.make_shard_and_gather_fns({"w": P()}, m),
        lambda m: fe.batch_sharding(m, (8, 4)),
    ],
    ids=[
        "extract_shardings",
        "analyze_sharding_strategy",
        "MeshPartitionHelper",
        "with_sharding_constraint",
        "make_shard_and_gather_fns",
        "batch_sharding",
    ],
)
def test_the_empty_mesh_is_refused_where_a_mesh_places_arrays(call):
    empty = escale.get_incontext_mesh(raise_error=False)
    with pytest.raises(fe.MeshError, match=r"mesh is an empty mesh \(no axes, no devices\)"):
        call(empty)


def test_get_incontext_mesh_errors():
    with pytest.raises(fe.NoMeshError, match=r"No mesh is set in the current context"):
        escale.get_incontext_mesh()
    with pytest.raises(TypeError, match=r"raise_error must be True or False"):
        escale.get_incontext_mesh(raise_error="no")


CASES = [
    # --- the mesh builders and mesh queries ------------------------------------------------
    case(
        lambda: fe.eformer.get_axes_size_in_mesh("dp", "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="get_axes_size_in_mesh-mesh-string",
    ),
    case(
        lambda: fe.eformer.get_axes_size_in_mesh("model", mesh_dp_tp()),
        fe.MeshError,
        "axis_names",
        "'model'",
        r"use one of \('dp', 'tp'\)",
        id="get_axes_size_in_mesh-unknown-axis",
    ),
    case(
        lambda: fe.eformer.get_mesh_axis_names("dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="get_mesh_axis_names-string",
    ),
    case(
        lambda: fe.eformer.names_in_current_mesh(("dp", "tp")),
        T,
        "names",
        "('dp', 'tp')",
        r"names_in_current_mesh\('dp', 'tp'\)",
        id="names_in_current_mesh-tuple",
    ),
    case(
        lambda: fe.eformer.get_mesh_axis_size(3),
        T,
        "axis_names",
        "int 3",
        "mesh axis name",
        id="get_mesh_axis_size-int",
    ),
    # --- eformer's helpers ---------------------------------------------------------------------
    case(
        lambda: fe.eformer.get_incontext_mesh("no"),
        T,
        "raise_error",
        "'no'",
        "True or False",
        id="eformer-get_incontext_mesh-flag-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
