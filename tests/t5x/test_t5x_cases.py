"""t5x's own cases, with only the import changed: duck-typed devices and ``None`` mesh axes.

t5x's tests and tooling pass stand-ins for devices (objects with a device's ``coords``,
``core_on_chip``, ``platform``, ...) and test the partitioner's specs of step counts and
placeholders with ``is None``. The expected values here are t5x's (read from its
``partitioning.py``, ``adafactor.py`` and ``optimizers.py``); where the library gives more
(Adafactor's factored statistics follow their parameter), the test says so.
"""

import dataclasses
from types import SimpleNamespace
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.t5x import (
    Partitioner,
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


# --- bounds_from_last_device and get_coords read only the attributes they need ----------------


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


# --- mesh builders take stand-ins with what they read -----------------------------------------


@dataclasses.dataclass(frozen=True)
class Core:
    """A TPU core as planning tools describe it: no platform, no kind."""

    id: int
    process_index: int
    coords: tuple[int, int, int]
    core_on_chip: int


@dataclasses.dataclass(frozen=True)
class HostDevice:
    id: int
    process_index: int


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


def test_get_cpu_mesh_takes_stand_ins_with_id_and_process():
    devices = [HostDevice(id=i, process_index=i // 4) for i in range(8)]
    mesh = get_cpu_mesh(devices)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]


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


# --- get_mesh_axes: None for leaves without axis names, as in t5x ---------------------------

# t5x's ModelBasedPartitionerTest: its rules and parameters (here as Flax boxes).
T5X_RULES = (("batch", "data"), ("embed", None), ("vocab", "model"), ("mlp", "model"))
LOGITS = P("model", None)
KERNEL = P(None, "model")


class T5xParams(nn.Module):
    @nn.compact
    def __call__(self, x):
        def param(name, shape, names):
            init = nn.with_logical_partitioning(nn.initializers.ones, names)
            return self.param(name, init, shape)

        logits = param("logits_dense", (16, 16), ("vocab", "embed"))
        kernel = param("kernel", (32, 16), ("embed", "mlp"))
        return x @ logits + kernel.sum()


def t5x_partitioner():
    return Partitioner(mesh=fe.create_mesh((2, 4), ("data", "model")), logical_axis_rules=T5X_RULES)


def t5x_state(tx):
    model = T5xParams()

    def init(key):
        params = model.init(key, jnp.ones((2, 16)))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init


@pytest.mark.parametrize("factored", [True, False])
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_get_mesh_axes_of_an_adafactor_state(factored, momentum):
    tx = optax.adafactor(0.1, min_dim_size_to_factor=8, factored=factored, momentum=momentum)
    axes = t5x_partitioner().get_mesh_axes(jax.eval_shape(t5x_state(tx), jax.random.key(0)))
    assert axes.step is None
    assert axes.params == {"logits_dense": LOGITS, "kernel": KERNEL}
    stats = axes.opt_state[0]
    assert stats.count is None
    if factored:
        # The (1,) placeholders are None, as t5x gives v of a factored parameter.
        assert stats.v == {"logits_dense": None, "kernel": None}
        # t5x gives the factored statistics None; the library's follow their parameter.
        assert stats.v_row == {"logits_dense": P("model"), "kernel": P("model")}
        assert stats.v_col == {"logits_dense": P(None), "kernel": P(None)}
    else:
        assert stats.v == {"logits_dense": LOGITS, "kernel": KERNEL}
        assert stats.v_row == {"logits_dense": None, "kernel": None}
        assert stats.v_col == {"logits_dense": None, "kernel": None}
    averages = [s for s in axes.opt_state if isinstance(s, optax.EmaState)]
    if momentum:
        # t5x's rule for optax's EmaState: no axes for the count, the parameters' for ema.
        (average,) = averages
        assert average.count is None
        assert average.ema == {"logits_dense": LOGITS, "kernel": KERNEL}
    else:
        assert averages == []


def test_names_that_all_stay_unsharded_give_a_spec_not_none():
    # t5x resolves any leaf with logical axes, even when every name maps to None.
    abstract = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    tree = {"w": nn.LogicallyPartitioned(abstract, ("embed", None))}
    assert t5x_partitioner().get_mesh_axes(tree) == {"w": P(None, None)}


def test_an_unnamed_leaf_the_plan_shards_keeps_its_spec():
    # 2 MiB without names: the model axis, which w's names use, is idle on it, and the plan
    # puts it to use (the library's default); None would replicate it. Without idle axes it
    # stays whole and is None, as in t5x.
    w = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((16, 16), jnp.float32), ("embed", "mlp"))
    tree = {"big": jax.ShapeDtypeStruct((1024, 512), jnp.float32), "w": w}
    mesh = fe.create_mesh((2, 4), ("data", "model"))
    assert Partitioner(mesh=mesh, logical_axis_rules=T5X_RULES).get_mesh_axes(tree) == {
        "big": P("model", None),
        "w": KERNEL,
    }
    idle = Partitioner(mesh=mesh, logical_axis_rules=T5X_RULES, use_idle_axes=False)
    assert idle.get_mesh_axes(tree) == {"big": None, "w": KERNEL}


def test_none_mesh_axes_are_replicated_where_the_partitioner_uses_them():
    partitioner = t5x_partitioner()
    init = t5x_state(optax.adafactor(0.1, min_dim_size_to_factor=8))
    axes = partitioner.get_mesh_axes(jax.eval_shape(init, jax.random.key(0)))
    replicated = NamedSharding(partitioner.mesh, P())
    state = partitioner.partition(init, None, axes)(jax.random.key(0))
    host = jax.tree.map(np.asarray, nn.unbox(jax.jit(init)(jax.random.key(0))))
    moved = partitioner.move_params_to_devices(host, axes)
    for placed in (nn.unbox(state), moved):
        for leaf in (placed.step, placed.opt_state[0].count, placed.opt_state[0].v["kernel"]):
            assert leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
        kernel = placed.params["kernel"]
        assert kernel.sharding.is_equivalent_to(NamedSharding(partitioner.mesh, KERNEL), 2)
