"""Putting idle mesh axes to use on a parameter, after the rules have spoken.

Rules name what each logical axis should be split over; on shapes that do not divide (25
heads, a 50,257-token vocabulary) the rules pass over or drop axes, and a large array can end
up split over fewer devices than the mesh has for parameters. Completion adds each such idle
axis to the dimension it divides that keeps the largest shard, so the array reaches (or comes
close to) its ideal share. Only parameters and optimizer state are completed; activations keep
exactly what the rules say.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from flax_escale._specs import mesh_axes_of

__all__ = ["Completion", "complete_spec"]


@dataclasses.dataclass(frozen=True)
class Completion:
    """A mesh axis the rules left idle, put to use on one dimension.

    Attributes:
        dim: The array dimension.
        mesh_axis: The axis added to the dimension's entry.
        size: The dimension's size.
        split: The dimension's total split after the addition (the product of its axes).
    """

    dim: int
    mesh_axis: str
    size: int
    split: int

    @property
    def detail(self) -> str:
        """A sentence for plans and reports."""
        return (
            f"idle mesh axis {self.mesh_axis!r} put to use on dim {self.dim} (size {self.size}, "
            f"now split {self.split} ways)"
        )


def complete_spec(
    spec: PartitionSpec,
    shape: Sequence[int],
    mesh_shape: Mapping[str, int],
    axes: Sequence[str],
    *,
    keep: Collection[int] = (),
) -> tuple[PartitionSpec, tuple[Completion, ...]]:
    """Adds each of ``axes`` that ``spec`` leaves idle to a dimension it divides.

    Larger axes go first; each goes to the dimension that keeps the largest shard once split
    (the lowest such dimension on a tie), so that no dimension is cut finer than it has to be.
    An axis that divides no dimension stays idle. Axes of size 1 split nothing and are skipped.

    Args:
        spec: A valid spec for ``shape`` on the mesh (as the resolver gives).
        shape: The array shape.
        mesh_shape: Mesh axis name to size.
        axes: The mesh axes that may be added (those parameters are split over).
        keep: Dimensions left as they are: a layer stack's, which ``scan`` slices one layer
            at a time (split, each layer would live on a subset of the devices).

    Returns:
        The completed spec (``spec`` itself when nothing was added) and what was added.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> from flax_escale.resolve import complete_spec
        >>> spec, added = complete_spec(P(None, "tp"), (50257, 1600), {"fsdp": 4, "tp": 2},
        ...                             ("fsdp", "tp"))
        >>> spec
        P(None, ('tp', 'fsdp'))
        >>> added[0].detail
        "idle mesh axis 'fsdp' put to use on dim 1 (size 1600, now split 8 ways)"
    """
    entries: list[Any] = [*spec, *(None,) * (len(shape) - len(spec))]
    per_dim = [list(mesh_axes_of(entry)) for entry in entries]
    used = {axis for names in per_dim for axis in names}
    idle = sorted(
        (a for a in dict.fromkeys(axes) if a not in used and mesh_shape.get(a, 1) > 1),
        key=lambda a: -mesh_shape[a],
    )
    added: list[Completion] = []
    for axis in idle:
        best, best_shard = None, 0
        for dim, size in enumerate(shape):
            if dim in keep:
                continue
            split = math.prod(mesh_shape[a] for a in per_dim[dim]) * mesh_shape[axis]
            if size % split == 0 and size // split > best_shard:
                best, best_shard = dim, size // split
        if best is None:
            continue
        per_dim[best].append(axis)
        split = math.prod(mesh_shape[a] for a in per_dim[best])
        added.append(Completion(best, axis, shape[best], split))
    if not added:
        return spec, ()
    for dim in {c.dim for c in added}:
        names = per_dim[dim]
        entries[dim] = names[0] if len(names) == 1 else tuple(names)
    return PartitionSpec(*entries), tuple(added)
