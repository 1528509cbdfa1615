"""t5x's mesh builders (``flax_escale/t5x/_mesh.py``): ``global_mesh_defined``,
``get_cpu_mesh``, ``get_gpu_mesh`` and ``default_mesh`` (t5x's default tiles, hybrid meshes);
their mistakes.
"""

import warnings

import jax
import numpy as np
import pytest
from support.fake_devices import V3_4X4, V4_2X2X4, HostDevice, hosts, tpu_slice
from support.mistakes import MISTAKE, T, case, raises_a_library_error
from support.t5x_meshes import assert_processes_contiguous, assert_t5x_mesh, ids_of, processes_of

import flax_escale as fe
from flax_escale import t5x
from flax_escale.errors import MeshError
from flax_escale.t5x import (
    default_mesh,
    get_coords,
    get_cpu_mesh,
    get_gpu_mesh,
    get_mesh,
    global_mesh_defined,
)

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


def test_get_cpu_mesh_takes_stand_ins_with_id_and_process():
    devices = [HostDevice(id=i, process_index=i // 4) for i in range(8)]
    mesh = get_cpu_mesh(devices)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]


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
