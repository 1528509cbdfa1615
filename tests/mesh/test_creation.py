import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import MeshError, calculate_host_mesh_shape, create_cpu_mesh, create_mesh
from flax_escale.errors import EscaleTypeError
from flax_escale.mesh import resolve_axis_dims
from flax_escale.mesh._creation import device_grid, normalize_axis_types


def test_default_mesh_puts_every_device_on_fsdp(devices):
    mesh = create_mesh()
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == ("dp", "fsdp", "ep", "tp", "sp")
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 8, "ep": 1, "tp": 1, "sp": 1}
    assert set(mesh.devices.flat) == set(devices)


@pytest.mark.parametrize(
    ("dims", "expected"),
    [
        ((1, -1, 1, 2, 1), (1, 4, 1, 2, 1)),
        ((2, 2, 1, 2, 1), (2, 2, 1, 2, 1)),
        ((-1, 1, 1, 1, 1), (8, 1, 1, 1, 1)),
        ((2, 1, 1, -1, 2), (2, 1, 1, 2, 2)),
    ],
)
def test_minus_one_takes_the_remaining_devices(dims, expected):
    assert create_mesh(dims).devices.shape == expected


def test_equal_arguments_return_the_same_mesh():
    assert create_mesh((2, -1), ("a", "b")) is create_mesh([2, -1], ["a", "b"])
    assert create_mesh((2, -1), ("a", "b")) is create_mesh((2, 4), ("a", "b"), axis_types="auto")
    assert create_mesh((2, 4), ("a", "b")) is not create_mesh((4, 2), ("a", "b"))
    assert create_mesh((2, 4), ("a", "b")) is not create_mesh(
        (2, 4), ("a", "b"), axis_types="explicit"
    )


def test_later_parameters_are_positional_in_eformers_order():
    # eformer: axis_dims, axis_names, dcn_mesh_dims, should_sort_granules_by_key,
    # allow_split_physical_axes, backend, use_jax, axis_types.
    positional = create_mesh((2, 4), ("dp", "tp"), None, True, True, "cpu", False, "explicit")
    assert positional is create_mesh((2, 4), ("dp", "tp"), backend="cpu", axis_types="explicit")
    assert positional.axis_types == (AxisType.Explicit, AxisType.Explicit)
    with pytest.raises(TypeError, match="positional"):
        create_mesh((2, 4), ("dp", "tp"), None, True, True, "cpu", False, None, ())


def test_devices_builds_a_mesh_on_a_subset(devices):
    subset = devices[4:]
    mesh = create_mesh((2, -1), ("dp", "tp"), devices=subset)
    assert mesh.devices.shape == (2, 2)
    assert set(mesh.devices.flat) == set(subset)


def test_backend_cpu(devices):
    mesh = create_mesh((2, 4), ("dp", "tp"), backend="cpu")
    assert {d.platform for d in mesh.devices.flat} == {"cpu"}


def test_use_jax_builds_the_same_layout_with_jax_make_mesh():
    ours = create_mesh((2, 4), ("dp", "tp"))
    via_jax = create_mesh((2, 4), ("dp", "tp"), use_jax=True)
    assert via_jax.shape == ours.shape
    assert via_jax.axis_names == ("dp", "tp")
    assert via_jax.axis_types == (AxisType.Auto, AxisType.Auto)
    # The same devices at the same positions, as jax.make_mesh itself places them.
    np.testing.assert_array_equal(via_jax.device_ids, ours.device_ids)
    by_jax = jax.make_mesh((2, 4), ("dp", "tp"))
    np.testing.assert_array_equal(via_jax.device_ids, by_jax.device_ids)


