"""t5x's device coordinates and bounds (``flax_escale/t5x/_hardware.py``): ``get_coords`` and
``bounds_from_last_device`` of TPU cores and other devices, of JAX's devices and of stand-ins
with only the attributes they read (as t5x's tests pass them), and the devices the mesh
builders check (naming what a stand-in lacks); their mistakes.
"""

from types import SimpleNamespace
from unittest import mock

import jax
import numpy as np
import pytest
from support.fake_devices import FakeDevice, FakeTpu, HostDevice
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import t5x
from flax_escale.t5x import (
    bounds_from_last_device,
    get_coords,
    get_cpu_mesh,
    get_gpu_mesh,
    get_mesh,
)


@pytest.fixture
def one_process_of_four(monkeypatch):
    """jax reports 1 process of 4 devices, as t5x's tests mock it."""
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    monkeypatch.setattr(jax, "local_device_count", lambda: 4)


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


# --- t5x's stand-ins: bounds_from_last_device and get_coords read only what they need -------


@pytest.mark.parametrize(
    "last",
    [
        mock.Mock(coords=(3, 3, 3), core_on_chip=1),
        SimpleNamespace(coords=(3, 3, 3), core_on_chip=1, platform="tpu"),
        SimpleNamespace(coords=[3, 3, 3], core_on_chip=np.int64(1)),  # a TPU device's types
    ],
    ids=["mock", "coords-core-platform", "list-and-numpy-int"],
)
def test_bounds_of_a_tpu_stand_in(last):
    assert bounds_from_last_device(last) == (4, 4, 4, 2)


@pytest.mark.parametrize(
    "last",
    [
        SimpleNamespace(platform="cpu"),
        SimpleNamespace(platform="gpu", process_index=0, id=3),
        SimpleNamespace(core_on_chip=0, platform="tpu"),  # no chip position: not a TPU core
        SimpleNamespace(coords=(1, 2), core_on_chip=0),  # not an (x, y, z) position
    ],
    ids=["cpu-platform-only", "gpu", "core-without-coords", "two-coords"],
)
def test_bounds_elsewhere_are_processes_by_local_devices(last, one_process_of_four):
    assert bounds_from_last_device(last) == (1, 4)


@pytest.mark.parametrize(
    ("device", "coords"),
    [
        (mock.Mock(coords=(1, 0, 1), core_on_chip=1), (1, 0, 1, 1)),
        (SimpleNamespace(coords=(1, 0, 1), core_on_chip=1, platform="tpu"), (1, 0, 1, 1)),
        # Like t5x, any chip coords are used as they are.
        (SimpleNamespace(coords=(2, 5), core_on_chip=0), (2, 5, 0)),
    ],
    ids=["mock", "coords-core-platform", "two-coords"],
)
def test_get_coords_of_a_tpu_stand_in(device, coords):
    assert get_coords(device) == coords


def test_get_coords_elsewhere_reads_process_and_id(monkeypatch):
    monkeypatch.setattr(jax, "local_device_count", lambda: 8)
    device = mock.Mock(spec=["process_index", "id"])
    device.process_index = 1
    device.id = 9
    assert get_coords(device) == (1, 1)
    assert get_coords(SimpleNamespace(process_index=0, id=13, platform="cpu")) == (0, 5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: get_coords(SimpleNamespace(coords=(1, 0, 1), platform="tpu")),
            r"get_coords: device must be a JAX device.*namespace\(coords=\(1, 0, 1\), "
            r"platform='tpu'\), which has coords but no core_on_chip",
        ),
        (
            lambda: get_coords(SimpleNamespace(platform="cpu")),
            r"get_coords: device .*namespace\(platform='cpu'\), which has no coords and no "
            r"process_index or id\. Pass e\.g\. jax\.devices\(\)\[-1\]",
        ),
        (
            lambda: get_coords(SimpleNamespace(process_index=0)),
            r"namespace\(process_index=0\), which has no coords and no id\.",
        ),
        (
            lambda: get_coords(mock.Mock(coords=(1, 0, 1))),
            r"get_coords: device: its core_on_chip must be an int, got Mock",
        ),
        (
            lambda: get_coords(SimpleNamespace(coords="xyz", core_on_chip=0)),
            r"get_coords: device: its coords must be the chip's position as ints.*str 'xyz'",
        ),
        (
            lambda: get_coords(SimpleNamespace(process_index="0", id=1), local_device_count=4),
            r"get_coords: device: its process_index must be an int, got str '0'",
        ),
        (
            # t5x reads nothing of a non-TPU last device; the library refuses an object with
            # none of a device's attributes rather than answer with this host's box.
            lambda: bounds_from_last_device(mock.Mock(spec=[])),
            r"bounds_from_last_device: last_device must be a JAX device.*Mock.*which has none "
            r"of coords, core_on_chip, platform, process_index, id",
        ),
        (
            lambda: bounds_from_last_device(SimpleNamespace(coords=(3, 3, 3), platform="tpu")),
            r"last_device .*which has coords but no core_on_chip",
        ),
    ],
    ids=[
        "coords-without-core",
        "cpu-without-process-or-id",
        "process-without-id",
        "core-not-an-int",
        "coords-not-ints",
        "process-not-an-int",
        "bounds-of-nothing",
        "bounds-coords-without-core",
    ],
)
def test_stand_ins_without_what_is_read_are_named(call, match):
    with pytest.raises(fe.EscaleTypeError, match=match):
        call()


# --- the mesh builders' devices: stand-ins with what they read, or named for what they lack ---


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: get_mesh((1, 1), [SimpleNamespace(id=0, platform="cpu")]),
            r"input_devices must be a sequence of JAX devices \(or objects with a device's "
            r"process_index, id\), got an entry SimpleNamespace namespace\(id=0, "
            r"platform='cpu'\) without process_index; pass e\.g\. jax\.devices\(\)",
        ),
        (
            lambda: get_mesh((1, 1, 1, 1), [SimpleNamespace(coords=(0, 0, 0), core_on_chip=0)]),
            r"input_devices .*\(or objects with a device's process_index, id, core_on_chip\), "
            r"got an entry .* without process_index or id",
        ),
        (
            lambda: get_gpu_mesh(2, [HostDevice(id=i, process_index=0) for i in range(4)]),
            r"devices .*process_index, id, platform, device_kind\), got an entry "
            r"HostDevice HostDevice\(id=0, process_index=0\) without platform or device_kind",
        ),
        (
            lambda: get_cpu_mesh("cpu"),
            r"devices must be a sequence of JAX devices, got the string 'cpu'; pass "
            r"jax\.devices\('cpu'\)",
        ),
    ],
    ids=["get_mesh-no-process", "get_mesh-core-no-process-or-id", "gpu-no-kind", "string"],
)
def test_mesh_builders_name_what_an_entry_lacks(call, match):
    with pytest.raises(fe.EscaleTypeError, match=match):
        call()


CASES = [
    case(
        lambda: t5x.get_coords(None),
        T,
        "device",
        "None",
        r"jax\.devices\(\)\[-1\]",
        id="t5x-get_coords-none",
    ),
    case(
        lambda: t5x.get_coords(jax.devices()[0], local_device_count=0),
        fe.EscaleError,
        "local_device_count",
        "0",
        "positive int",
        id="t5x-get_coords-count-zero",
    ),
    case(
        lambda: t5x.bounds_from_last_device("cpu:7"),
        T,
        "last_device",
        "'cpu:7'",
        r"jax\.devices\(\)\[-1\]",
        id="t5x-bounds_from_last_device-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
