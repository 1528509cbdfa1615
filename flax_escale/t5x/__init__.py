"""t5x's partitioning API on flax_escale: a t5x program ports by changing its imports.

``from flax_escale.t5x import Partitioner`` gives t5x's ``PjitPartitioner`` (same constructor
order, same methods and properties), with the mesh builders, ``LocalChunker``, ``DataLayout``,
``standard_logical_axis_rules`` and ``AxisNames`` beside it. What differs from t5x, and why:

- Functions from :meth:`Partitioner.partition` run under
  :func:`~flax_escale.use_sharding` (``jax.set_mesh`` and Flax's logical-axis rules), not the
  legacy ``with mesh:``, under which current Flax drops logical constraints without a word.
- Logical axes resolve with the library's resolver, shape-aware: a rule whose mesh axes do not
  divide a dimension is passed over, and what still does not fit is dropped with a warning
  (an error with ``strict=True``), never silently.
- Meshes have ``AxisType.Auto`` axes; ``get_gpu_mesh`` takes ``num_partitions``;
  ``LocalChunker`` takes dimensions split over several mesh axes; ``get_data_layout`` takes
  ``host_index``.
- ``Partitioner(mesh=...)`` takes any mesh (``flax_escale.create_mesh``'s, say), whose rules
  then default to :class:`~flax_escale.PartitionAxis`'s.

Example:
    >>> from flax_escale.t5x import Partitioner
    >>> partitioner = Partitioner(num_partitions=2)
    >>> dict(partitioner.mesh.shape), partitioner.data_partition_spec
    ({'data': 1, 'model': 8}, P('data',))
"""

from flax_escale.t5x._axes import AxisNames, standard_logical_axis_rules
from flax_escale.t5x._chunks import LocalChunker, LocalChunkInfo
from flax_escale.t5x._data import DataLayout
from flax_escale.t5x._hardware import HardwareMesh, bounds_from_last_device, get_coords
from flax_escale.t5x._mesh import default_mesh, get_cpu_mesh, get_gpu_mesh, global_mesh_defined
from flax_escale.t5x._partitioner import PartitionedFunction, Partitioner
from flax_escale.t5x._tiling import get_mesh

__all__ = [
    "AxisNames",
    "DataLayout",
    "HardwareMesh",
    "LocalChunkInfo",
    "LocalChunker",
    "PartitionedFunction",
    "Partitioner",
    "bounds_from_last_device",
    "default_mesh",
    "get_coords",
    "get_cpu_mesh",
    "get_gpu_mesh",
    "get_mesh",
    "global_mesh_defined",
    "standard_logical_axis_rules",
]
