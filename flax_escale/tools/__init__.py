"""Layer 6: what users run around training.

The sharding report and its checks (``sharding_report``, also as a web page, ``check_sharded``,
``will_it_fit``), pictures of a layout (``layout_picture``, ``memory_bars``,
``register_treescope``), checkpoints restored into a layout, the multi-host data helpers and the
local multi-process launcher (``python -m flax_escale launch``). The top level re-exports what a
user reaches for.
"""

from flax_escale.tools._blocks import DeviceBlock
from flax_escale.tools._check_sharded import UnshardedParameterError, check_sharded
from flax_escale.tools._checkpoint import restore_checkpoint, save_checkpoint
from flax_escale.tools._data import (
    batch_sharding,
    global_to_host_local,
    host_local_to_global,
    process_batch_slice,
)
from flax_escale.tools._launch import free_port, launch, process_environment
from flax_escale.tools._memory import MemoryEstimate, will_it_fit
from flax_escale.tools._memory_bars import MemoryBars, memory_bars, memory_by_device
from flax_escale.tools._picture import LayoutPicture, layout_picture
from flax_escale.tools._report import ShardingReport, sharding_report
from flax_escale.tools._reshardings import Resharding
from flax_escale.tools._treescope import register_treescope

__all__ = [
    "DeviceBlock",
    "LayoutPicture",
    "MemoryBars",
    "MemoryEstimate",
    "Resharding",
    "ShardingReport",
    "UnshardedParameterError",
    "batch_sharding",
    "check_sharded",
    "free_port",
    "global_to_host_local",
    "host_local_to_global",
    "launch",
    "layout_picture",
    "memory_bars",
    "memory_by_device",
    "process_batch_slice",
    "process_environment",
    "register_treescope",
    "restore_checkpoint",
    "save_checkpoint",
    "sharding_report",
    "will_it_fit",
]