@pytest.mark.parametrize(
    ("axis_types", "expected"),
    [
        (None, (AxisType.Auto,) * 2),
        ("auto", (AxisType.Auto,) * 2),
        ("EXPLICIT", (AxisType.Explicit,) * 2),
        ("Manual", (AxisType.Manual,) * 2),
        (AxisType.Explicit, (AxisType.Explicit,) * 2),
        (("explicit", AxisType.Auto), (AxisType.Explicit, AxisType.Auto)),
    ],
)
def test_axis_types(axis_types, expected):
    mesh = create_mesh((2, 4), ("dp", "tp"), axis_types=axis_types)
    assert mesh.axis_types == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"axis_dims": (3, -1)}, r"axis_dims \(3, -1\).*multiply to 3.*does not divide the 8"),
        ({"axis_dims": (2, 2)}, r"axis_dims \(2, 2\) multiply to 4.*mesh has 8 devices"),
        ({"axis_dims": (-1, -1)}, r"at most one axis can be -1"),
        ({"axis_dims": (0, -1)}, r"positive integer or -1.*got 0"),
        ({"axis_dims": (2.0, -1)}, r"positive integer or -1.*got 2.0"),
        ({"axis_dims": (2, 4, 1)}, r"has 3 sizes but axis_names \('a', 'b'\) has 2"),
        ({"axis_names": ("a", "a")}, r"axis_names \('a', 'a'\) must be distinct"),
        ({"axis_types": "fast"}, r"unknown axis type 'fast'.*auto.*explicit.*manual"),
        ({"axis_types": ("auto",)}, r"axis_types has 1 entries.*2"),
        ({"devices": []}, r"devices is empty"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    arguments = {"axis_dims": (2, 4), "axis_names": ("a", "b"), **kwargs}
    with pytest.raises(MeshError, match=match):
        create_mesh(**arguments)


def test_axis_type_of_wrong_type_is_a_type_error():
    with pytest.raises(EscaleTypeError, match=r"AxisType or a string, got int 3"):
        normalize_axis_types(3, ("a",))


def test_resolve_axis_dims():
    assert resolve_axis_dims((2, -1, 1), 8) == (2, 4, 1)
    assert resolve_axis_dims((np.int64(8),), 8) == (8,)
    with pytest.raises(MeshError, match=r"axis_dims \(True,\)"):
        resolve_axis_dims((True,), 1)


@pytest.mark.parametrize(
    ("global_shape", "local", "processes", "expected"),
    [
        ((2, 4), 4, 2, (1, 4)),
        ((2, 2, 2), 2, 4, (1, 1, 2)),
        ((1, 8, 1, 1, 1), 4, 2, (1, 4, 1, 1, 1)),
        ((2, 2, 1, 2, 1), 4, 2, (1, 2, 1, 2, 1)),
        ((3, 4), 6, 2, (3, 2)),
        ((-1, 4), 4, 4, (1, 4)),
        ((8,), 8, 1, (8,)),
    ],
)
def test_calculate_host_mesh_shape(global_shape, local, processes, expected):
    host = calculate_host_mesh_shape(global_shape, total_devices=local, num_processes=processes)
    assert host == expected
    assert int(np.prod(host)) == local


def test_calculate_host_mesh_shape_defaults_to_this_process():
    assert calculate_host_mesh_shape((2, 4)) == (2, 4)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (((2, 4), 4, 1), r"axis_dims \(2, 4\) multiply to 8, but the mesh has 4 devices"),
        (((3, -1), 4, 2), r"multiply to 3, which does not divide the 8 devices"),
        (((2, 4), 0, 2), r"total_devices=0 and num_processes=2 must both be positive"),
    ],
)
def test_calculate_host_mesh_shape_errors(args, match):
    with pytest.raises(MeshError, match=match):
        calculate_host_mesh_shape(*args)


