"""Targets: compiling for the hardware a user will rent, from this CPU-only machine.

A TPU slice is described by JAX (``jax.experimental.topologies``) and compiled for with
``libtpu``, which the test environment installs; nothing runs on it. A program compiled for a
target's mesh has the figures of the same program laid out by the user on the slice's devices;
the planner on a TPU target: ``tests/sizing/test_plan_mesh_tpu.py``.
"""

import importlib.util

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import mesh as fem
from flax_escale.mesh import TPU_GENERATIONS, Target
from flax_escale.mesh import _target as target_module

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler is not installed: pip install "flax-escale[tpu]"',
)

# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "topology", "chips", "memory"),
    [
        ("v5p-8", "v5p:2x2x1", 4, 95 * 10**9),
        ("v5p-128", "v5p:4x4x4", 64, 95 * 10**9),
        ("v5e-8", "v5e:2x4", 8, 16 * 10**9),
        ("v5e-256", "v5e:16x16", 256, 16 * 10**9),
        ("v6e-64", "v6e:8x8", 64, 32 * 10**9),
        ("v5e:2x4", "v5e:2x4", 8, 16 * 10**9),
    ],
)
def test_a_tpu_name_gives_its_topology_chips_and_memory(name, topology, chips, memory):
    target = Target.named(name)
    assert (target.platform, target.topology, target.device_count) == ("tpu", topology, chips)
    assert target.memory_bytes == memory
    assert target.profile in fe.sizing.PROFILES
    assert target.compiler_options == {}
    assert topology in target.label
    assert "TPU compiler" in target.label


def test_the_slice_describes_as_many_devices_as_it_has_chips():
    for name in ("v5e-8", "v5p-16", "v6e-4"):
        target = Target.named(name)
        devices = target.devices()
        assert len(devices) == target.device_count
        assert {d.platform for d in devices} == {"tpu"}


def test_cpu_is_simulated_devices_labelled_as_such():
    target = Target.named("cpu", devices=8)
    assert target.label == "XLA:CPU, 8 simulated devices"
    assert target.memory_bytes is None
    assert target.devices() == jax.devices("cpu")[:8]
    assert target.compiler_options == {"xla_backend_optimization_level": 0}
    assert Target.named(target) is target


@pytest.mark.parametrize(("gpu", "memory"), [("h100", 80 * 10**9), ("h200", 141 * 10**9)])
def test_a_gpu_name_is_simulated_cpu_devices_with_the_gpus_memory_and_profile(gpu, memory):
    # No GPU compiler runs without a GPU: XLA:CPU compiles, and the label says so.
    target = Target.named(f"{gpu}-8")
    assert (target.platform, target.device_count, target.topology) == ("cpu", 8, None)
    assert (target.memory_bytes, target.profile) == (memory, gpu)
    assert fe.sizing.PROFILES[gpu].memory_bytes == memory
    assert target.label == f"XLA:CPU, 8 simulated devices standing in for {gpu}-8's GPUs"
    assert target.devices() == jax.devices("cpu")[:8]
    assert Target.named(f"{gpu}-8", devices=8) == target
    assert Target(**target.as_json()) == target  # as the planner's child rebuilds it


