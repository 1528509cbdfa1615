"""The meshes of N devices over the library's axes, and what rules one out before compiling."""

from __future__ import annotations

from collections.abc import Sequence

from flax_escale import _checks as check
from flax_escale.errors import EscaleError
from flax_escale.mesh import DEFAULT_AXIS_NAMES

__all__ = ["PLANNED_AXES", "mesh_shapes"]

PLANNED_AXES = ("dp", "fsdp", "tp", "sp")
"""The axes planned by default; ``ep`` joins them when the model has an expert axis."""


def mesh_shapes(devices: int, axes: Sequence[str] = PLANNED_AXES) -> list[dict[str, int]]:
    """Every way to lay ``devices`` out over ``axes``: one size per axis, their product N.

    Args:
        devices: The device count N.
        axes: The axes to spread the devices over (others have size 1).

    Returns:
        ``{axis: size}`` for every axis of the library's mesh (``dp, fsdp, ep, tp, sp``), in a
        fixed order: most devices on the earliest axes first.

    Example:
        >>> from flax_escale.planning import mesh_shapes
        >>> [tuple(s.values()) for s in mesh_shapes(4, ("fsdp", "tp"))]
        [(1, 4, 1, 1, 1), (1, 2, 1, 2, 1), (1, 1, 1, 4, 1)]
    """
    devices = check.positive_int(devices, "devices")
    axes = check.names(axes, "axes")
    unknown = [a for a in axes if a not in DEFAULT_AXIS_NAMES]
    if unknown or len(set(axes)) != len(axes) or not axes:
        raise EscaleError(
            f"axes: {tuple(axes)!r} must be distinct axes of the library's mesh "
            f"{DEFAULT_AXIS_NAMES}, at least one; {unknown} are not."
        )
    shapes = []
    for sizes in _factorizations(devices, len(axes)):
        given = dict(zip(axes, sizes, strict=True))
        shapes.append({name: given.get(name, 1) for name in DEFAULT_AXIS_NAMES})
    return shapes


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    divisors = [d for d in range(n, 0, -1) if n % d == 0]
    return [(d, *rest) for d in divisors for rest in _factorizations(n // d, parts - 1)]
