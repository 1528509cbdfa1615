"""The hardware a plan is compiled for: simulated CPU devices, or a TPU slice described by JAX.

A TPU slice needs no TPU: ``jax.experimental.topologies.get_topology_desc`` describes one with
``libtpu``'s compiler (the ``tpu`` extra installs it), and programs lowered on a mesh of the
description's devices compile with the TPU compiler on any machine; nothing runs. Their memory,
collectives and FLOPs are the TPU's own. The simulated CPU stays the default, and every figure
says which compiler it came from (:attr:`Target.label`).

A GPU cluster has no such path: JAX compiles for a GPU only on a host with one. A GPU name
(``"h100-8"``) is therefore a target of simulated CPU devices standing in for the GPUs: XLA:CPU
compiles, and the GPU's memory and hardware profile budget and rank the meshes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh._creation import DEFAULT_AXIS_NAMES, AxisTypeLike, create_mesh

__all__ = ["MAX_SIMULATED_DEVICES", "TPU_GENERATIONS", "Target"]


@dataclasses.dataclass(frozen=True)
class _Generation:
    # How a generation's slices are named and laid out: whether the number in "v5p-128"
    # counts TensorCores (two per chip, as v5p slices are named) or chips (v5e, v6e),
    # the slice shapes by chip count, one chip's memory (Cloud TPU's published HBM), and the
    # name of the planner's hardware profile of one chip.
    counts_cores: bool
    shapes: dict[int, str]
    memory_bytes: int
    profile: str


_SHAPES_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_SHAPES_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
MAX_SIMULATED_DEVICES = 4096
"""The most CPU devices one host simulates for a plan or a report.

