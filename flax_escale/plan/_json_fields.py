"""Reading a plan's JSON value by value: each field checked for the type ``to_json`` wrote.

A snapshot is a file people edit, merge and copy by hand, so nothing in it is trusted: each
reader below checks one kind of value and converts it to what the plan holds, and a value of
another kind stops the load with the field's place in the file (``arrays[3].shape[0]``) and
what was expected, rather than failing later, far from the file, as a raw error.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

__all__ = [
    "MISSING",
    "Read",
    "WrongValue",
    "axes_entry",
    "boolean",
    "dtype",
    "integer",
    "list_of",
    "names",
    "one_of",
    "optional",
    "pair",
    "record",
    "rules",
    "short",
    "spec",
    "text",
]

Read = Callable[[Any], Any]
"""A reader: the JSON value in, the plan's value out, or :class:`WrongValue`."""

MISSING = object()
"""Stands for a field the JSON object lacks."""


class WrongValue(Exception):
    """A JSON value is not what its field holds (the loader turns it into an ``EscaleError``).

    Attributes:
        value: The value found (:data:`MISSING` for a missing field).
        expected: What the field holds, as a phrase.
        at: Where inside the field it sits (``"[0].dim"``), built up as it bubbles out.
    """

    def __init__(self, value: Any, expected: str, at: str = "") -> None:
        super().__init__(expected)
        self.value, self.expected, self.at = value, expected, at

    def inside(self, step: str) -> WrongValue:
        """The same wrong value, one level further out (``step`` is ``[i]`` or ``.name``)."""
        return WrongValue(self.value, self.expected, step + self.at)


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 60, 60, 8, 4


def short(value: Any) -> str:
    """``value`` as messages show it: ``missing``, or a ``repr`` cut to a line."""
    if value is MISSING:
        return "missing"
    return _SHORT.repr(value)


def text(value: Any) -> str:
    """A string."""
    if not isinstance(value, str):
        raise WrongValue(value, "a string")
    return value


def boolean(value: Any) -> bool:
    """``true`` or ``false``."""
    if not isinstance(value, bool):
        raise WrongValue(value, "true or false")
    return value


def integer(minimum: int) -> Read:
    """A reader of whole numbers of at least ``minimum`` (``true`` is not one)."""

    def read(value: Any) -> int:
        if type(value) is not int or value < minimum:
            raise WrongValue(value, f"a whole number >= {minimum}")
        return value

    return read


def one_of(*choices: str) -> Read:
    """A reader of one of ``choices``."""

    def read(value: Any) -> str:
        if value not in choices:
            raise WrongValue(value, f"one of {list(choices)}")
        return value

    return read


def optional(read: Read) -> Read:
    """``null``, or what ``read`` reads."""
    return lambda value: None if value is None else read(value)


def list_of(read: Read, what: str) -> Read:
    """A reader of a list of what ``read`` reads (``what`` names it), as a tuple."""

    def read_list(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise WrongValue(value, f"a list of {what}")
        found = []
        for index, item in enumerate(value):
            try:
                found.append(read(item))
            except WrongValue as wrong:
                raise wrong.inside(f"[{index}]") from None
        return tuple(found)

    return read_list


def pair(first: Read, second: Read, what: str) -> Read:
    """A reader of a two-element list (``what`` names it), as a tuple."""

    def read(value: Any) -> tuple[Any, Any]:
        if not isinstance(value, list) or len(value) != 2:
            raise WrongValue(value, what)
        items = []
        for index, (item, read_item) in enumerate(zip(value, (first, second), strict=True)):
            try:
                items.append(read_item(item))
            except WrongValue as wrong:
                raise wrong.inside(f"[{index}]") from None
        return items[0], items[1]

    return read


def record(make: Callable[..., Any], **fields: Read) -> Read:
    """A reader of a JSON object with exactly these ``fields``, given to ``make`` by name."""

    def read(value: Any) -> Any:
        if not isinstance(value, dict):
            raise WrongValue(value, f"an object with the fields {sorted(fields)}")
        read_fields = {}
        for name, read_field in fields.items():
            try:
                read_fields[name] = read_field(value.get(name, MISSING))
            except WrongValue as wrong:
                raise wrong.inside(f".{name}") from None
        return make(**read_fields)

    return read


def axes_entry(value: Any) -> str | tuple[str, ...] | None:
    """One spec entry: ``null``, a mesh axis name, or a list of names (as a tuple)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise WrongValue(value, "null, a mesh axis name or a list of names")


def spec(value: Any) -> PartitionSpec:
    """A ``PartitionSpec``: a list of spec entries."""
    return PartitionSpec(*list_of(axes_entry, "spec entries (null, a name or names)")(value))


names = list_of(axes_entry, "logical names (null, a name or names)")
"""Logical axes: per dimension ``null``, a name, or a list of names."""

rules = list_of(pair(text, axes_entry, "a [logical name, mesh axes] pair"), "rules")
"""Logical-axis rules: ``[name, mesh axes]`` pairs."""


def dtype(value: Any) -> np.dtype:
    """A NumPy dtype's name."""
    if isinstance(value, str):
        try:
            return np.dtype(value)
        except TypeError:
            pass
    raise WrongValue(value, "a dtype name such as 'float32'")
