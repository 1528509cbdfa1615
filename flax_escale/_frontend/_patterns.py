"""Logical axes declared by parameter-path patterns, as ``sharded_module`` takes them."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence

from flax_escale._regex import UserPattern
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["AxesPatterns", "shown_paths", "unused_pattern_note"]


@dataclasses.dataclass(frozen=True)
class AxesPatterns:
    """An ordered mapping from parameter-path patterns to logical axes, compiled once.

    A pattern is a regular expression matched against the end of a parameter's path relative to
    the declaring module, on whole ``/``-separated components: ``"kernel"`` matches ``kernel``
    and ``wi/kernel``, ``"wi/kernel"`` matches ``wi/kernel`` and ``block/wi/kernel`` but not
    ``xwi/kernel``. The first pattern that matches wins.

    Attributes:
        owner: Who declared the patterns (a class name), for messages.
        entries: ``(pattern, compiled regex, logical axes)`` in declaration order.

    Example:
        >>> from flax_escale._frontend import AxesPatterns
        >>> p = AxesPatterns.compile("MLP", {"wi/kernel": ("hidden_state", "mlp_intermediate"),
        ...                                  "kernel": ("mlp_intermediate", "hidden_state")})
        >>> p.match("wi/kernel")
        ('wi/kernel', ('hidden_state', 'mlp_intermediate'))
        >>> p.match("wo/kernel")
        ('kernel', ('mlp_intermediate', 'hidden_state'))
        >>> p.match("wo/bias") is None
        True
    """

    owner: str
    entries: tuple[tuple[str, UserPattern, tuple[str | None, ...]], ...] = ()

    @classmethod
    def compile(
        cls, owner: str, logical_axes: Mapping[str, Sequence[str | None]] | None
    ) -> AxesPatterns:
        """Checks and compiles ``{pattern: logical axes}``.

        Raises:
            EscaleTypeError: If it is not a mapping of strings to sequences of names or ``None``.
            EscaleError: If a pattern is not a valid regular expression.
        """
        if logical_axes is None:
            return cls(owner)
        if not isinstance(logical_axes, Mapping):
            raise EscaleTypeError(
                f"{owner}: logical_axes must map parameter-path patterns to logical axes, such "
                f'as {{"kernel": ("hidden_state", "mlp_intermediate")}}; got {logical_axes!r}.'
            )
        entries = []
        for pattern, names in logical_axes.items():
            if not isinstance(pattern, str):
                raise EscaleTypeError(f"{owner}: pattern {pattern!r} must be a string.")
            if (
                isinstance(names, str)
                or not isinstance(names, Sequence)
                or not all(n is None or isinstance(n, str) for n in names)
            ):
                raise EscaleTypeError(
                    f"{owner}: the logical axes of pattern {pattern!r} must be a tuple with one "
                    f"logical name (or None) per dimension, such as ('hidden_state', None); "
                    f"got {names!r}."
                )
            try:
                compiled = UserPattern(pattern, owner)
            except re.error as error:
                raise EscaleError(
                    f"{owner}: pattern {pattern!r} is not a valid regular expression: {error}."
                ) from None
            entries.append((pattern, compiled, tuple(names)))
        return cls(owner, tuple(entries))

    def then(self, fallback: AxesPatterns) -> AxesPatterns:
        """These patterns first, then ``fallback``'s (a subclass's before its parent's)."""
        return dataclasses.replace(self, entries=self.entries + fallback.entries)

    @property
    def patterns(self) -> tuple[str, ...]:
        """The patterns, in order."""
        return tuple(pattern for pattern, _, _ in self.entries)

    def match(self, path: str) -> tuple[str, tuple[str | None, ...]] | None:
        """The first ``(pattern, logical axes)`` whose pattern matches ``path``, if any."""
        # Whole trailing components: the pattern must match one of the path's suffixes that
        # start at a component boundary (the user's regex is used as written, flags and all).
        parts = path.split("/")
        suffixes = ["/".join(parts[i:]) for i in range(len(parts))]
        for pattern, compiled, names in self.entries:
            if any(compiled.fullmatch(suffix) for suffix in suffixes):
                return pattern, names
        return None

    def match_array(
        self, path: str, shape: Sequence[int], *, shown_path: str, stack_hint: str
    ) -> tuple[str, tuple[str | None, ...]] | None:
        """:meth:`match`, checking that the logical axes name every dimension of ``shape``.

        Raises:
            EscaleError: If the matching pattern's logical axes have another rank; the message
                names ``shown_path``, the shape and the pattern, and ends with ``stack_hint``.
        """
        found = self.match(path)
        if found is not None and len(found[1]) != len(shape):
            pattern, names = found
            raise EscaleError(
                f"{self.owner}: parameter {shown_path!r} of shape {tuple(shape)} matches "
                f"pattern {pattern!r}, whose logical axes {names} name {len(names)} dimensions "
                f"instead of {len(shape)}. Give one logical name per dimension ({stack_hint})."
            )
        return found


def unused_pattern_note(owner: str, pattern: str, kept: Sequence[str], unmatched: str) -> str:
    """Why a declared pattern annotated nothing, and what to do about it.

    Args:
        owner: Who declared the pattern.
        pattern: The pattern.
        kept: Paths it matched that keep the annotation the model gives them.
        unmatched: What to say when it matched nothing at all.
    """
    if not kept:
        return f"{owner}: pattern {pattern!r} {unmatched} Fix the pattern or remove it."
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return (
        f"{owner}: pattern {pattern!r} matched {shown}, which keep the annotations the model "
        "gives them, so it changed nothing. To replace a model's own annotation, pass "
        f"overrides={{{pattern!r}: logical_axes}} to init_sharded / plan_sharding; otherwise "
        "remove the pattern."
    )


def shown_paths(paths: Iterable[str], limit: int = 6) -> str:
    """The first ``limit`` of ``paths`` for a message, and how many there are in all.

    Example:
        >>> from flax_escale._frontend._patterns import shown_paths
        >>> shown_paths(["a/kernel", "a/bias"])
        'a/kernel, a/bias'
        >>> shown_paths([f"layer_{i}/w" for i in range(8)], limit=2)
        'layer_0/w, layer_1/w, ... (8 in all)'
        >>> shown_paths([])
        'none'
    """
    found = list(paths)
    if not found:
        return "none"
    shown = ", ".join(found[:limit])
    return shown + (f", ... ({len(found)} in all)" if len(found) > limit else "")
