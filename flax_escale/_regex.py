"""Users' regular expressions (partition rules, annotation patterns), matched within a bound.

Python's ``re`` backtracks without limit: a pattern such as ``(a|aa)+$`` takes exponential time
on a long enough path, and a rule table holding one would hang the call that reads it. These
patterns are compiled with the ``regex`` package instead, which matches the same syntax and
avoids much of that backtracking, and which can give up after a time: a match that takes longer
than :data:`MATCH_SECONDS` is an error naming the pattern and the path.
"""

from __future__ import annotations

import re
from typing import Any

import regex

from flax_escale.errors import EscaleError

__all__ = ["MATCH_SECONDS", "UserPattern"]

MATCH_SECONDS = 1.0
"""How long one match of a user's pattern against one path may take (paths are short: a
pattern that needs longer is backtracking without end)."""


class UserPattern:
    """A user's regular expression, compiled; its matches are bounded in time.

    Example:
        >>> from flax_escale._regex import UserPattern
        >>> bool(UserPattern("kernel$", "rules").search("layer_0/mlp/kernel"))
        True
        >>> UserPattern("(a|aa)+$", "rules").search("a" * 60 + "b")
        Traceback (most recent call last):
        ...
        flax_escale.errors.EscaleError: rules: the pattern '(a|aa)+$' took over 1 s against ...
    """

    __slots__ = ("_compiled", "pattern", "where")

    def __init__(self, pattern: str, where: str) -> None:
        """Compiles ``pattern``; ``where`` names it in errors.

        Raises:
            re.error: If ``pattern`` is not a regular expression as ``re`` reads it (``re``'s
                syntax and messages are the ones users know; ``regex`` accepts all of it).
        """
        re.compile(pattern)
        self.pattern = pattern
        self.where = where
        self._compiled = regex.compile(pattern)

    def search(self, text: str) -> Any:
        """``re.search``'s answer, or an error once :data:`MATCH_SECONDS` have passed."""
        return self._bounded(self._compiled.search, text)

    def fullmatch(self, text: str) -> Any:
        """``re.fullmatch``'s answer, or an error once :data:`MATCH_SECONDS` have passed."""
        return self._bounded(self._compiled.fullmatch, text)

    def _bounded(self, match: Any, text: str) -> Any:
        try:
            return match(text, timeout=MATCH_SECONDS)
        except TimeoutError:
            raise EscaleError(
                f"{self.where}: the pattern {self.pattern!r} took over {MATCH_SECONDS:g} s "
                f"against {text!r}: a repetition of a repetition that can match alike (such "
                "as (a|aa)+ or (a+)+) backtracks exponentially; write it with one repetition "
                "(a+), or an atomic group (?>...)."
            ) from None
