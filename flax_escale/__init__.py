"""flax_escale: shard Flax Linen and NNX models across a device mesh.

Everything users need is importable from here; what is specific to one Flax API lives in
:mod:`flax_escale.linen` and :mod:`flax_escale.nnx`.
"""

from flax_escale.axes import (
    AxisNames,
    LogicalRules,
    MeshAxes,
    PartitionAxis,
    standard_logical_axis_rules,
)
from flax_escale.errors import (
    EscaleError,
    EscaleTypeError,
    MeshError,
    NoMeshError,
    ShardingCorrectionWarning,
    ShardingResolutionError,
)
from flax_escale.mesh import (
    DEFAULT_AXIS_DIMS,
    DEFAULT_AXIS_NAMES,
    AxisTypeLike,
    MeshAxisNames,
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
from flax_escale.resolve import (
    Correction,
    LogicalAxes,
    PassedOver,
    Resolution,
    RulesLike,
    as_logical_rules,
    fit_spec,
    logical_to_mesh_axes,
    resolve_logical_axes,
)
from flax_escale.sharding import apply_spec, constrain, with_sharding_constraint

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_AXIS_DIMS",
    "DEFAULT_AXIS_NAMES",
    "AxisNames",
    "AxisTypeLike",
    "Correction",
    "EscaleError",
    "EscaleTypeError",
    "LogicalAxes",
    "LogicalRules",
    "MeshAxes",
    "MeshAxisNames",
    "MeshError",
    "NoMeshError",
    "PartitionAxis",
    "PassedOver",
    "Resolution",
    "RulesLike",
    "ShardingCorrectionWarning",
    "ShardingResolutionError",
    "apply_spec",
    "as_logical_rules",
    "calculate_host_mesh_shape",
    "constrain",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "fit_spec",
    "force_cpu",
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "get_mesh_axis_size",
    "get_submesh_device_index",
    "logical_to_mesh_axes",
    "names_in_current_mesh",
    "parse_mesh_from_string",
    "parse_mesh_shape",
    "resolve_axis_dims",
    "resolve_logical_axes",
    "standard_logical_axis_rules",
    "with_sharding_constraint",
]
