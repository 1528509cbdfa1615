"""Copying a frozen dataclass with some fields changed, without checking it again."""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["replace_checked"]

T = TypeVar("T")


def replace_checked(instance: T, **changes: Any) -> T:
    """``dataclasses.replace`` for values whose fields are already known to be valid.

    ``dataclasses.replace`` runs ``__init__`` (and ``__post_init__``, which checks) again; a
    large model's plan makes tens of thousands of copies of annotations and resolutions that
    differ from a checked one by a shape or a spec the library computed. Only for frozen
    dataclasses without ``__slots__`` and for changes the caller has made valid.

    Example:
        >>> import dataclasses
        >>> from flax_escale._dataclasses import replace_checked
        >>> @dataclasses.dataclass(frozen=True)
        ... class Point:
        ...     x: int
        ...     y: int
        >>> replace_checked(Point(1, 2), y=5)
        Point(x=1, y=5)
    """
    made = object.__new__(type(instance))
    made.__dict__.update(instance.__dict__, **changes)
    return made
