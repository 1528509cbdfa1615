"""What resolving one array gave: its spec, and everything that was passed over or corrected.

:func:`enforce` is the one policy for what could not apply, shared by every path that
resolves or fits a spec.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from jax.sharding import PartitionSpec

from flax_escale.axes import PartitionAxis
from flax_escale.axes._aliases import suggest_alias
from flax_escale.errors import ShardingCorrectionWarning, ShardingResolutionError
from flax_escale.resolve._complete import Completion
from flax_escale.resolve._fit import Correction

__all__ = ["PassedOver", "Resolution", "at_path", "enforce"]


@dataclasses.dataclass(frozen=True)
class PassedOver:
    """A rule skipped because its mesh axes do not divide the dimension (a later rule may apply).

    Attributes:
        dim: The array dimension.
        logical_name: The dimension's logical name.
        mesh_axes: The rule's mesh axes.
        size: The dimension's size.
    """

    dim: int
    logical_name: str
    mesh_axes: tuple[str, ...]
    size: int


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The result of resolving one array's logical axes.

    Attributes:
        logical_axes: The logical axes resolved, one per dimension (see ``padded``).
        spec: The resolved, valid ``PartitionSpec``.
        shape: The array shape, if known.
        mesh_shape: The mesh's ``(axis, size)`` pairs, if known.
        rules_spec: The spec the rules gave before corrections.
        corrections: Mesh axes dropped to make the spec valid.
        passed_over: Rules passed over because their axes do not divide the dimension.
        unknown_names: Logical names no rule mentions (left unsharded).
        padded: Trailing dimensions the logical axes did not name (Flax's short form, as
            ``nn.DenseGeneral``'s flattened-kernel annotations give): they are unsharded.
        completed: Idle mesh axes put to use on a parameter after the rules (see
            :func:`~flax_escale.resolve.complete_spec`); ``spec`` includes them.
    """

    logical_axes: tuple[Any, ...] | None
    spec: PartitionSpec
    shape: tuple[int, ...] | None
    mesh_shape: tuple[tuple[str, int], ...] | None
    rules_spec: PartitionSpec
    corrections: tuple[Correction, ...] = ()
    passed_over: tuple[PassedOver, ...] = ()
    unknown_names: tuple[str, ...] = ()
    padded: int = 0
    completed: tuple[Completion, ...] = ()

    @property
    def ok(self) -> bool:
        """``True`` when nothing was corrected and every logical name has a rule."""
        return not self.corrections and not self.unknown_names

    def describe(self, path: str | None = None) -> str:
        """A message naming the path, logical axes, shape, spec and mesh, and how to fix it."""
        mesh = dict(self.mesh_shape) if self.mesh_shape is not None else "(no mesh)"
        problems = [
            f"dimension {c.dim}{self._name(c.dim)}: {c.detail}; dropped {c.mesh_axes}. "
            + _FIXES[c.kind]
            for c in self.corrections
        ]
        problems += [
            f"logical name {name!r} has no rule, so it stays unsharded. "
            + (
                f"{_capitalized(hint)}; or add"
                if (hint := suggest_alias(name))
                else f"Use a PartitionAxis name such as {_KNOWN_HINT}, or add"
            )
            + f" a rule ({name!r}, mesh_axes) to rules= (({name!r}, None) to replicate on "
            "purpose)."
            for name in self.unknown_names
        ]
        given = (
            f"mesh axes {self.rules_spec}"
            if self.logical_axes is None
            else f"logical axes {self.logical_axes}"
        )
        result = f"resolve to {self.rules_spec}"
        if self.spec != self.rules_spec:
            result += f", corrected to {self.spec}"
        text = f"{given} with shape {self.shape} on mesh {mesh} {result}:\n  - " + (
            "\n  - ".join(problems)
        )
        return at_path(path, text)

    def _name(self, dim: int) -> str:
        if self.logical_axes is None or dim >= len(self.logical_axes):
            return ""
        return f" ({self.logical_axes[dim]})"


def at_path(path: str | None, text: str) -> str:
    """``text`` about the array at ``path``, naming it first (no path: ``text`` alone).

    Example:
        >>> from flax_escale.resolve._resolution import at_path
        >>> at_path("params/w", "no rule")
        "parameter 'params/w': no rule"
    """
    return f"parameter {path!r}: {text}" if path else text


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


_FIXES = {
    "not_in_mesh": "Add the axis to the mesh, or map the logical name to axes the mesh has.",
    "reused": "Use each mesh axis in at most one dimension (map the logical names of these "
    "dimensions to different mesh axes).",
    "not_divisible": "Make the size a multiple of the axes' size (pad it, or change the mesh), "
    "or map the logical name to other axes.",
    "truncated": "Give one spec entry per array dimension.",
}
_KNOWN_HINT = ", ".join(repr(n) for n in list(PartitionAxis().logical_axes())[:6]) + ", ..."


def enforce(
    resolution: Resolution, *, strict: bool, path: str | None = None, stacklevel: int = 2
) -> Resolution:
    """The one policy for what could not apply: an error with ``strict``, else a warning.

    Every path that resolves or fits a spec (parameters, constraints, data, reports) hands its
    :class:`Resolution` here, so nothing is dropped in silence and ``strict`` means the same
    everywhere.

    Args:
        resolution: The resolution to check.
        strict: Raise instead of warning.
        path: The parameter path or argument, named in the message.
        stacklevel: Passed to ``warnings.warn``, counted from the caller of ``enforce``.

    Returns:
        ``resolution``, when it is fine or only warned about.

    Raises:
        ShardingResolutionError: With ``strict``, if anything was corrected or a logical name
            has no rule.

    Example:
        >>> from flax_escale import create_mesh, resolve_logical_axes
        >>> from flax_escale.resolve import enforce
        >>> mesh = create_mesh((1, 8, 1, 1, 1))
        >>> r = resolve_logical_axes(("batch",), shape=(3,), mesh=mesh)
        >>> enforce(r, strict=True)
        Traceback (most recent call last):
        ...
        flax_escale.errors.ShardingResolutionError: logical axes ('batch',) with shape (3,) ...
    """
    if resolution.ok:
        return resolution
    if strict:
        raise ShardingResolutionError(
            resolution.describe(path) + "\n(strict=True; pass strict=False to correct instead.)"
        )
    warnings.warn(
        resolution.describe(path) + "\n(Pass strict=True to make this an error.)",
        ShardingCorrectionWarning,
        stacklevel=stacklevel + 1,
    )
    return resolution
