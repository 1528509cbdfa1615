"""What t5x's mesh tests read off a mesh: devices' coordinates, processes and ids, and shape."""

import numpy as np
from jax.sharding import AxisType, Mesh

from flax_escale.t5x import get_coords
from flax_escale.t5x._chunks import process_blocks


def coords_of(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: get_coords(d), otypes=[object])(mesh.devices)


def processes_of(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def ids_of(mesh: Mesh) -> list[list[int]]:
    return [[d.id for d in row] for row in mesh.devices]


def assert_processes_contiguous(mesh: Mesh) -> None:
    blocks = process_blocks(mesh.devices)
    assert None not in blocks.values(), blocks


def assert_t5x_mesh(mesh: Mesh, shape: tuple[int, ...], names=("data", "model")) -> None:
    assert mesh.axis_names == names
    assert mesh.devices.shape == shape
    assert mesh.axis_types == (AxisType.Auto,) * len(names)
