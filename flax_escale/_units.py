"""Byte counts as people read and write them: in tables and messages, and as arguments."""

from __future__ import annotations

import math
import re

from flax_escale import _checks as check
from flax_escale.errors import EscaleError

__all__ = ["format_bytes", "parse_bytes"]


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB, GiB or TiB, with two decimals above bytes.

    Example:
        >>> from flax_escale._units import format_bytes
        >>> format_bytes(512), format_bytes(3 * 1024**3)
        ('512 B', '3.00 GiB')
    """
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = min(int(math.log(max(nbytes, 1), 1024)), len(units) - 1)
    digits = 0 if power == 0 else 2
    return f"{nbytes / 1024**power:.{digits}f} {units[power]}"


_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)


def parse_bytes(value: int | str, name: str = "memory") -> int:
    """Bytes from an int or a size such as ``"16GiB"``, ``"80GB"``, ``"512MiB"``, ``"1.5T"``.

    Binary prefixes (``GiB``) are powers of 1024, decimal ones (``GB``, ``G``) of 1000.

    Raises:
        EscaleError: If the text is not a size or the size is not positive.
        EscaleTypeError: If ``value`` is neither an int nor a string.

    Example:
        >>> from flax_escale.sizing import parse_bytes
        >>> parse_bytes("16GiB"), parse_bytes("80GB"), parse_bytes(1024)
        (17179869184, 80000000000, 1024)
    """
    if isinstance(value, str):
        match = _BYTES.match(value)
        if match is None:
            raise EscaleError(
                f"{name}: {value!r} is not a size; write it like '16GiB', '80GB' or 17179869184."
            )
        number, prefix, binary = match.groups()
        power = "kmgt".index(prefix.lower()) + 1 if prefix else 0
        value = int(float(number) * (1024 if binary else 1000) ** power)
        if value <= 0:
            raise EscaleError(f"{name}: the size must be positive, got {match.group(0)!r}.")
        return value
    return check.positive_int(value, name)
