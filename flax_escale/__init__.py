"""flax_escale: shard Flax Linen and NNX models across a device mesh.

Everything users need is importable from here; what is specific to one Flax API lives in
:mod:`flax_escale.linen` and :mod:`flax_escale.nnx`.
"""

from flax_escale.errors import EscaleError, EscaleTypeError, MeshError, NoMeshError
from flax_escale.mesh import (
    DEFAULT_AXIS_DIMS,
    DEFAULT_AXIS_NAMES,
    AxisNames,
    AxisTypeLike,
    calculate_host_mesh_shape,
    cpu_context,
    create_cpu_mesh,
    create_mesh,
    force_cpu,
    get_axes_size_in_mesh,
    get_incontext_mesh,
    get_mesh_axis_names,
    get_mesh_axis_size,
    get_submesh_device_index,
    names_in_current_mesh,
    parse_mesh_from_string,
    parse_mesh_shape,
    resolve_axis_dims,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_AXIS_DIMS",
    "DEFAULT_AXIS_NAMES",
    "AxisNames",
    "AxisTypeLike",
    "EscaleError",
    "EscaleTypeError",
    "MeshError",
    "NoMeshError",
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "force_cpu",
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "get_mesh_axis_size",
    "get_submesh_device_index",
    "names_in_current_mesh",
    "parse_mesh_from_string",
    "parse_mesh_shape",
    "resolve_axis_dims",
]
