"""Layer 1: device meshes, the current mesh, and mesh axis queries."""

from flax_escale.mesh._agreement import assert_same_mesh
from flax_escale.mesh._chunks import LocalChunker, LocalChunkInfo
from flax_escale.mesh._cluster import ClusterInfo, detect_cluster
from flax_escale.mesh._collective import get_mesh_axis_size, get_submesh_device_index
from flax_escale.mesh._context import (
    MeshAxisNames,
    get_axes_size_in_mesh,
    get_incontext_mesh,
    get_mesh_axis_names,
    names_in_current_mesh,
    with_auto_axes,
)
from flax_escale.mesh._cpu import cpu_context, force_cpu
from flax_escale.mesh._creation import (
    DEFAULT_AXIS_DIMS,
    DEFAULT_AXIS_NAMES,
    AxisTypeLike,
    create_cpu_mesh,
    create_mesh,
)
from flax_escale.mesh._distributed import initialize_distributed, peer_loss_as_mesh_error
from flax_escale.mesh._parse import parse_mesh_from_string, parse_mesh_shape
from flax_escale.mesh._shape import calculate_host_mesh_shape, resolve_axis_dims

__all__ = [
    "DEFAULT_AXIS_DIMS",
    "DEFAULT_AXIS_NAMES",
    "AxisTypeLike",
    "ClusterInfo",
    "LocalChunkInfo",
    "LocalChunker",
    "MeshAxisNames",
    "assert_same_mesh",
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "detect_cluster",
    "force_cpu",
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "get_mesh_axis_size",
    "get_submesh_device_index",
    "initialize_distributed",
    "names_in_current_mesh",
    "parse_mesh_from_string",
    "parse_mesh_shape",
    "peer_loss_as_mesh_error",
    "resolve_axis_dims",
    "with_auto_axes",
]
