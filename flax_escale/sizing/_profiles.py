"""Hardware profiles: the few numbers a step-time estimate needs about one accelerator."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.sizing._hlo import program_costs

__all__ = ["PROFILES", "HardwareProfile", "hardware_profile", "measure_cpu_profile"]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One device's compute and interconnect, as a step-time estimate uses them.

    Attributes:
        name: What the numbers describe.
        flops_per_second: Peak dense matrix-multiplication FLOP/s of one device, in the
            precision the model computes in.
        interconnect_bytes_per_second: Bytes per second one device sends over the links a
            collective uses (one direction).
        collective_latency_seconds: The fixed cost of one collective, whatever its size.
        memory_bytes: One device's memory, the budget when none is given.
        memory_bytes_per_second: One device's memory bandwidth, for the step's pass over its
            train state (the optimizer update reads and writes every byte of it); ``None``
            leaves that term out.
        devices_per_host: Devices joined by the fast interconnect (a host, or a slice); the
            mesh's outermost axes span hosts first. ``None``: every device is on one.
        host_bytes_per_second: Bytes per second one device sends to another host (DCN,
            InfiniBand): the rate of the collectives that cross hosts. ``None``: the
            interconnect's.
    """

    name: str
    flops_per_second: float
    interconnect_bytes_per_second: float
    collective_latency_seconds: float = 0.0
    memory_bytes: int | None = None
    memory_bytes_per_second: float | None = None
    devices_per_host: int | None = None
    host_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        # The name titles every plan and message that uses the profile.
        check.string(self.name, "HardwareProfile name", "'my accelerator'")
        # Finite and positive: a NaN or an infinity would rank every mesh by NaN.
        for field in (
            "flops_per_second",
            "interconnect_bytes_per_second",
            "memory_bytes_per_second",
            "host_bytes_per_second",
        ):
            value = getattr(self, field)
            if field in ("memory_bytes_per_second", "host_bytes_per_second") and value is None:
                continue
            check.positive_number(value, f"HardwareProfile {self.name!r}: {field}")
        check.non_negative_number(
            self.collective_latency_seconds,
            f"HardwareProfile {self.name!r}: collective_latency_seconds",
        )
        if self.memory_bytes is not None:
            check.positive_int(self.memory_bytes, "memory_bytes")
        if self.devices_per_host is not None:
            check.positive_int(self.devices_per_host, "devices_per_host")


# Vendors' published peak figures (dense bf16 FLOP/s; interconnect per device, one direction;
# HBM bandwidth). Real steps reach a fraction of them: the estimate ranks meshes, it does not
# predict seconds.
PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("NVIDIA H100 SXM", 989e12, 450e9, 10e-6, 80 * 10**9, 3.35e12),
    "h200": HardwareProfile("NVIDIA H200 SXM", 989e12, 450e9, 10e-6, 141 * 10**9, 4.8e12),
    "a100": HardwareProfile("NVIDIA A100 SXM 80GB", 312e12, 300e9, 10e-6, 80 * 10**9, 2.04e12),
    "tpu-v4": HardwareProfile("Google TPU v4", 275e12, 270e9, 5e-6, 32 * 2**30, 1.2e12),
    "tpu-v5e": HardwareProfile("Google TPU v5e", 197e12, 200e9, 5e-6, 16 * 10**9, 819e9),
    "tpu-v5p": HardwareProfile("Google TPU v5p", 459e12, 600e9, 5e-6, 95 * 10**9, 2.765e12),
    "tpu-v6e": HardwareProfile("Google TPU v6e", 918e12, 360e9, 5e-6, 32 * 10**9, 1.64e12),
}
"""The built-in profiles by name (``--profile NAME`` on the command line)."""


def hardware_profile(profile: str | HardwareProfile) -> HardwareProfile:
    """A profile by name (a key of :data:`PROFILES`), or the one given.

    Raises:
        EscaleError: For an unknown name; the message lists the known ones.
        EscaleTypeError: For anything else.

    Example:
        >>> from flax_escale.sizing import hardware_profile
        >>> hardware_profile("h100").flops_per_second
        989000000000000.0
    """
    if isinstance(profile, HardwareProfile):
        return profile
    if isinstance(profile, str):
        if profile in PROFILES:
            return PROFILES[profile]
        raise EscaleError(
            f"profile: unknown hardware profile {profile!r}; pass one of {sorted(PROFILES)} or "
            "a HardwareProfile(name, flops_per_second, interconnect_bytes_per_second, ...)."
        )
    raise EscaleTypeError(
        f"profile must be a profile name or a HardwareProfile, got {check.describe(profile)}; "
        f"pass one of {sorted(PROFILES)}."
    )


def measure_cpu_profile(mesh: Mesh, *, rounds: int = 5) -> HardwareProfile:
    """Measures the profile of ``mesh``'s devices: how this machine runs a sharded program.

    Simulated CPU devices share the host's cores and "communicate" through its memory, so no
    published figure describes them; the three numbers are timed on ``mesh`` itself, each the
    median of ``rounds``: a matrix multiplication on every device at once (FLOP/s per
    device), an all-gather of 16 MiB (bytes each device sends per second, as the planner
    counts them in compiled programs), an all-reduce of one value per device
    (latency) and an elementwise update of 16 MiB per device (memory bandwidth).

    Args:
        mesh: The mesh whose devices to measure.
        rounds: Timed runs of each program.

    Returns:
        A :class:`HardwareProfile` named ``"measured: <platform> x <devices>"``.
    """
    check.mesh(mesh)
    rounds = check.positive_int(rounds, "rounds")
    flat = Mesh(np.asarray(mesh.devices).reshape(-1), ("all",))
    n = flat.size
    split, whole = NamedSharding(flat, PartitionSpec("all")), NamedSharding(flat, PartitionSpec())

    width = 512
    x = jax.device_put(jnp.ones((n * width, width), jnp.float32), split)
    w = jax.device_put(jnp.ones((width, width), jnp.float32), whole)
    matmul = jax.jit(lambda x, w: x @ w, out_shardings=split)
    flops = 2.0 * width**3 / _seconds(matmul, (x, w), rounds)

    gathered = jax.device_put(jnp.ones((n, 4 << 20), jnp.float32), split)
    gather = jax.jit(lambda v: v, out_shardings=whole)
    wire = program_costs(gather.lower(gathered).compile()).wire_bytes
    bandwidth = wire / _seconds(gather, (gathered,), rounds)

    ones = jax.device_put(jnp.ones((n,), jnp.float32), split)
    reduce = jax.jit(lambda v: v.sum(), out_shardings=whole)
    latency = _seconds(reduce, (ones,), rounds)

    # Read twice and written once per element, on every device at once.
    streamed = jax.device_put(jnp.ones((n, 4 << 20), jnp.float32), split)
    update = jax.jit(lambda v, g: v - 0.1 * g, out_shardings=split)
    memory = 3 * 4 * (4 << 20) / _seconds(update, (streamed, streamed), rounds)
    platform = next(iter(flat.devices.flat)).platform
    return HardwareProfile(
        f"measured: {platform} x {n}", flops, bandwidth, latency, memory_bytes_per_second=memory
    )


def _seconds(fn: object, args: Sequence[jax.Array], rounds: int) -> float:
    jax.block_until_ready(fn(*args))  # compiled and warm
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)