def test_slices_join_over_dcn_with_data_parallelism_across_them():
    target = Target.named("v5e-8", slices=2)
    assert target.device_count == 16
    assert "2 slices over DCN" in target.label
    mesh = target.mesh((2, 4, 1, 2, 1))
    slice_of = {d.id: d.slice_index for d in mesh.devices.flat}
    for dp in range(2):
        assert {slice_of[d.id] for d in mesh.devices[dp].flat} == {dp}
    with pytest.raises(fe.EscaleError, match=r"first axis \('dp'.*spans the 2 slices.*multiple"):
        target.mesh((1, 8, 1, 2, 1))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: Target.named("v7-8"), fe.EscaleError, r"unknown target 'v7-8'.*v5e-N"),
        (lambda: Target.named("v5p-6"), fe.EscaleError, r"'v5p-6' is not a v5p slice.*v5p-8"),
        (lambda: Target.named("v5e-12"), fe.EscaleError, r"not a v5e slice.*v5e-8, v5e-16"),
        (lambda: Target.named("v5e-8", devices=16), fe.EscaleError, r"devices=16 disagrees.*8"),
        (lambda: Target.named("cpu"), fe.EscaleError, r"pass devices=N"),
        (lambda: Target.named("cpu", devices=8, slices=2), fe.EscaleError, r"pass slices=1"),
        (lambda: Target.named(8), fe.EscaleTypeError, r"target must be a name.*got int 8"),
        (lambda: Target.named("v5e-8", slices=0), fe.EscaleError, r"slices"),
        (lambda: Target.named("b200-8"), fe.EscaleError, r"'b200-8': the GPU targets are 'a100-N'"),
        (lambda: Target.named("gpu"), fe.EscaleError, r"'h100-N'.*profile=HardwareProfile"),
        (lambda: Target.named("h100-0"), fe.EscaleError, r"'h100-0'.*from 1 to 4096.*'h100-8'"),
        (lambda: Target.named("h100-8", devices=4), fe.EscaleError, r"has 8 GPUs.*'h100-4'"),
        (lambda: Target.named("h100-8", slices=2), fe.EscaleError, r"slices.*pass slices=1"),
        (lambda: Target.named("cpu", devices=64).devices(), fe.EscaleError, r"has 8; set jax"),
    ],
)
def test_mistakes_name_the_argument_and_the_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_missing_tpu_compiler_names_the_extra(monkeypatch):
    from jax.experimental import topologies

    def refuse(*args, **kwargs):
        raise RuntimeError("Unable to initialize backend 'tpu'")

    monkeypatch.setattr(topologies, "get_topology_desc", refuse)
    monkeypatch.setattr(target_module, "_has_libtpu", lambda: False)
    target_module._topology_devices.cache_clear()
    try:
        with pytest.raises(fe.EscaleError, match=r'needs libtpu.*pip install "flax-escale\[tpu\]"'):
            Target.named("v5e-4").devices()
    finally:
        target_module._topology_devices.cache_clear()


def test_agreeing_counts_beside_a_target_are_accepted():
    target = fe.mesh.Target.named("cpu", devices=2)
    assert fe.mesh.Target.named(target, devices=2, slices=1) is target


def test_every_generation_names_a_profile_with_its_memory():
    for generation in TPU_GENERATIONS.values():
        assert fe.sizing.PROFILES[generation.profile].memory_bytes == generation.memory_bytes


# --- one program, compiled for the target -------------------------------------------------------


def _step(w, x):
    return jnp.sum(jnp.tanh(x @ w))


def test_will_it_fit_compiles_for_the_target_with_the_arguments_layout():
    cpu_mesh = fe.create_mesh((1, 8, 1, 1, 1))
    w = jax.ShapeDtypeStruct((2048, 1024), jnp.float32, sharding=NamedSharding(cpu_mesh, P("fsdp")))
    x = jax.ShapeDtypeStruct((64, 2048), jnp.float32, sharding=NamedSharding(cpu_mesh, P()))
    estimate = fe.will_it_fit(jax.grad(_step), w, x, target="v5e-8")
    # The same program, laid out by the user on a mesh of the slice's devices.
    target = Target.named("v5e-8")
    mesh = target.mesh((1, 8, 1, 1, 1))
    on_tpu = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec))
        for a in (w, x)
    ]
    direct = jax.jit(jax.grad(_step)).lower(*on_tpu).compile()
    analysis = direct.memory_analysis()
    assert estimate.backend == "tpu"
    assert estimate.device_bytes == 16 * 10**9
    assert estimate.fits
    assert (
        estimate.argument_bytes
        == analysis.argument_size_in_bytes
        == (2048 * 1024 * 4) // 8 + (64 * 2048 * 4)
    )
    assert estimate.temp_bytes == analysis.temp_size_in_bytes
    assert estimate.output_bytes == analysis.output_size_in_bytes


def test_will_it_fit_refuses_a_mesh_of_another_device_count():
    mesh = fe.create_mesh((1, 4, 1, 1, 1), devices=jax.devices()[:4])
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    with pytest.raises(fe.EscaleError, match=r"'v5e-8' has 8 devices but an argument.*mesh of 4"):
        fe.will_it_fit(jax.grad(_step), w, w, target="v5e-8")


