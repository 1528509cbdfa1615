"""One array of a sharding plan: its path, shape, dtype, annotation and resolved spec."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of, mesh_text
from flax_escale.errors import EscaleError
from flax_escale.plan._annotation import Annotation
from flax_escale.resolve import Resolution

__all__ = ["PlanEntry"]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanEntry:
    """One array of the plan.

    Attributes:
        path: The array's path in the variables, ``/``-separated.
        shape: The array's shape.
        dtype: The array's dtype.
        annotation: Its annotation, or ``None`` if it has none (it is replicated).
        resolution: The resolved spec with what was passed over and corrected.
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    annotation: Annotation | None
    resolution: Resolution

    @property
    def spec(self) -> PartitionSpec:
        """The resolved ``PartitionSpec``."""
        return self.resolution.spec

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def nbytes_per_device(self, mesh: Mesh | AbstractMesh) -> int:
        """Bytes of the shard each device holds on ``mesh``.

        Raises:
            EscaleTypeError: If ``mesh`` is not a mesh.
            EscaleError: If the spec names an axis ``mesh`` lacks (another plan's mesh).
        """
        axes = [a for entry in self.spec for a in mesh_axes_of(entry)]
        try:
            return self.nbytes // math.prod(mesh.shape[a] for a in axes)
        except (AttributeError, KeyError, TypeError):
            check.mesh(mesh, "PlanEntry.nbytes_per_device: mesh")
            raise EscaleError(
                f"PlanEntry.nbytes_per_device: {self.path!r} has the spec {self.spec}, which "
                f"names axes the mesh ({mesh_text(mesh.shape)}) lacks; pass the plan's own "
                "mesh (plan.mesh)."
            ) from None
