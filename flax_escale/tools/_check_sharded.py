"""The is-it-sharded check: large arrays split over the mesh axes their shapes allow."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale._units import format_bytes
from flax_escale.errors import EscaleError
from flax_escale.resolve import RulesLike
from flax_escale.sharding import spec_from_shape
from flax_escale.tools._report import as_plan

__all__ = ["UnshardedParameterError", "check_sharded"]


class UnshardedParameterError(EscaleError):
    """Large parameters are not split over mesh axes they could use."""


def check_sharded(
    tree: Any,
    mesh: Mesh | None = None,
    *,
    rules: RulesLike = None,
    min_bytes: int = 1 << 20,
    tolerance: float = 0.1,
    top: int = 5,
) -> None:
    """Raises if large arrays are not split over the mesh axes their shape allows.

    An array of at least ``min_bytes`` passes when its bytes per device are within
    ``tolerance`` of what the best split of its shape over the mesh's non-trivial axes would
    give (:func:`~flax_escale.sharding.spec_from_shape` finds that split).

    Args:
        tree: As for :func:`sharding_report`.
        mesh: The mesh; as for :func:`sharding_report`.
        rules: Logical-axis rules for logical annotations.
        min_bytes: Smaller arrays are not checked.
        tolerance: Allowed excess over the best split, as a fraction.
        top: How many of the largest offenders the error lists.

    Raises:
        UnshardedParameterError: Listing the largest offenders, their spec and bytes per device,
            and the axes (and a spec) they could use.
        EscaleTypeError: For ``tree`` or ``mesh`` as :func:`sharding_report` refuses them, or
            ``min_bytes``, ``top`` not an int or ``tolerance`` not a number (``EscaleError``
            when negative).
        EscaleError: For ``mesh``, ``rules`` or arrays on several meshes, as
            :func:`sharding_report` refuses them.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import check_sharded, create_mesh
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> fsdp_only = NamedSharding(mesh, PartitionSpec("fsdp"))
        >>> w = jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=fsdp_only)
        >>> check_sharded({"w": w})
        Traceback (most recent call last):
        ...
        flax_escale.tools._check_sharded.UnshardedParameterError: 1 large array(s) ...
    """
    min_bytes = check.non_negative_int(min_bytes, "min_bytes")
    tolerance = check.non_negative_number(tolerance, "tolerance")
    top = check.positive_int(top, "top")
    plan = as_plan(tree, mesh, rules)
    sizes = dict(plan.mesh.shape)
    offenders = []
    for entry in plan:
        if entry.nbytes < min_bytes:
            continue
        best = spec_from_shape(entry.shape, plan.mesh, min_shard_size=1)
        best_split = math.prod(sizes[a] for e in best for a in mesh_axes_of(e))
        actual = entry.nbytes_per_device(plan.mesh)
        if actual > entry.nbytes / best_split * (1 + tolerance):
            used = {a for e in entry.spec for a in mesh_axes_of(e)}
            unused = [a for e in best for a in mesh_axes_of(e) if a not in used]
            offenders.append((actual, entry.nbytes // best_split, entry, best, unused))
    if offenders:
        offenders.sort(key=lambda o: -o[0])
        lines = [
            f"  {e.path} {e.shape}: spec {e.spec}, {format_bytes(actual)} per device; could "
            f"also use {unused} (for example {best}, {format_bytes(ideal)})"
            for actual, ideal, e, best, unused in offenders[:top]
        ]
        raise UnshardedParameterError(
            f"{len(offenders)} large array(s) are not sharded over the mesh "
            f"{sizes} as far as their shapes allow (tolerance {tolerance:.0%}); the largest:\n"
            + "\n".join(lines)
            + "\nAnnotate them with logical names whose rules use these axes, or raise "
            "min_bytes / tolerance."
        )
