"""t5x's ``get_mesh`` (``flax_escale/t5x/_tiling.py``): the hardware mesh tiled by the model
parallel submesh, over processes x local devices and over TPU slices (JAX's devices and
stand-ins with only a core's coordinates); its mistakes.
"""

import jax
import numpy as np
import pytest
from support.fake_devices import V3_4X4, V4_2X2X4, Core, FakeDevice, FakeTpu, hosts, tpu_slice
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.t5x_meshes import (
    assert_processes_contiguous,
    assert_t5x_mesh,
    coords_of,
    ids_of,
    processes_of,
)

import flax_escale as fe
from flax_escale import t5x
from flax_escale.errors import EscaleTypeError, MeshError
from flax_escale.t5x import (
    get_coords,
    get_mesh,
)

# --- get_mesh: processes x local devices -----------------------------------------------------


def test_get_mesh_on_the_simulated_devices():
    mesh = get_mesh((1, 2))
    assert_t5x_mesh(mesh, (4, 2))
    assert ids_of(mesh) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert_t5x_mesh(get_mesh((1, 8)), (1, 8))
    assert get_mesh((1, 4), backend="cpu") == get_mesh((1, 4), jax.devices("cpu"))


def test_get_mesh_host_tiles():
    devices = hosts(2, 4)
    assert ids_of(get_mesh((1, 2), devices)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # A tile across processes: one device of each, at the same position.
    assert ids_of(get_mesh((2, 1), devices)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ids_of(get_mesh((2, 2), devices)) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_get_mesh_rejects_a_tile_that_does_not_divide_the_hosts():
    with pytest.raises(
        MeshError,
        match=r"\(1, 3\) does not tile the hardware mesh \(1, 8\) \(processes, local devices\).*"
        r"local devices=3 does not divide 8. Use one of \[1, 2, 4, 8\]",
    ):
        get_mesh((1, 3))


# --- get_mesh: TPU ---------------------------------------------------------------------------


def test_get_mesh_v3_core_pairs_are_tiled_by_host():
    mesh = get_mesh((1, 1, 1, 2), V3_4X4)
    assert_t5x_mesh(mesh, (16, 2))
    for row in coords_of(mesh):
        assert [c[:3] for c in row] == [row[0][:3]] * 2  # both cores of one chip
        assert [c[3] for c in row] == [0, 1]
    np.testing.assert_array_equal(processes_of(mesh)[:, 0], np.repeat([0, 1, 2, 3], 4))
    assert_processes_contiguous(mesh)


def test_get_mesh_without_tiling_by_host_refuses_scattered_processes():
    with pytest.raises(
        MeshError,
        match=r"model_parallel_submesh \(1, 1, 1, 2\) on the hardware mesh \(4, 4, 1, 2\) "
        r"\(x, y, z, core\): the devices of process\(es\) \[0, 1, 2, 3\] do not form one "
        r"contiguous block .* Pass tile_by_host_if_needed=True",
    ):
        get_mesh((1, 1, 1, 2), V3_4X4, tile_by_host_if_needed=False)


def test_get_mesh_v3_tile_of_two_chips():
    mesh = get_mesh((2, 1, 1, 2), V3_4X4, tile_by_host_if_needed=False)
    assert_t5x_mesh(mesh, (8, 4))
    assert list(coords_of(mesh)[0]) == [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
    assert_processes_contiguous(mesh)


def test_get_mesh_tile_along_all_of_x_needs_no_full_chip():
    # t5x asserts that such a tile uses every core; hosts stay contiguous without that.
    mesh = get_mesh((4, 1, 1, 1), V3_4X4, tile_by_host_if_needed=False)
    assert_t5x_mesh(mesh, (8, 4))
    assert list(coords_of(mesh)[0]) == [(x, 0, 0, 0) for x in range(4)]
    assert_processes_contiguous(mesh)


def test_get_mesh_puts_z_before_y_for_a_tile_spanning_the_yz_plane():
    mesh = get_mesh((1, 2, 4, 1), V4_2X2X4, tile_by_host_if_needed=False)
    assert_t5x_mesh(mesh, (2, 8))
    assert list(coords_of(mesh)[1]) == [(1, y, z, 0) for z in range(4) for y in range(2)]
    assert_processes_contiguous(mesh)


def test_get_mesh_puts_z_before_x_for_a_tile_spanning_the_xz_plane():
    mesh = get_mesh((2, 1, 4, 1), V4_2X2X4, tile_by_host_if_needed=False)
    assert_t5x_mesh(mesh, (2, 8))
    assert list(coords_of(mesh)[1]) == [(x, 1, z, 0) for z in range(4) for x in range(2)]
    assert_processes_contiguous(mesh)


def test_get_mesh_on_a_box_inside_a_bigger_slice():
    upper = [d for d in V4_2X2X4 if d.coords[2] >= 2]
    mesh = get_mesh((1, 1, 2, 1), upper)
    assert_t5x_mesh(mesh, (4, 2))
    assert list(coords_of(mesh)[0]) == [(0, 0, 2, 0), (0, 0, 3, 0)]
    assert_processes_contiguous(mesh)


def test_get_mesh_rejects_a_submesh_of_the_wrong_rank():
    with pytest.raises(
        MeshError, match=r"\(1, 2\) must be 4 positive sizes \(x, y, z, core\), like the hardware"
    ):
        get_mesh((1, 2), V3_4X4)
    with pytest.raises(MeshError, match="must be 4 positive sizes"):
        get_mesh((1, 1, 0, 1), V3_4X4)


def test_get_mesh_rejects_a_submesh_that_does_not_divide_the_slice():
    with pytest.raises(MeshError, match=r"x=3 does not divide 4. Use one of \[1, 2, 4\] for x"):
        get_mesh((3, 1, 1, 1), V3_4X4)


def test_get_mesh_rejects_a_submesh_that_is_not_a_tuple():
    with pytest.raises(EscaleTypeError, match="model_parallel_submesh must be a tuple of sizes"):
        get_mesh(4, V3_4X4)


def test_get_mesh_rejects_devices_with_a_hole():
    with pytest.raises(
        MeshError, match=r"the 31 TPU devices do not fill their \(x, y, z, core\) bounding box"
    ):
        get_mesh((1, 1, 1, 2), V3_4X4[:5] + V3_4X4[6:])


def test_get_mesh_rejects_mixed_platforms():
    with pytest.raises(MeshError, match="mix TPU devices"):
        get_mesh((1, 1, 1, 1), [*V3_4X4, FakeDevice(id=99, process_index=0)])


def test_get_mesh_rejects_local_devices_from_elsewhere():
    with pytest.raises(MeshError, match="input_local_devices holds 2 device"):
        get_mesh((1, 1, 1, 2), V3_4X4[:8], input_local_devices=V3_4X4[8:10])


def test_get_mesh_rejects_hosts_that_do_not_divide_the_slice():
    # Process 0 owns 3 of 4 chips along x.
    devices = [FakeTpu(x, int(x == 3), (x, 0, 0), 0) for x in range(4)]
    with pytest.raises(
        MeshError, match=r"the local devices span \(3, 1, 1, 1\) .* does not divide"
    ):
        get_mesh((1, 1, 1, 1), devices)


def test_get_mesh_tiling_by_host_needs_factors_or_multiples_of_the_host():
    devices = tpu_slice("TPU v4", (6, 1, 1), 1, (2, 1, 1))
    with pytest.raises(
        MeshError, match=r"x=3 is neither for 2. Choose x among \[1, 2\] or the multiples of 2"
    ):
        get_mesh((3, 1, 1, 1), devices)


def test_get_mesh_rejects_hosts_that_are_not_blocks_of_the_slice():
    devices = [FakeTpu(x, [0, 1, 1, 0][x], (x, 0, 0), 0) for x in range(4)]
    with pytest.raises(MeshError, match=r"process\(es\) \[0\] .* even when tiled by host"):
        get_mesh((1, 1, 1, 1), devices)


# --- get_mesh: stand-ins with only what it reads ---------------------------------------------


def test_get_mesh_places_tpu_stand_ins_by_coords():
    # One host of 2 x 2 chips with 2 cores each; a tile is one chip's two cores.
    cores = [
        Core(2 * (x + 2 * y) + c, 0, (x, y, 0), c)
        for y in range(2)
        for x in range(2)
        for c in (0, 1)
    ]
    mesh = get_mesh((1, 1, 1, 2), cores)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    positions = [[get_coords(d) for d in row] for row in mesh.devices]
    # t5x's order: the tiles run over x, then y (x is the data axis's major part).
    assert positions == [
        [(0, 0, 0, 0), (0, 0, 0, 1)],
        [(0, 1, 0, 0), (0, 1, 0, 1)],
        [(1, 0, 0, 0), (1, 0, 0, 1)],
        [(1, 1, 0, 0), (1, 1, 0, 1)],
    ]


CASES = [
    case(
        lambda: t5x.get_mesh(2),
        T,
        "model_parallel_submesh",
        "int 2",
        r"tuple of sizes",
        id="t5x-get_mesh-submesh-int",
    ),
    case(
        lambda: t5x.get_mesh((1, 1, 2)),
        fe.MeshError,
        "model_parallel_submesh",
        "(1, 1, 2)",
        r"like the hardware mesh \(1, 8\)",
        id="t5x-get_mesh-submesh-rank",
    ),
    case(
        lambda: t5x.get_mesh((1, 2), input_devices=8),
        T,
        "input_devices",
        "int 8",
        r"jax\.devices\(\)\[:8\]",
        id="t5x-get_mesh-devices-count",
    ),
    case(
        lambda: t5x.get_mesh((1, 2), backend="tpuu"),
        fe.EscaleError,
        "backend",
        "'tpuu'",
        "platforms JAX lists",
        id="t5x-get_mesh-backend-unknown",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
