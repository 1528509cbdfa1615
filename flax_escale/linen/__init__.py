"""The Flax Linen front end of flax_escale.

Linen-specific tools (``sharded_module``, ``init_sharded``) are added here by the Linen front-end
work; the mesh and logical-axis tools they build on are in :mod:`flax_escale`.
"""

__all__: list[str] = []
