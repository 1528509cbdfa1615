import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flax_escale import MeshError, create_mesh
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
