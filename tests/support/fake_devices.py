"""Stand-ins for devices of other processes, hosts and TPU chips, for mesh tests."""

import dataclasses


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
