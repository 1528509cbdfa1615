"""Mesh descriptions as strings, for command lines and config files."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale.errors import MeshError
from flax_escale.mesh._creation import PIPELINE_AXIS, create_mesh

__all__ = ["parse_mesh_from_string", "parse_mesh_shape"]

_SIZE = re.compile(r"-?\d+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_mesh_shape(
    axis_dims: str, names: Sequence[str], *, partial: bool = False
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Parses a mesh string into axis sizes and axis names, without building a mesh.

    Two forms are accepted. The named form ``"dp:2,tp:4"`` names every axis; the mesh's axis
    order is the order of the string. The positional form ``"2,4"`` gives the sizes of ``names``
    in order. Spaces around tokens are ignored. Every size is a positive integer, except that
    one may be ``-1`` (that axis takes the devices the others leave).

    With ``partial=True`` the named form may leave axes out, as a command line's ``--mesh
    fsdp:4,tp:2`` does; each gets size 1, and the mesh's axis order is the order of ``names``
    (the string's order would be arbitrary for the axes it leaves out).

    The named form may also give the stage axis ``pp`` (:data:`PIPELINE_AXIS`) when ``names``
    lacks it: pipelines are opt-in, so ``"pp:2,fsdp:2,tp:2"`` adds it to the default axes.
    With ``partial=True`` it comes first, as the outermost axis (the one a pipeline's
    activations cross between hosts).

    Args:
        axis_dims: The mesh string.
        names: The axis names the mesh must have, each exactly once.
        partial: Whether the named form may leave axes of ``names`` out (size 1).

    Returns:
        ``(sizes, names)`` in mesh order.

    Raises:
        MeshError: For a malformed or non-integer token (``fsdp=4`` included: write
            ``fsdp:4``), a size of 0 or below other than one ``-1``, two ``-1``, an unknown or
            repeated name, a missing name (unless ``partial``), a positional string whose
            length differs from ``names``, or ``names`` naming an axis twice; in every mode.
            The message quotes the offending token.

    Example:
        >>> from flax_escale.mesh import parse_mesh_shape
        >>> parse_mesh_shape("tp:4, dp:2", ["dp", "tp"])
        ((4, 2), ('tp', 'dp'))
        >>> parse_mesh_shape("2,-1", ["dp", "tp"])
        ((2, -1), ('dp', 'tp'))
        >>> parse_mesh_shape("tp:4", ["dp", "fsdp", "tp"], partial=True)
        ((1, 1, 4), ('dp', 'fsdp', 'tp'))
        >>> parse_mesh_shape("fsdp:2,pp:4", ["dp", "fsdp", "tp"], partial=True)
        ((4, 1, 2, 1), ('pp', 'dp', 'fsdp', 'tp'))
    """
    check.string(axis_dims, "axis_dims", "'dp:2,tp:4' or '2,4'")
    expected = check.names(names, "names")
    check.flag(partial, "partial")
    repeated = sorted({name for name in expected if expected.count(name) > 1})
    if repeated:
        raise MeshError(
            f"names {expected} name the axes {repeated} more than once; a mesh has each axis "
            "once: give each name once."
        )
    if not axis_dims.strip():
        raise MeshError(f"mesh string {axis_dims!r} is empty; {_FORMS}.")
    tokens = [t.strip() for t in axis_dims.split(",")]
    if any(":" in t for t in tokens):
        sizes, order = _parse_named(axis_dims, tokens, expected, partial)
        if partial:
            given = dict(zip(order, sizes, strict=True))
            staged = (
                (PIPELINE_AXIS,) if PIPELINE_AXIS in given and PIPELINE_AXIS not in expected else ()
            )
            order = (*staged, *expected)
            sizes = tuple(given.get(name, 1) for name in order)
    else:
        sizes = tuple(_parse_size(axis_dims, t, t) for t in tokens)
        if len(sizes) != len(expected):
            raise MeshError(
                f"mesh string {axis_dims!r} gives {len(sizes)} sizes but there are "
                f"{len(expected)} axis names {expected}: give one size per name, or use the "
                "named form 'name:size,...'."
            )
        order = expected
    if sizes.count(-1) > 1:
        raise MeshError(
            f"mesh string {axis_dims!r} gives {sizes.count(-1)} sizes of -1; only one axis can "
            "take the devices the others leave: give the other axes their sizes."
        )
    return sizes, order


