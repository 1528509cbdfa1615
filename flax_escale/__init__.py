"""flax_escale: shard Flax Linen and NNX models across a device mesh.

The top level is the core a Flax user reaches for: meshes, the logical-axis vocabulary, one
resolver, constraints, the front-end entry points, the tools around training, checkpoints,
multi-host data and the errors. The rest is organized by layer and by audience:

- :mod:`flax_escale.linen` and :mod:`flax_escale.nnx`: what is specific to one Flax API.
- :mod:`flax_escale.pipeline`: pipeline parallelism over a ``pp`` mesh axis.
- :mod:`flax_escale.sizing`: which mesh of N devices fits a model and trains it fastest,
  planned on one CPU machine (``plan_mesh``, ``python -m flax_escale plan``).
- :mod:`flax_escale.t5x`: t5x.partitioning's vocabulary (``Partitioner``, mesh builders, ...).
- :mod:`flax_escale.eformer`: eformer.escale's names and signatures.
- :mod:`flax_escale.mesh`, :mod:`flax_escale.axes`, :mod:`flax_escale.resolve`,
  :mod:`flax_escale.plan`, :mod:`flax_escale.sharding`, :mod:`flax_escale.tools`: the layers,
  for what the top level leaves out (``fit_spec``, regex partition rules, shard and gather
  functions, the launcher, ...).
"""

from importlib import metadata as _metadata

from flax_escale import (  # noqa: F401 (the namespaces)
    eformer,
    linen,
    moe,
    nnx,
    pipeline,
    plan,
    sizing,
    t5x,
    testing,
)
from flax_escale._api import init_sharded, lower_init, plan_sharding, sharded_module
from flax_escale.axes import PartitionAxis
from flax_escale.errors import (
    EscaleError,
    EscaleTypeError,
    MeshError,
    NoMeshError,
    ShardingCorrectionWarning,
    ShardingResolutionError,
)
from flax_escale.mesh import (
    calculate_host_mesh_shape,
    cpu_context,
    create_cpu_mesh,
    create_mesh,
    force_cpu,
    initialize_distributed,
    parse_mesh_from_string,
)
from flax_escale.plan import (
    ShardingPlan,
    init_opt_state,
    logical_to_mesh_sharding,
    opt_state_shardings,
)
from flax_escale.resolve import logical_to_mesh_axes, resolve_logical_axes
from flax_escale.sharding import (
    constrain,
    reshard_tree,
    use_sharding,
    with_sharding_constraint,
)
from flax_escale.tools import (
    MemoryEstimate,
    ShardingReport,
    UnshardedParameterError,
    batch_sharding,
    check_sharded,
    global_to_host_local,
    host_local_to_global,
    process_batch_slice,
    restore_checkpoint,
    save_checkpoint,
    sharding_report,
    will_it_fit,
)


def _installed_version() -> str:
    """The version of the installed distribution, the one pip and PyPI show.

    A source tree imported without being installed (put on ``PYTHONPATH``, vendored) has no
    metadata to read: its version is ``0+unknown``, below every release.
    """
    try:
        return _metadata.version("flax-escale")
    except _metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "EscaleError",
    "EscaleTypeError",
    "MemoryEstimate",
    "MeshError",
    "NoMeshError",
    "PartitionAxis",
    "ShardingCorrectionWarning",
    "ShardingPlan",
    "ShardingReport",
    "ShardingResolutionError",
    "UnshardedParameterError",
    "batch_sharding",
    "calculate_host_mesh_shape",
    "check_sharded",
    "constrain",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "force_cpu",
    "global_to_host_local",
    "host_local_to_global",
    "init_opt_state",
    "init_sharded",
    "initialize_distributed",
    "logical_to_mesh_axes",
    "logical_to_mesh_sharding",
    "lower_init",
    "opt_state_shardings",
    "parse_mesh_from_string",
    "plan_sharding",
    "process_batch_slice",
    "reshard_tree",
    "resolve_logical_axes",
    "restore_checkpoint",
    "save_checkpoint",
    "sharded_module",
    "sharding_report",
    "use_sharding",
    "will_it_fit",
    "with_sharding_constraint",
]