Beyond this, simulating devices costs more memory and compile time than a plan is worth (10**8
asked for takes gigabytes before anything is planned); a pod has its TPU target.
"""

TPU_GENERATIONS: dict[str, _Generation] = {
    "v5p": _Generation(True, _SHAPES_3D, 95 * 10**9, "tpu-v5p"),
    "v5e": _Generation(False, _SHAPES_2D, 16 * 10**9, "tpu-v5e"),
    "v6e": _Generation(False, _SHAPES_2D, 32 * 10**9, "tpu-v6e"),
}
"""The TPU generations a target may name, as ``"<generation>-<size>"`` (Cloud TPU's names)."""

# The GPUs a target may name, as "<gpu>-<count>" ("h100-8"), with one GPU's memory; each is
# also the name of the planner's hardware profile of that GPU.
_GPUS = {"a100": 80 * 10**9, "h100": 80 * 10**9, "h200": 141 * 10**9}

_NAME = re.compile(r"^(v\d+[a-z]*)-(\d+)$")
_GPU_NAME = re.compile(rf"^({'|'.join(_GPUS)})-(\d+)$")
_TOPOLOGY = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)*)$")
_GPU = re.compile(r"^(gpu|cuda|[ahb]\d{2,3})(\b|[-:x])", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a plan's programs are compiled, and how many devices they are compiled for.

    Attributes:
        name: The target as given: ``"cpu"``, ``"v5p-128"``, ``"v5e:2x4"``.
        platform: ``"cpu"`` (simulated devices, also for a GPU name) or ``"tpu"``.
        device_count: Devices of the whole target (every slice).
        topology: The slice as ``get_topology_desc`` takes it (``"v5p:4x4x4"``); ``None`` on
            CPU.
        slices: Slices joined over the data-center network; data parallelism spans them.
        memory_bytes: One device's memory (a TPU chip's, or the GPU's that simulated CPU
            devices stand in for); ``None`` for plain simulated CPU devices.
        profile: The name of the planner's hardware profile of one device, if there is one.

    Raises:
        EscaleTypeError: If a field has the wrong type (a count that is not an int, ``True``
            as a count included).
        EscaleError: If a count is below 1, ``slices`` does not divide ``device_count``, the
            platform is neither ``"cpu"`` nor ``"tpu"``, a TPU target has no topology, a CPU
            target has a topology, several slices or more devices than one host simulates, or
            ``memory_bytes`` is below 1.
    """

    name: str
    platform: str
    device_count: int
    topology: str | None = None
    slices: int = 1
    memory_bytes: int | None = None
    profile: str | None = None

    def __post_init__(self) -> None:
        # Targets are also built by hand and from the planner's JSON: a zero or bool count
        # would reach the planner as a division by zero or a one-device plan, and a memory of
        # 0 or below as a budget nothing fits (0 even stood silently for the profile's).
        check.string(self.name, "Target name", "'v5e-8'")
        check.string(self.platform, "Target platform", "'cpu' or 'tpu'")
        if self.platform not in ("cpu", "tpu"):
            raise EscaleError(
                f"Target platform must be 'cpu' or 'tpu', got {self.platform!r}; build targets "
                "with Target.named('cpu', devices=N) or Target.named('v5e-8')."
            )
        # Frozen: the checked ints (numpy ints made plain, for the planner's JSON) go in
        # through object.__setattr__.
        count = check.positive_int(self.device_count, "Target device_count")
        object.__setattr__(self, "device_count", count)
        slices = check.positive_int(self.slices, "Target slices")
        object.__setattr__(self, "slices", slices)
        if self.platform == "cpu":
            if count > MAX_SIMULATED_DEVICES:
                raise EscaleError(
                    f"Target device_count {count} is more than the {MAX_SIMULATED_DEVICES} "
                    "devices one host simulates; plan a TPU slice with its own target (such as "
                    "Target.named('v5p-1024')), or fewer devices."
                )
            if slices != 1:
                raise EscaleError(
                    f"Target slices {slices}: simulated CPU devices form one slice; pass slices=1."
                )
            if self.topology is not None:
                raise EscaleError(
                    f"Target topology {self.topology!r}: simulated CPU devices have no TPU "
                    "topology, and it would be ignored; pass topology=None, or build the TPU "
                    f"target with Target.named({self.topology!r})."
                )
        elif not isinstance(self.topology, str):
            raise EscaleTypeError(
                f"Target topology must be a TPU topology string such as 'v5e:2x4' for a TPU "
                f"target, got {check.describe(self.topology)}; or build it with "
                "Target.named('v5e-8')."
            )
        if count % slices:
            raise EscaleError(
                f"Target slices {slices} does not divide device_count {count}: device_count "
                "counts the devices of every slice, so pass a multiple of slices (slices x the "
                "devices of one slice)."
            )
        if self.memory_bytes is not None:
            memory = check.positive_int(self.memory_bytes, "Target memory_bytes")
            object.__setattr__(self, "memory_bytes", memory)
        if self.profile is not None:
            check.string(self.profile, "Target profile", "'tpu-v5e' (or None)")

    @property
    def label(self) -> str:
        """Which compiler the figures come from, for every table and message that shows them."""
        if self.platform == "cpu":
            simulated = f"XLA:CPU, {self.device_count} simulated devices"
            if _GPU_NAME.match(self.name):
                return f"{simulated} standing in for {self.name}'s GPUs"
            return simulated
        joined = f" x {self.slices} slices over DCN" if self.slices > 1 else ""
        return f"TPU compiler (libtpu), {self.name} = topology {self.topology}{joined}"

    @property
    def compiler_options(self) -> dict[str, Any]:
        """Options for ``lowered.compile(...)`` that leave memory, FLOPs and collectives as is."""
        # LLVM's optimization of generated CPU code is ~40% of a CPU compile and changes none
        # of the figures (buffers, FLOPs and collectives are fixed before it); the TPU compiler
        # has no such stage to skip.
        return {"xla_backend_optimization_level": 0} if self.platform == "cpu" else {}

    def devices(self) -> list[Any]:
        """The target's devices: this process's CPU devices, or the TPU description's.

        Raises:
            EscaleError: If this process has fewer CPU devices than a CPU target needs, or
                ``libtpu`` is missing for a TPU target.
        """
        if self.platform == "cpu":
            found = jax.devices("cpu")
            if len(found) < self.device_count:
                raise EscaleError(
                    f"target {self.name!r} needs {self.device_count} CPU devices and this process "
                    f"has {len(found)}; set jax.config.update('jax_num_cpu_devices', "
                    f"{self.device_count}) before JAX starts, or plan through plan_mesh, which "
                    "starts a child process with that many."
                )
            return found[: self.device_count]
        found = list(_topology_devices(self.topology, self.slices))
        if len(found) != self.device_count:
            # v4 describes each TensorCore of a chip as a device; the planner counts chips.
            raise EscaleError(
                f"target {self.name!r}: the TPU compiler describes {len(found)} devices where "
                f"{self.device_count} chips were expected; name a v5e, v5p or v6e slice."
            )
        return found

    def mesh(
        self,
        axis_dims: Sequence[int],
        axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
        *,
        axis_types: AxisTypeLike | Sequence[AxisTypeLike] | None = None,
    ) -> Mesh:
        """A mesh of the target's devices, as :func:`~flax_escale.create_mesh` builds it.

        Over several slices the mesh is a hybrid: its first axis (data parallelism) spans the
        slices, every other axis stays inside one.

        Example:
            >>> from flax_escale.mesh import Target
            >>> mesh = Target.named("cpu", devices=8).mesh((1, 4, 1, 2, 1))
            >>> dict(mesh.shape)
            {'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1}
        """
        dims = check.sizes(axis_dims, "axis_dims")
        axis_names = check.names(axis_names, "axis_names")
        dcn = None
        # An empty shape is create_mesh's to refuse, with its own message.
        if self.slices > 1 and dims and axis_names:
            if dims[0] % self.slices:
                raise EscaleError(
                    f"axis_dims {dims}: the first axis ({axis_names[0]!r}, data parallelism) "
                    f"spans the {self.slices} slices of {self.name!r}, so its size must be a "
                    f"multiple of {self.slices}."
                )
            dcn = (self.slices,) + (1,) * (len(dims) - 1)
        return create_mesh(
            dims, axis_names, dcn_mesh_dims=dcn, axis_types=axis_types, devices=self.devices()
        )

    @classmethod
    def named(
        cls,
        name: str | Target = "cpu",
        *,
        devices: int | None = None,
        slices: int | None = None,
    ) -> Target:
        """The target a name stands for.

        Args:
            name: ``"cpu"`` (simulated CPU devices; ``devices`` says how many), a Cloud TPU slice
                name (``"v5e-256"``, ``"v6e-64"``: chips; ``"v5p-128"``: TensorCores, two per
                chip; see :data:`TPU_GENERATIONS`), or a topology as
                ``jax.experimental.topologies.get_topology_desc`` takes it (``"v5e:2x4"``), a
                GPU cluster (``"h100-8"``: 8 GPUs; ``a100``, ``h100``, ``h200``), simulated on CPU
                devices with the GPU's memory and profile, or a ``Target``.
            devices: For ``"cpu"``: how many devices to simulate. For a TPU name or a
                ``Target``: optional, and then it must agree with it.
            slices: TPU slices joined over the data-center network (multi-slice); data
                parallelism spans them. Defaults to 1 for a name; for a ``Target``: optional,
                and then it must agree with it.

        Returns:
            The target.

        Raises:
            EscaleError: For an unknown name or size, a topology with a size of 0, or a device
                or slice count that disagrees with the name or the ``Target`` given.
            EscaleTypeError: For arguments of the wrong type.

        Example:
            >>> from flax_escale.mesh import Target
            >>> t = Target.named("v5p-128")
            >>> t.topology, t.device_count, t.profile
            ('v5p:4x4x4', 64, 'tpu-v5p')
            >>> Target.named("v5e-256", slices=2).device_count
            512
            >>> Target.named("cpu", devices=8).label
            'XLA:CPU, 8 simulated devices'
            >>> gpus = Target.named("h100-8")
            >>> gpus.platform, gpus.device_count, gpus.memory_bytes, gpus.profile
            ('cpu', 8, 80000000000, 'h100')
            >>> gpus.label
            "XLA:CPU, 8 simulated devices standing in for h100-8's GPUs"
        """
        if devices is not None:
            devices = check.positive_int(devices, "devices")
        if slices is not None:
            slices = check.positive_int(slices, "slices")
        if isinstance(name, Target):
            return _agreeing(name, devices, slices)
        slices = 1 if slices is None else slices
        if not isinstance(name, str):
            raise EscaleTypeError(
                f"target must be a name such as 'cpu', 'v5e-256' or 'v5p-128', got "
                f"{check.describe(name)}."
            )
        if name == "cpu":
            if devices is None:
                raise EscaleError("target 'cpu' simulates devices: pass devices=N as well.")
            if devices > MAX_SIMULATED_DEVICES:
                raise EscaleError(
                    f"target 'cpu': devices={devices} is more than the {MAX_SIMULATED_DEVICES} "
                    "devices one host simulates (each costs memory, and every compile grows "
                    "with their count); plan a TPU slice with its own target (such as "
                    "'v5p-1024'), or fewer devices."
                )
            if slices != 1:
                raise EscaleError("slices: simulated CPU devices form one slice; pass slices=1.")
            return cls("cpu", "cpu", devices)
        gpus = _GPU_NAME.match(name)
        if gpus is not None:
            return _gpu_target(name, gpus.group(1), int(gpus.group(2)), devices, slices)
        if _GPU.match(name):
            known = ", ".join(f"'{gpu}-N'" for gpu in _GPUS)
            raise EscaleError(
                f"target {name!r}: the GPU targets are {known} (N GPUs, simulated on CPU "
                "devices with the GPU's memory and profile, as JAX compiles for a GPU only on a "
                "host with one); for another GPU, pass target='cpu', devices=N and "
                "profile=HardwareProfile(...) of it to plan_mesh."
            )
        generation, topology = _tpu_topology(name)
        sizes = [int(size) for size in topology.split(":")[1].split("x")]
        if 0 in sizes:
            raise EscaleError(
                f"target {name!r}: a topology counts chips along each axis, so every size must "
                "be at least 1; pass e.g. 'v5e:2x4'."
            )
        count = math.prod(sizes) * slices
        if devices is not None and devices != count:
            raise EscaleError(
                f"devices={devices} disagrees with target {name!r}"
                + (f" x {slices} slices" if slices > 1 else "")
                + f", which has {count} chips; leave devices out, or name the slice that has them."
            )
        known = TPU_GENERATIONS.get(generation)
        memory = None if known is None else known.memory_bytes
        profile = None if known is None else known.profile
        return cls(name, "tpu", count, topology, slices, memory, profile)

    def as_json(self) -> dict[str, Any]:
        """The target as JSON-ready values (for the planner's child process)."""
        return dataclasses.asdict(self)


def _gpu_target(name: str, gpu: str, count: int, devices: int | None, slices: int) -> Target:
    # Simulated CPU devices standing in for the GPUs: their count is the name's, and the GPU
    # gives the memory budget and the planner's profile.
    if count < 1 or count > MAX_SIMULATED_DEVICES:
        raise EscaleError(
            f"target {name!r}: a GPU target simulates its GPUs on CPU devices, from 1 to "
            f"{MAX_SIMULATED_DEVICES}; name that many GPUs, such as '{gpu}-8'."
        )
    if devices is not None and devices != count:
        raise EscaleError(
            f"devices={devices} disagrees with target {name!r}, which has {count} GPUs; leave "
            f"devices out, or name the cluster that has them ('{gpu}-{devices}')."
        )
    if slices != 1:
        raise EscaleError(
            f"slices: target {name!r} is simulated on CPU devices, which form one slice; pass "
            "slices=1 (the hosts of a GPU cluster are counted in its GPUs)."
        )
    return Target(name, "cpu", count, memory_bytes=_GPUS[gpu], profile=gpu)


def _agreeing(target: Target, devices: int | None, slices: int | None) -> Target:
    # A Target says its devices and slices itself: counts given beside it may only repeat
    # them, else one of the two would be ignored.
    for argument, given, own in (
        ("devices", devices, target.device_count),
        ("slices", slices, target.slices),
    ):
        if given is not None and given != own:
            raise EscaleError(
                f"{argument}={given} disagrees with target={target.name!r}, a Target of "
                f"{target.device_count} devices in {target.slices} slice(s), which already says "
                f"its {argument}; leave {argument} out, or pass the target by name with it: "
                f"target={target.name!r}, {argument}={given}."
            )
    return target


def _tpu_topology(name: str) -> tuple[str, str]:
    known = ", ".join(f"{g}-N" for g in TPU_GENERATIONS)
    raw = _TOPOLOGY.match(name)
    if raw is not None:
        return raw.group(1), name
    named = _NAME.match(name)
    if named is None or named.group(1) not in TPU_GENERATIONS:
        raise EscaleError(
            f"target: unknown target {name!r}; pass 'cpu' (with devices=N), a TPU slice ({known}, "
            "such as 'v5e-256' or 'v5p-128') or a topology such as 'v5e:2x4'."
        )
    generation = TPU_GENERATIONS[named.group(1)]
    size = int(named.group(2))
    chips = size // 2 if generation.counts_cores else size
    shape = generation.shapes.get(chips)
    if shape is None or (generation.counts_cores and size % 2):
        sizes = sorted(c * 2 if generation.counts_cores else c for c in generation.shapes)
        raise EscaleError(
            f"target: {name!r} is not a {named.group(1)} slice size; pass one of "
            f"{', '.join(f'{named.group(1)}-{s}' for s in sizes)}, or a topology such as "
            f"'{named.group(1)}:{next(iter(generation.shapes.values()))}'."
        )
    return named.group(1), f"{named.group(1)}:{shape}"


@functools.lru_cache(maxsize=8)
def _topology_devices(topology: str, slices: int) -> tuple[Any, ...]:
    # libtpu takes a lock file so that one process at a time drives a TPU. Nothing here runs
    # on one, only the compiler is used, so several planners (or a planner beside a test run)
    # may load it at once; read when libtpu loads, so set before the first description.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        description = topologies.get_topology_desc(topology, "tpu", num_slices=slices)
    except (ImportError, RuntimeError, ValueError) as error:
        if not _has_libtpu():
            raise EscaleError(
                f"target {topology!r}: compiling for a TPU needs libtpu, the TPU compiler; "
                'install it with pip install "flax-escale[tpu]" (no TPU is needed).'
            ) from None
        raise EscaleError(
            f"target {topology!r}: JAX's TPU compiler refused the topology: {error}"
        ) from None
    return tuple(description.devices)


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None
