"""Specs given directly in mesh axes, fitted and recorded as logical ones are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError
from flax_escale.resolve._fit import fit_spec
from flax_escale.resolve._resolution import Resolution, enforce

__all__ = ["fit_mesh_axes"]


def fit_mesh_axes(
    spec: Sequence[Any],
    *,
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    strict: bool = False,
    path: str | None = None,
) -> Resolution:
    """Fits a spec given directly in mesh axes to a shape and mesh, as a :class:`Resolution`.

    For arrays annotated with mesh axes rather than logical names (``nn.with_partitioning``,
    NNX ``sharding`` metadata in mesh axes), and for optimizer state taking its parameter's
    spec. There are no names to resolve: the spec stands where the rules' answer would, and it
    is fitted, every correction recorded, as :func:`resolve_logical_axes` fits that answer.

    Raises:
        ShardingResolutionError: In strict mode, if the spec had to be corrected.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.resolve import fit_mesh_axes
        >>> mesh = create_mesh((2, 4), ("dp", "tp"))
        >>> r = fit_mesh_axes(("dp", "tp"), shape=(8, 6), mesh=mesh)
        >>> r.spec, r.corrections[0].kind
        (P('dp', None), 'not_divisible')
    """
    if isinstance(spec, str):
        raise EscaleTypeError(
            f"spec must be a PartitionSpec or a sequence of entries, got the string {spec!r}; "
            f"write PartitionSpec({spec!r}) for one sharded dimension."
        )
    mesh = check.mesh(mesh)
    rules_spec = PartitionSpec(*spec)
    fitted, corrections = fit_spec(rules_spec, shape, mesh.shape)
    resolution = Resolution(
        None, fitted, tuple(shape), tuple(mesh.shape.items()), rules_spec, corrections
    )
    if strict:
        enforce(resolution, strict=True, path=path)
    return resolution
