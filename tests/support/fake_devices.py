"""Stand-ins for devices of other processes, hosts and TPU chips, for mesh tests.

``FakeDevice`` and ``FakeTpu`` carry every attribute a JAX device has that the mesh builders
read; ``HostDevice`` and ``Core`` carry only some, as t5x's tests and planning tools pass them.
"""

import dataclasses
import itertools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """A CPU or GPU device of some process (no chip coordinates)."""

    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100"


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    """A TPU core: its chip's (x, y, z) position and the core's index on the chip."""

    id: int
    process_index: int
    coords: tuple[int, int, int]
    core_on_chip: int
    device_kind: str = "TPU v4"
    platform: str = "tpu"
    slice_index: int = 0


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """A device of some process with only its id: no platform, no kind."""

    id: int
    process_index: int


@dataclasses.dataclass(frozen=True)
class Core:
    """A TPU core as planning tools describe it: no platform, no kind."""

    id: int
    process_index: int
    coords: tuple[int, int, int]
    core_on_chip: int


def hosts(processes: int, per_process: int, *, id_stride: int | None = None) -> list[FakeDevice]:
    """``processes`` processes of ``per_process`` devices each, ids ``id_stride`` apart."""
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
