"""eformer.escale's names and signatures, so that eformer code runs by changing one import.

``from eformer import escale`` becomes ``from flax_escale import eformer as escale``. eformer's
vocabulary lives here only: the core speaks JAX's and Flax's. A name is the core's own object
where eformer's call means the same to it (``create_mesh``, ``with_sharding_constraint``,
``make_shard_and_gather_fns``, ...), and an adapter over the core where it does not:
``PartitionAxis`` (the core's, with eformer's decode defaults: ``decode_batch_axis``,
``decode_head_axis``, ``decode_kv_head_axis`` and ``decode_key_sequence_axis`` follow their
training fields, the query-sequence and attention-dimension ones are ``None``),
``get_incontext_mesh(raise_error=)`` over
:func:`~flax_escale.mesh.current_mesh` (an empty ``Mesh`` when there is none, as in eformer),
``match_partition_rules`` (its ``strict``; any leaf, not only arrays) over
:func:`~flax_escale.sharding.specs_from_regex`,
``auto_partition_spec(x, mesh, names, min_sharding_size, reverse)`` over
:func:`~flax_escale.sharding.spec_from_shape`, ``MeshPartitionHelper`` (eformer's suggested
methods and their placement in ``create_partition_spec``), ``analyze_sharding_strategy`` (a
dict over the figures of :class:`~flax_escale.ShardingReport`), the mesh queries, the spec
readers (``extract_sharding_structure(pytree=)`` and ``get_shardings_with_structure(pytree=)``
over :func:`extract_shardings`), ``create_pattern_based_partition_spec`` and
``PartitionManager``. So results follow the library's policy: a spec that cannot apply is
corrected with a :class:`~flax_escale.ShardingCorrectionWarning` (never dropped silently), no
spec fails to divide its shape, and errors are :class:`~flax_escale.EscaleError` subclasses
(``ValueError``), where eformer raises ``AssertionError`` for a missing mesh and ``KeyError``
for an unknown axis.

The documentation's page "Coming from eformer" (``docs/migration/from_eformer.md``) maps each
call to the library's own.

Example:
    >>> import jax
    >>> import numpy as np
    >>> from flax_escale import eformer as escale
    >>> mesh = escale.create_mesh((1, -1, 1, 2, 1))
    >>> rules = [("kernel", escale.PartitionSpec("fsdp", "tp")), (".*", escale.PartitionSpec())]
    >>> params = {"dense": {"kernel": np.ones((64, 32), np.float32), "bias": np.ones(32)}}
    >>> specs = escale.match_partition_rules(rules, params)
    >>> shard_fns, gather_fns = escale.make_shard_and_gather_fns(specs, mesh)
    >>> sharded = jax.tree.map(lambda f, x: f(x), shard_fns, params)
    >>> sharded["dense"]["kernel"].addressable_shards[0].data.shape
    (16, 16)
    >>> escale.analyze_sharding_strategy(params, specs, mesh)["sharded_parameters"]
    2048
"""

from jax.sharding import NamedSharding, PartitionSpec

from flax_escale.eformer._functions import auto_partition_spec, match_partition_rules
from flax_escale.eformer._helper import MeshPartitionHelper
from flax_escale.eformer._inspect import (
    ShardingAnalysis,
    analyze_sharding_strategy,
    extract_sharding_structure,
    extract_shardings,
    get_names_from_partition_spec,
    get_partition_spec,
)
from flax_escale.eformer._manager import PartitionManager
from flax_escale.eformer._mesh import (
    get_axes_size_in_mesh,
    get_incontext_mesh,
    get_mesh_axis_names,
    get_mesh_axis_size,
    get_submesh_device_index,
    names_in_current_mesh,
)
from flax_escale.eformer._partition_axis import PartitionAxis
from flax_escale.eformer._pattern import create_pattern_based_partition_spec
from flax_escale.mesh import (
    calculate_host_mesh_shape,
    cpu_context,
    create_cpu_mesh,
    create_mesh,
    force_cpu,
    parse_mesh_from_string,
)
from flax_escale.sharding import make_shard_and_gather_fns, with_sharding_constraint

# eformer's two names for one function, which takes the tree as `pytree`.
get_shardings_with_structure = extract_sharding_structure

__all__ = [
    "MeshPartitionHelper",
    "NamedSharding",
    "PartitionAxis",
    "PartitionManager",
    "PartitionSpec",
    "ShardingAnalysis",
    "analyze_sharding_strategy",
    "auto_partition_spec",
    "calculate_host_mesh_shape",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "create_pattern_based_partition_spec",
    "extract_sharding_structure",
    "extract_shardings",
    "force_cpu",
    "get_axes_size_in_mesh",
    "get_incontext_mesh",
    "get_mesh_axis_names",
    "get_mesh_axis_size",
    "get_names_from_partition_spec",
    "get_partition_spec",
    "get_shardings_with_structure",
    "get_submesh_device_index",
    "make_shard_and_gather_fns",
    "match_partition_rules",
    "names_in_current_mesh",
    "parse_mesh_from_string",
    "with_sharding_constraint",
]