def test_lower_init_on_a_target_mesh_holds_the_planned_share():
    model = nn.Dense(
        4096,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        ),
    )
    mesh = Target.named("v5e-8").mesh((1, 4, 1, 2, 1))
    args = (jax.random.key(0), jnp.zeros((8, 1024)))
    plan = fe.plan_sharding(model, mesh, *args)
    compiled = fe.lower_init(model, mesh, *args).compile()
    assert compiled.memory_analysis().output_size_in_bytes == plan.nbytes_per_device
    assert plan.nbytes_per_device == 1024 * 4096 * 4 // 8


CASES = [
    # --- Target built by hand: counts, slices and memory -----------------------------------
    case(
        lambda: fem.Target("x", "cpu", 0),
        fe.EscaleError,
        "device_count",
        "0",
        "positive int",
        id="Target-device-count-zero",
    ),
    case(
        lambda: fem.Target("x", "cpu", float("nan")),
        T,
        "device_count",
        "float nan",
        "positive int",
        id="Target-device-count-nan",
    ),
    case(
        lambda: fem.Target("x", "cpu", True),
        T,
        "device_count",
        "bool True",
        "positive int",
        id="Target-device-count-bool",
    ),
    case(
        lambda: fem.Target("x", "cpu", 2, slices=0),
        fe.EscaleError,
        "slices",
        "0",
        "positive int",
        id="Target-slices-zero",
    ),
    case(
        lambda: fem.Target("x", "tpu", 8, "v5e:2x4", slices=3),
        fe.EscaleError,
        "slices",
        "3",
        "multiple of slices",
        id="Target-slices-not-dividing",
    ),
    case(
        lambda: fem.Target("x", "cpu", 8, slices=2),
        fe.EscaleError,
        "slices",
        "2",
        "pass slices=1",
        id="Target-cpu-slices",
    ),
    case(
        lambda: fem.Target("x", "gpu", 8),
        fe.EscaleError,
        "platform",
        "'gpu'",
        "'cpu' or 'tpu'",
        id="Target-platform-unknown",
    ),
    case(
        lambda: fem.Target("x", "tpu", 8),
        T,
        "topology",
        "None",
        "'v5e:2x4'",
        id="Target-tpu-no-topology",
    ),
    case(
        lambda: fem.Target("x", "cpu", 8, memory_bytes=-1),
        fe.EscaleError,
        "memory_bytes",
        "-1",
        "positive int",
        id="Target-memory-negative",
    ),
    case(
        lambda: fem.Target("x", "cpu", 8, memory_bytes=0),
        fe.EscaleError,
        "memory_bytes",
        "0",
        "positive int",
        id="Target-memory-zero",
    ),
    case(
        lambda: fem.Target("x", "cpu", 8, memory_bytes=float("nan")),
        T,
        "memory_bytes",
        "float nan",
        "positive int",
        id="Target-memory-nan",
    ),
    case(
        lambda: fem.Target("x", "cpu", 8, topology="v5e:2x4"),
        fe.EscaleError,
        "topology",
        "'v5e:2x4'",
        r"would be ignored; pass topology=None, or .*Target.named\('v5e:2x4'\)",
        id="Target-cpu-topology",
    ),
    # --- Target.named given a Target: the counts beside it must agree with it ------------
    case(
        lambda: fem.Target.named(fem.Target.named("cpu", devices=8), devices=4),
        fe.EscaleError,
        "target='cpu'",
        "devices=4",
        r"disagrees with .*of 8 devices.*leave devices out, or .*target='cpu', devices=4",
        id="Target.named-target-and-other-devices",
    ),
    case(
        lambda: fem.Target.named(fem.Target.named("cpu", devices=8), slices=2),
        fe.EscaleError,
        "target='cpu'",
        "slices=2",
        r"in 1 slice\(s\).*leave slices out",
        id="Target.named-target-and-other-slices",
    ),
    case(
        lambda: fem.Target.named(fem.Target.named("cpu", devices=8), devices=0),
        fe.EscaleError,
        "devices",
        "0",
        "positive int",
        id="Target.named-target-and-devices-zero",
    ),
    case(
        lambda: fem.Target.named("v5e:0x4"),
        fe.EscaleError,
        "target",
        "'v5e:0x4'",
        r"at least 1; pass e\.g\. 'v5e:2x4'",
        id="Target-named-zero-topology",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
