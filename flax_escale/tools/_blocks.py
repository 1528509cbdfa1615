"""What one device holds of an array (:class:`DeviceBlock`), and treescope's drawing of the blocks.

The layout picture is made of these blocks; treescope draws them with its own sharding picture,
fed through an array adapter that holds the blocks and no values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import treescope
from treescope import ndarray_adapters

__all__ = ["DeviceBlock", "blocks_part"]


@dataclasses.dataclass(frozen=True)
class DeviceBlock:
    """What one device holds of an array.

    Attributes:
        device_id: The device's id.
        coords: Its place in the mesh, ``{axis: index}`` for every mesh axis.
        block: ``(start, stop)`` per dimension of the array; a padded dimension's last blocks
            are short or empty.
        nbytes: Bytes of the block.
    """

    device_id: int
    coords: dict[str, int]
    block: tuple[tuple[int, int], ...]
    nbytes: int

    def block_text(self, shape: tuple[int, ...]) -> str:
        """The block as slices, a whole dimension as ``:`` (``[0:256, :]``)."""
        parts = [
            ":" if (start, stop) == (0, size) else f"{start}:{stop}"
            for (start, stop), size in zip(self.block, shape, strict=True)
        ]
        return "[" + ", ".join(parts) + "]"


def blocks_part(shape: tuple[int, ...], devices: Sequence[DeviceBlock]) -> Any | None:
    """The blocks of an array of ``shape`` as treescope's ``render_array_sharding`` draws them.

    ``None`` where it cannot apply: blocks of unequal length (from padding), or a scalar.
    """
    lengths = {tuple(stop - start for start, stop in d.block) for d in devices}
    if len(shape) == 0 or len(lengths) != 1 or 0 in next(iter(lengths)):
        return None
    return treescope.render_array_sharding(_Blocks(shape, tuple(devices))).treescope_part


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """An array's blocks, as an array treescope can draw the sharding of (and nothing else)."""

    shape: tuple[int, ...]
    devices: tuple[DeviceBlock, ...]

    def __treescope_ndarray_adapter__(self) -> ndarray_adapters.NDArrayAdapter:
        return _BlocksAdapter()


class _BlocksAdapter(ndarray_adapters.NDArrayAdapter[_Blocks]):
    def get_axis_info_for_array_data(self, array: _Blocks) -> tuple[Any, ...]:
        return tuple(
            ndarray_adapters.PositionalAxisInfo(i, size) for i, size in enumerate(array.shape)
        )

    def get_sharding_info_for_array_data(self, array: _Blocks) -> ndarray_adapters.ShardingInfo:
        devices = array.devices
        return ndarray_adapters.ShardingInfo(
            shard_shape=tuple(stop - start for start, stop in devices[0].block),
            device_index_to_shard_slices={
                d.device_id: tuple(slice(start, stop) for start, stop in d.block) for d in devices
            },
            device_type="device",
            fully_replicated=len({d.block for d in devices}) == 1,
        )

    # The blocks hold no values: nothing else is ever asked of them.
    def get_array_data_with_truncation(
        self, array: Any, mask: Any, edge_items_per_axis: Any
    ) -> Any:
        raise NotImplementedError

    def get_array_summary(self, array: Any, fast: bool) -> Any:
        raise NotImplementedError
