import itertools
import math
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from support.fake_devices import FakeDevice, FakeTpu
from support.mistakes import (
    MISTAKE,
    T,
    case,
    raises_a_library_error,
)

import flax_escale as fe
from flax_escale import t5x
from flax_escale.errors import EscaleTypeError, MeshError
from flax_escale.t5x import (
    bounds_from_last_device,
    default_mesh,
    get_coords,
    get_cpu_mesh,
    get_gpu_mesh,
    get_mesh,
    global_mesh_defined,
)
from flax_escale.t5x._chunks import process_blocks


def hosts(processes: int, per_process: int, *, id_stride: int | None = None) -> list[FakeDevice]:
    stride = per_process if id_stride is None else id_stride
    return [
        FakeDevice(id=p * stride + i, process_index=p)
        for p in range(processes)
        for i in range(per_process)
    ]


def tpu_slice(
    kind: str,
    chips: tuple[int, int, int],
    cores: int,
    host: tuple[int, int, int],
    *,
    slice_index: int = 0,
    first_process: int = 0,
) -> list[FakeTpu]:
    """A slice whose hosts each own a `host`-shaped block of chips, with all their cores."""
    host_grid = tuple(c // h for c, h in zip(chips, host, strict=True))
    found = []
    for xyz in itertools.product(*map(range, chips)):
        process = int(
            np.ravel_multi_index(tuple(c // h for c, h in zip(xyz, host, strict=True)), host_grid)
        )
        found += [(first_process + process, xyz, core) for core in range(cores)]
    found.sort(key=lambda entry: (entry[0], entry[1][::-1], entry[2]))
    first_id = first_process * math.prod(host) * cores
    return [
        FakeTpu(first_id + i, p, xyz, core, device_kind=kind, slice_index=slice_index)
        for i, (p, xyz, core) in enumerate(found)
    ]


V3_4X4 = tpu_slice("TPU v3", (4, 4, 1), 2, (2, 2, 1))  # 4 hosts of 2x2 chips, 2 cores each
V4_2X2X4 = tpu_slice("TPU v4", (2, 2, 4), 1, (2, 2, 1))  # 4 hosts stacked along z


def coords_of(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: get_coords(d), otypes=[object])(mesh.devices)


def processes_of(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def ids_of(mesh: Mesh) -> list[list[int]]:
    return [[d.id for d in row] for row in mesh.devices]


def assert_processes_contiguous(mesh: Mesh) -> None:
    blocks = process_blocks(mesh.devices)
    assert None not in blocks.values(), blocks


def assert_t5x_mesh(mesh: Mesh, shape: tuple[int, ...], names=("data", "model")) -> None:
    assert mesh.axis_names == names
    assert mesh.devices.shape == shape
    assert mesh.axis_types == (AxisType.Auto,) * len(names)


# --- get_coords / bounds_from_last_device ----------------------------------------------------


def test_get_coords_of_a_tpu_core_is_chip_position_and_core():
    device = FakeTpu(id=9, process_index=1, coords=(1, 2, 3), core_on_chip=1)
    assert get_coords(device) == (1, 2, 3, 1)


def test_get_coords_elsewhere_is_process_and_position_in_it(devices):
    assert get_coords(FakeDevice(id=6, process_index=1), local_device_count=4) == (1, 2)
    assert get_coords(devices[5]) == (0, 5)  # defaults to jax.local_device_count()


def test_bounds_from_last_device_of_a_tpu_slice():
    last = FakeTpu(id=31, process_index=3, coords=(3, 3, 0), core_on_chip=1)
    assert bounds_from_last_device(last) == (4, 4, 1, 2)


def test_bounds_from_last_device_elsewhere_is_processes_by_local_devices(devices):
    assert bounds_from_last_device(devices[-1]) == (1, 8)
    last = FakeDevice(id=7, process_index=1)
    assert bounds_from_last_device(last, process_count=2, local_device_count=4) == (2, 4)


# --- global_mesh_defined ---------------------------------------------------------------------


def test_global_mesh_defined_sees_set_mesh_inside_and_outside_jit():
    mesh = get_cpu_mesh()
    assert not global_mesh_defined()
    seen = []

    @jax.jit
    def f(x):
        seen.append(global_mesh_defined())
        return x

    with jax.set_mesh(mesh):
        assert global_mesh_defined()
        f(1.0)
    assert seen == [True]
    assert not global_mesh_defined()


def test_global_mesh_defined_sees_the_legacy_mesh_context():
    mesh = get_cpu_mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            assert global_mesh_defined()
    assert not global_mesh_defined()


# --- get_cpu_mesh ----------------------------------------------------------------------------


def test_get_cpu_mesh_on_the_simulated_devices(devices):
    mesh = get_cpu_mesh()
    assert_t5x_mesh(mesh, (1, 8))
    assert list(mesh.devices[0]) == list(devices)


def test_get_cpu_mesh_puts_one_process_per_row_in_id_order():
    # Multi-process CPU device ids are process * 2048 + i; the input order must not matter.
    devices = hosts(2, 3, id_stride=2048)
    mesh = get_cpu_mesh(devices[::-1])
    assert_t5x_mesh(mesh, (2, 3))
    assert ids_of(mesh) == [[0, 1, 2], [2048, 2049, 2050]]


def test_get_cpu_mesh_places_devices_at_their_coords_when_ids_are_consecutive():
    mesh = get_cpu_mesh(hosts(4, 2))
    for position in np.ndindex(mesh.devices.shape):
        assert get_coords(mesh.devices[position], local_device_count=2) == position


def test_get_cpu_mesh_rejects_uneven_processes():
    with pytest.raises(MeshError, match=r"unevenly over processes \(devices per process: "):
        get_cpu_mesh(hosts(2, 4)[:-1])


def test_get_cpu_mesh_rejects_no_devices():
    with pytest.raises(MeshError, match="devices is empty"):
        get_cpu_mesh([])


# --- get_gpu_mesh ----------------------------------------------------------------------------


def test_get_gpu_mesh_keeps_a_small_model_axis_inside_a_process():
    mesh = get_gpu_mesh(2, hosts(2, 4))
    assert_t5x_mesh(mesh, (4, 2))
    assert ids_of(mesh) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_get_gpu_mesh_fills_processes_before_spanning_them():
    mesh = get_gpu_mesh(8, hosts(4, 4))
    assert_t5x_mesh(mesh, (2, 8))
    np.testing.assert_array_equal(processes_of(mesh), [[0] * 4 + [1] * 4, [2] * 4 + [3] * 4])
    assert ids_of(mesh)[0] == list(range(8))


@pytest.mark.parametrize(
    ("processes", "per_process", "num_partitions"),
    [(1, 8, 1), (1, 8, 8), (2, 4, 1), (2, 4, 4), (2, 4, 8), (4, 4, 2), (4, 4, 16), (4, 2, 4)],
)
def test_get_gpu_mesh_model_groups_use_as_few_processes_as_possible(
    processes, per_process, num_partitions
):
    mesh = get_gpu_mesh(num_partitions, hosts(processes, per_process))
    assert_t5x_mesh(mesh, (processes * per_process // num_partitions, num_partitions))
    spanned = {len(set(row)) for row in processes_of(mesh)}
    assert spanned == {max(1, num_partitions // per_process)}
    assert_processes_contiguous(mesh)


def test_get_gpu_mesh_on_the_simulated_devices(devices):
    mesh = get_gpu_mesh(4)
    assert_t5x_mesh(mesh, (2, 4))
    assert set(mesh.devices.flat) == set(devices)


@pytest.mark.parametrize("num_partitions", [3, 6])
def test_get_gpu_mesh_rejects_partitions_that_do_not_fit_a_process(num_partitions):
    with pytest.raises(
        MeshError, match=rf"num_partitions={num_partitions} must be a factor or a multiple of the 4"
    ):
        get_gpu_mesh(num_partitions, hosts(2, 4))


def test_get_gpu_mesh_rejects_partitions_that_do_not_fit_the_processes():
    with pytest.raises(MeshError, match=r"spans 4 processes .* 2 processes cannot be grouped by 4"):
        get_gpu_mesh(16, hosts(2, 4))
    with pytest.raises(MeshError, match=r"3 processes cannot be grouped by 2"):
        get_gpu_mesh(8, hosts(3, 4))


@pytest.mark.parametrize("num_partitions", [0, -2, 2.0, None])
def test_get_gpu_mesh_rejects_a_bad_num_partitions(num_partitions):
    with pytest.raises(MeshError, match="num_partitions must be a positive integer"):
        get_gpu_mesh(num_partitions, hosts(2, 4))


def test_get_gpu_mesh_rejects_uneven_processes():
    with pytest.raises(MeshError, match="unevenly over processes"):
        get_gpu_mesh(2, hosts(2, 4)[1:])


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


# --- default_mesh ----------------------------------------------------------------------------


def test_default_mesh_on_cpu_is_the_cpu_mesh_whatever_the_partitions():
    assert default_mesh(1) == get_cpu_mesh()
    assert default_mesh(4) == get_cpu_mesh()
    assert default_mesh(4, backend="cpu") == get_cpu_mesh()


def test_default_mesh_rejects_no_devices():
    with pytest.raises(MeshError, match="devices is empty"):
        default_mesh(1, devices=[])


def test_default_mesh_on_gpu_is_the_gpu_mesh():
    devices = hosts(2, 4)
    assert default_mesh(4, devices=devices) == get_gpu_mesh(4, devices)


def test_default_mesh_with_a_submesh_is_get_mesh():
    assert default_mesh(8, (2, 1, 1, 2), devices=V3_4X4) == get_mesh((2, 1, 1, 2), V3_4X4)


V4_4X4X4 = tpu_slice("TPU v4", (4, 4, 4), 1, (2, 2, 1))


@pytest.mark.parametrize(
    ("devices", "num_partitions", "submesh"),
    [
        (V3_4X4, 1, (1, 1, 1, 1)),
        (V3_4X4, 2, (1, 1, 1, 2)),
        (V3_4X4, 4, (2, 1, 1, 2)),
        (V3_4X4, 8, (2, 2, 1, 2)),
        (V3_4X4, 16, (4, 2, 1, 2)),
        (tpu_slice("TPU v2", (2, 2, 1), 2, (2, 2, 1)), 2, (1, 1, 1, 2)),
        (V4_4X4X4, 1, (1, 1, 1, 1)),
        (V4_4X4X4, 2, (1, 2, 1, 1)),
        (V4_4X4X4, 4, (4, 1, 1, 1)),
        (V4_4X4X4, 8, (4, 2, 1, 1)),
        (V4_4X4X4, 16, (4, 4, 1, 1)),
        (V4_2X2X4, 4, (2, 2, 1, 1)),
        (V4_2X2X4, 16, (2, 2, 4, 1)),
        (tpu_slice("TPU v4", (8, 2, 1), 1, (2, 2, 1)), 16, (8, 2, 1, 1)),
        (tpu_slice("TPU v4 lite", (2, 2, 8), 1, (2, 2, 1)), 8, (1, 1, 8, 1)),
        (tpu_slice("TPU v4", (2, 2, 16), 1, (2, 2, 1)), 16, (1, 1, 16, 1)),
    ],
)
def test_default_mesh_on_tpu_uses_t5x_default_tiles(devices, num_partitions, submesh):
    mesh = default_mesh(num_partitions, devices=devices)
    assert mesh == get_mesh(submesh, devices)
    assert mesh.devices.shape[1] == num_partitions


@pytest.mark.parametrize(
    ("devices", "num_partitions", "detail"),
    [
        (V3_4X4, 32, r"device kind 'TPU v3', num_partitions=32 and hardware mesh \(4, 4, 1, 2\)"),
        (tpu_slice("TPU v4", (2, 2, 1), 2, (2, 2, 1)), 2, r"hardware mesh \(2, 2, 1, 2\)"),
        (tpu_slice("TPU v5 lite", (2, 2, 1), 1, (2, 2, 1)), 4, r"device kind 'TPU v5 lite'"),
    ],
)
def test_default_mesh_without_a_tpu_default_asks_for_a_submesh(devices, num_partitions, detail):
    with pytest.raises(
        MeshError, match=rf"no default mesh .*{detail}.*Pass model_parallel_submesh"
    ):
        default_mesh(num_partitions, devices=devices)


def test_default_mesh_hybrid_on_the_simulated_devices():
    mesh = default_mesh(1, ici_mesh_shape=(1, 4, 2), dcn_mesh_shape=(1, 1, 1))
    assert_t5x_mesh(mesh, (1, 4, 2), ("replica", "data", "model"))


def test_default_mesh_hybrid_uses_processes_as_granules_without_slices():
    mesh = default_mesh(1, ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1), devices=hosts(2, 4))
    assert_t5x_mesh(mesh, (2, 2, 2), ("replica", "data", "model"))
    np.testing.assert_array_equal(processes_of(mesh)[:, 0, 0], [0, 1])
    assert {int(p) for p in processes_of(mesh)[1].flat} == {1}


def test_default_mesh_hybrid_uses_tpu_slices_as_granules():
    devices = [
        *tpu_slice("TPU v4", (2, 2, 2), 1, (2, 2, 1), slice_index=1, first_process=2),
        *tpu_slice("TPU v4", (2, 2, 2), 1, (2, 2, 1), slice_index=0),
    ]
    mesh = default_mesh(1, ici_mesh_shape=(1, 4, 2), dcn_mesh_shape=(2, 1, 1), devices=devices)
    assert_t5x_mesh(mesh, (2, 4, 2), ("replica", "data", "model"))
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    np.testing.assert_array_equal(slices[:, 0, 0], [0, 1])
    assert set(slices[0].flat) == {0}


def test_default_mesh_hybrid_needs_both_shapes():
    with pytest.raises(MeshError, match=r"dcn_mesh_shape=None: give both"):
        default_mesh(1, ici_mesh_shape=(1, 4, 2))


@pytest.mark.parametrize(
    ("ici", "dcn", "message"),
    [
        ((4, 2), (1, 1, 1), r"ici_mesh_shape=\(4, 2\) must be 3 positive sizes"),
        ((1, 4, 2), (1, 0, 1), r"dcn_mesh_shape=\(1, 0, 1\) must be 3 positive sizes"),
        ((2, 4, 2), (1, 1, 1), r"needs 16 devices, but there are 8"),
        ((1, 1, 2), (4, 1, 1), r"has 4 granules, but the devices span 0 slice\(s\) and 2 process"),
    ],
)
def test_default_mesh_hybrid_rejects_shapes_that_do_not_fit(ici, dcn, message):
    with pytest.raises(MeshError, match=message):
        default_mesh(1, ici_mesh_shape=ici, dcn_mesh_shape=dcn, devices=hosts(2, 4))


CASES = [
    case(
        lambda: t5x.default_mesh(0),
        fe.EscaleError,
        "num_partitions",
        "0",
        "positive int",
        id="t5x-default_mesh-zero-partitions",
    ),
    case(
        lambda: t5x.default_mesh("2"),
        T,
        "num_partitions",
        "'2'",
        "pass the int 2",
        id="t5x-default_mesh-partitions-string",
    ),
    case(
        lambda: t5x.default_mesh(2, devices=8),
        T,
        "devices",
        "int 8",
        r"jax\.devices\(\)\[:8\]",
        id="t5x-default_mesh-devices-count",
    ),
    case(
        lambda: t5x.get_cpu_mesh("cpu"),
        T,
        "devices",
        "'cpu'",
        r"jax\.devices\('cpu'\)",
        id="t5x-get_cpu_mesh-devices-string",
    ),
    case(
        lambda: t5x.get_gpu_mesh(2, jax.devices()[0]),
        T,
        "devices",
        "CpuDevice",
        r"jax\.devices\(\)",
        id="t5x-get_gpu_mesh-one-device",
    ),
    case(
        lambda: t5x.get_gpu_mesh("2"),
        fe.MeshError,
        "num_partitions",
        "'2'",
        "positive integer",
        id="t5x-get_gpu_mesh-partitions-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
