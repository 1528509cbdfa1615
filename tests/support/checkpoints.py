"""A small checkpointed tree, and what the checkpoint tests of ``flax_escale/tools`` ask of it.

The tree is one leaf ``w``, 0..15 as float32[8, 2] split by rows over the ``fsdp`` axis of 8
devices, so that its first value tells which of several saves a checkpoint holds.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe


def small_tree() -> dict[str, jax.Array]:
    """``{"w": ...}``: float32[8, 2] holding 0..15, sharded by rows over ``fsdp`` (8 devices)."""
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    return {
        "w": jax.device_put(
            np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("fsdp"))
        )
    }


def restored_value(path: str | os.PathLike, tree: dict[str, Any]) -> float:
    """The first value of ``w`` restored from ``path`` into ``tree``: which save it holds."""
    return float(fe.restore_checkpoint(path, tree)["w"][0, 0])


def target_like(tree: dict[str, Any], **changes: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """An abstract target for ``tree`` in its sharding, with the ``shape`` or ``dtype`` given."""
    w = tree["w"]
    spec = {"shape": w.shape, "dtype": w.dtype, **changes}
    return {"w": jax.ShapeDtypeStruct(spec["shape"], spec["dtype"], sharding=w.sharding)}
