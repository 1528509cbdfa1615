"""Byte counts as people read them, for tables and messages."""

from __future__ import annotations

import math

__all__ = ["format_bytes"]


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
