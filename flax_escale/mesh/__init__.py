"""Layer 1: device meshes, the devices they are built from, and the current mesh."""

from flax_escale.mesh._agreement import assert_same_mesh
from flax_escale.mesh._cluster import ClusterInfo, detect_cluster
from flax_escale.mesh._context import current_mesh, with_auto_axes
from flax_escale.mesh._cpu import cpu_context, force_cpu
from flax_escale.mesh._creation import (
    DEFAULT_AXIS_DIMS,
    DEFAULT_AXIS_NAMES,
    PIPELINE_AXIS,
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
    "PIPELINE_AXIS",
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