def test_create_cpu_mesh(devices):
    mesh = create_cpu_mesh((2, -1), ("dp", "tp"), axis_types="explicit")
    assert mesh.devices.shape == (2, 4)
    assert {d.platform for d in mesh.devices.flat} == {"cpu"}
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert create_cpu_mesh().axis_names == ("dp", "fsdp", "ep", "tp", "sp")


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands in for an accelerator device on another host or slice."""

    id: int
    process_index: int
    slice_index: int | None = None
    platform: str = "cpu"
    device_kind: str = "cpu"


def _fake_devices(hosts: int, per_host: int, *, slices: bool = False) -> list[FakeDevice]:
    return [
        FakeDevice(
            id=h * per_host + i,
            process_index=h,
            slice_index=h if slices else None,
        )
        for h in reversed(range(hosts))  # out of order: granules must be sorted by key
        for i in range(per_host)
    ]


def _host_of_each_position(grid: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(grid)


@pytest.mark.parametrize("slices", [False, True])
def test_several_processes_or_slices_build_a_hybrid_grid(slices):
    devices = _fake_devices(hosts=2, per_host=4, slices=slices)
    grid = device_grid((1, 8, 1, 1, 1), devices)
    hosts = _host_of_each_position(grid).reshape(8)
    # The inferred DCN axis is fsdp: each host holds a contiguous half of it, in host order.
    np.testing.assert_array_equal(hosts, [0, 0, 0, 0, 1, 1, 1, 1])


def test_hybrid_grid_keeps_tensor_parallel_inside_a_host():
    devices = _fake_devices(hosts=2, per_host=4)
    grid = device_grid((2, 2, 1, 2, 1), devices)
    hosts = _host_of_each_position(grid)
    # dp crosses hosts; fsdp and tp stay inside one.
    assert (hosts[0] == 0).all()
    assert (hosts[1] == 1).all()


def test_explicit_dcn_mesh_dims():
    devices = _fake_devices(hosts=2, per_host=4)
    grid = device_grid((1, 2, 1, 4, 1), devices, dcn_mesh_dims=(1, 1, 1, 2, 1))
    hosts = _host_of_each_position(grid)
    # Here tp is the axis that crosses hosts, as asked.
    np.testing.assert_array_equal(hosts[0, 0, 0, :, 0], [0, 0, 1, 1])
    np.testing.assert_array_equal(hosts[0, 1, 0, :, 0], [0, 0, 1, 1])


@pytest.mark.parametrize(
    ("dcn", "match"),
    [
        ((1, 3, 1, 1, 1), r"dcn_mesh_dims \(1, 3, 1, 1, 1\) must have one positive size"),
        ((1, 2, 1), r"must have one positive size per axis"),
        ((1, 1, 1, 1, 1), r"multiply to 1, but the devices span 2 processes"),
    ],
)
def test_bad_dcn_mesh_dims(dcn, match):
    with pytest.raises(MeshError, match=match):
        device_grid((1, 8, 1, 1, 1), _fake_devices(hosts=2, per_host=4), dcn_mesh_dims=dcn)


def test_dcn_mesh_dims_on_one_process_must_be_trivial(devices):
    with pytest.raises(MeshError, match=r"span 1 processes"):
        create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(2, 1))
    mesh = create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(1, 1))
    assert mesh.devices.shape == (2, 4)


def test_mesh_is_usable_for_sharding(devices):
    mesh = create_mesh((2, 4), ("dp", "tp"))
    x = jax.device_put(
        np.arange(32.0).reshape(4, 8),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", "tp")),
    )
    assert x.addressable_shards[0].data.shape == (2, 2)


CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fe.create_mesh((2, 4), "dp"),
        T,
        "axis_names",
        "'dp'",
        r"pass \('dp',\)",
        id="create_mesh-names-string",
    ),
    case(
        lambda: fe.create_mesh((8,), "data"),
        T,
        "axis_names",
        "'data'",
        r"pass \('data',\)",
        id="create_mesh-one-name-string",
    ),
    case(
        lambda: fe.create_cpu_mesh((8,), "dp"),
        T,
        "axis_names",
        "'dp'",
        r"pass \('dp',\)",
        id="create_cpu_mesh-names-string",
    ),
    # --- wrong entries inside a sequence of names ------------------------------------------
    case(
        lambda: fe.create_mesh((2, 4), ("dp", 4)),
        T,
        "axis_names",
        "int 4",
        "not a string",
        id="create_mesh-name-int",
    ),
    case(
        lambda: fe.create_mesh((2, 4), None),
        T,
        "axis_names",
        "None",
        r"\('dp', 'tp'\)",
        id="create_mesh-names-none",
    ),
    # --- a wrong type where sizes are expected ---------------------------------------------
    case(lambda: fe.create_mesh(8), T, "axis_dims", "8", r"pass \(8,\)", id="create_mesh-int"),
    case(lambda: fe.create_mesh(None), T, "axis_dims", "None", r"\(2, 4\)", id="create_mesh-none"),
    case(
        lambda: fe.create_mesh("2,4", ("dp", "tp")),
        T,
        "axis_dims",
        "'2,4'",
        "parse_mesh_from_string",
        id="create_mesh-dims-string",
    ),
    case(
        lambda: fe.create_mesh((2, None), ("dp", "tp")),
        T,
        "axis_dims",
        "None",
        "not an int",
        id="create_mesh-dim-none",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=1),
        T,
        "dcn_mesh_dims",
        "1",
        r"pass \(1,\)",
        id="create_mesh-dcn-int",
    ),
    case(
        lambda: fe.create_mesh({"dp": 2, "tp": 4}),
        T,
        "axis_dims",
        "{'dp': 2, 'tp': 4}",
        r"\(2, 4\)",
        id="create_mesh-dict",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), devices="cpu"),
        T,
        "devices",
        "'cpu'",
        r"jax\.devices\('cpu'\)",
        id="create_mesh-devices-string",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), devices=8),
        T,
        "devices",
        "int 8",
        r"jax\.devices\(\)\[:8\]",
        id="create_mesh-devices-count",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), devices=["cpu:0", "cpu:1"]),
        T,
        "devices",
        "'cpu:0'",
        r"jax\.devices\(\)",
        id="create_mesh-devices-names",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), backend="tpuu"),
        fe.EscaleError,
        "backend",
        "'tpuu'",
        "platforms JAX lists",
        id="create_mesh-backend-unknown",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), backend=1),
        T,
        "backend",
        "int 1",
        "'cpu'",
        id="create_mesh-backend-int",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "")),
        fe.EscaleError,
        "axis_names",
        "''",
        "a name such as 'dp'",
        id="create_mesh-name-empty",
    ),
    case(
        lambda: fe.create_cpu_mesh(8),
        T,
        "axis_dims",
        "8",
        r"pass \(8,\)",
        id="create_cpu_mesh-int",
    ),
    # --- dcn_mesh_dims: ints, never truncated ----------------------------------------------
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(1.5, 1)),
        T,
        "dcn_mesh_dims",
        "float 1.5",
        r"pass one int per axis",
        id="create_mesh-dcn-float",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(np.float64(1.7), 1)),
        T,
        "dcn_mesh_dims",
        "1.7",
        r"pass one int per axis",
        id="create_mesh-dcn-numpy-float",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(1.0, 1)),
        T,
        "dcn_mesh_dims",
        "float 1.0",
        r"pass the int 1",
        id="create_mesh-dcn-whole-float",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(float("nan"), 1)),
        T,
        "dcn_mesh_dims",
        "nan",
        r"pass one int per axis",
        id="create_mesh-dcn-nan",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(float("inf"), 1)),
        T,
        "dcn_mesh_dims",
        "inf",
        r"pass one int per axis",
        id="create_mesh-dcn-inf",
    ),
    case(
        lambda: fe.create_mesh((2, 4), ("dp", "tp"), dcn_mesh_dims=(0, 1)),
        fe.MeshError,
        "dcn_mesh_dims",
        "got 0",
        "positive int",
        id="create_mesh-dcn-zero",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
