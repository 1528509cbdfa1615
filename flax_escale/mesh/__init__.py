"""Layer 1: device meshes, the devices they are built from, and the current mesh."""

from flax_escale._moved import moved_names as _moved_names
from flax_escale.mesh._agreement import assert_same_mesh
from flax_escale.mesh._cluster import ClusterInfo, detect_cluster
from flax_escale.mesh._context import current_mesh, with_auto_axes
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
from flax_escale.mesh._target import TPU_GENERATIONS, Target

__all__ = [
    "DEFAULT_AXIS_DIMS",
    "DEFAULT_AXIS_NAMES",
    "TPU_GENERATIONS",
    "AxisTypeLike",
    "ClusterInfo",
    "Target",
    "assert_same_mesh",
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "current_mesh",
    "detect_cluster",
    "force_cpu",
    "initialize_distributed",
    "parse_mesh_from_string",
    "parse_mesh_shape",
    "peer_loss_as_mesh_error",
    "resolve_axis_dims",
    "with_auto_axes",
]

# t5x's and eformer's names moved to their namespaces, the current mesh is current_mesh and
# a spec entry's axes are axes.MeshAxes;
# the old names work for one more release, with a DeprecationWarning.
__getattr__ = _moved_names(
    __name__,
    {
        "MeshAxisNames": "flax_escale.axes.MeshAxes; one name for what a spec entry holds",
        "LocalChunkInfo": "flax_escale.t5x.LocalChunkInfo",
        "LocalChunker": "flax_escale.t5x.LocalChunker",
        "get_axes_size_in_mesh": "flax_escale.eformer.get_axes_size_in_mesh",
        "get_incontext_mesh": "flax_escale.mesh.current_mesh; eformer's "
        "get_incontext_mesh(raise_error=) is flax_escale.eformer.get_incontext_mesh",
        "get_mesh_axis_names": "flax_escale.eformer.get_mesh_axis_names",
        "get_mesh_axis_size": "flax_escale.eformer.get_mesh_axis_size",
        "get_submesh_device_index": "flax_escale.eformer.get_submesh_device_index",
        "names_in_current_mesh": "flax_escale.eformer.names_in_current_mesh",
    },
)
