"""The meshes of N devices over the library's axes, and what rules one out before compiling."""

from __future__ import annotations

import math
from collections.abc import Sequence

from flax_escale import _checks as check
from flax_escale.errors import EscaleError
from flax_escale.mesh import DEFAULT_AXIS_NAMES

__all__ = ["PLANNED_AXES", "checked_axes", "mesh_shapes"]

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
        >>> from flax_escale.sizing import mesh_shapes
        >>> [tuple(s.values()) for s in mesh_shapes(4, ("fsdp", "tp"))]
        [(1, 4, 1, 1, 1), (1, 2, 1, 2, 1), (1, 1, 1, 4, 1)]
    """
    devices = check.positive_int(devices, "devices")
    axes = checked_axes(axes)
    shapes = []
    for sizes in _factorizations(devices, len(axes)):
        given = dict(zip(axes, sizes, strict=True))
        shapes.append({name: given.get(name, 1) for name in DEFAULT_AXIS_NAMES})
    return shapes


def checked_axes(axes: Sequence[str], argument: str = "axes") -> tuple[str, ...]:
    """``axes`` as a tuple, if they are distinct axes of the library's mesh, at least one.

    Raises:
        EscaleError: For an empty sequence, an axis the library's mesh lacks, or one given
            twice; the message names ``argument``.
        EscaleTypeError: For a string or a sequence of non-strings.
    """
    axes = check.names(axes, argument)
    unknown = [a for a in axes if a not in DEFAULT_AXIS_NAMES]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if unknown or repeated or not axes:
        problem = (
            f"{unknown} are not"
            if unknown
            else f"{repeated} are given twice"
            if repeated
            else "none is given"
        )
        raise EscaleError(
            f"{argument}: {tuple(axes)!r} must be distinct axes of the library's mesh "
            f"{DEFAULT_AXIS_NAMES}, at least one; {problem}."
        )
    return axes


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in _divisors(n) for rest in _factorizations(n // d, parts - 1)]


def _divisors(n: int) -> list[int]:
    # Largest first; by trial division up to the square root, so that a large N (a pod's
    # chips) is factored at once rather than by counting down from N.
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)