def _parse_named(
    text: str, tokens: list[str], expected: tuple[str, ...], partial: bool
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    sizes: list[int] = []
    order: list[str] = []
    for token in tokens:
        name, sep, size = (part.strip() for part in token.partition(":"))
        if not sep or ":" in size or not _NAME.fullmatch(name):
            raise MeshError(
                f"mesh string {text!r}: token {token!r} is not of the form 'name:size'"
                f"{_equals_hint(token)}; do not mix named and positional sizes."
            )
        if name not in expected and name != PIPELINE_AXIS:
            raise MeshError(
                f"mesh string {text!r}: unknown axis name {name!r} in token {token!r}; the "
                f"axis names are {expected} (and the stage axis {PIPELINE_AXIS!r})."
            )
        if name in order:
            raise MeshError(
                f"mesh string {text!r}: axis name {name!r} is repeated in token {token!r}; "
                "give each axis once."
            )
        sizes.append(_parse_size(text, size, token))
        order.append(name)
    missing = [n for n in expected if n not in order]
    if missing and not partial:
        raise MeshError(
            f"mesh string {text!r} does not give a size for axis names {tuple(missing)!r}: "
            f"name every axis of {expected}, using size 1 for an unused one."
        )
    return tuple(sizes), tuple(order)


def _parse_size(text: str, size: str, token: str) -> int:
    if not _SIZE.fullmatch(size):
        raise MeshError(
            f"mesh string {text!r}: size {size!r} in token {token!r} is not an integer"
            f"{_equals_hint(token)}; {_FORMS}."
        )
    value = int(size)
    if value < 1 and value != -1:
        raise MeshError(
            f"mesh string {text!r}: size {value} in token {token!r} is not a positive integer; "
            "every axis has at least one device (an unused axis has size 1), and one size may "
            f"be -1 for the devices the others leave; {_FORMS}."
        )
    return value


def _equals_hint(token: str) -> str:
    # 'fsdp=4' is how other tools (and the mesh's own repr) write an axis: say the form here.
    name, sep, size = (part.strip() for part in token.partition("="))
    return f" (write {name}:{size}, with a colon)" if sep and name and size else ""


_FORMS = "write 'name:size,...' such as 'dp:2,tp:4', or one size per axis such as '2,4'"


def parse_mesh_from_string(
    axis_dims: str, names: Sequence[str], *, partial: bool = False, **mesh_kwargs: Any
) -> Mesh:
    """Builds a mesh from a string such as ``"dp:2,tp:4"`` or ``"2,4"``.

    See :func:`~flax_escale.mesh.parse_mesh_shape` for the two forms and ``partial``. The sizes
    and names go to :func:`~flax_escale.create_mesh`, with ``mesh_kwargs`` (``axis_types=``,
    ``devices=``, ...).

    Args:
        axis_dims: The mesh string.
        names: The axis names the mesh must have, each exactly once.
        partial: Whether the named form may leave axes of ``names`` out (size 1).
        **mesh_kwargs: Keyword arguments for :func:`~flax_escale.create_mesh`.

    Returns:
        The ``jax.sharding.Mesh``.

    Raises:
        MeshError: As :func:`~flax_escale.mesh.parse_mesh_shape` and
            :func:`~flax_escale.create_mesh` do.

    Example:
        >>> from flax_escale import parse_mesh_from_string
        >>> mesh = parse_mesh_from_string("tp:4,dp:2", ["dp", "tp"])
        >>> dict(mesh.shape)
        {'tp': 4, 'dp': 2}
    """
    sizes, order = parse_mesh_shape(axis_dims, names, partial=partial)
    return create_mesh(sizes, order, **mesh_kwargs)
