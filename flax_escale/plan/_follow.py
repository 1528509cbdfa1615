"""The one rule for optimizer state following its parameters, whatever the entries are.

optax and NNX lay optimizer state out beside the parameters it tracks: a state leaf's path
ends with its parameter's, and its shape is the parameter's, or one dimension less (Adafactor's
factored statistics), or a placeholder. :func:`follow_params` says which parameter each leaf
tracks and which of its per-dimension entries (spec entries, logical names) the leaf keeps;
the optimizer-state shardings and the annotation reader both ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, TypeVar

import numpy as np

__all__ = ["Followed", "follow_params"]

T = TypeVar("T")

# The fields of optax's factored second-moment state (scale_by_factored_rms): the row statistic
# keeps all but the largest dimension, the column statistic all but the second largest.
_ROW, _COL = "v_row", "v_col"


class Followed(NamedTuple, Generic[T]):
    """The parameter a state leaf tracks, and what the leaf inherits from it.

    Attributes:
        param: The index of the parameter in the ``params`` given to :func:`follow_params`.
        entries: One of the parameter's entries per dimension of the leaf, or ``None`` when
            the leaf inherits nothing (a count or placeholder kept beside the parameter).
    """

    param: int
    entries: tuple[T, ...] | None


def follow_params(
    state: Sequence[tuple[str, Sequence[int]]],
    params: Sequence[tuple[str, Sequence[int], Sequence[T]]],
) -> list[Followed[T] | None]:
    """The one rule for optimizer state following its parameters.

    A state leaf tracks the parameter whose path ends its own (the longest such ending, see
    the lookup by path ending), and inherits its per-dimension entries (spec entries, logical
    names, anything) as follows:

    * a leaf of the parameter's shape (Adam's moments, momentum, ``v`` of an unfactored
      Adafactor) inherits all of them;
    * a leaf with one dimension less (Adafactor's factored statistics) inherits all but the
      dimension optax factored away. optax factors the two largest dimensions of a parameter
      of rank 2 or more, ordered by ``np.argsort(shape)`` (equal sizes: the lower index counts
      as smaller); the row statistic ``v_row`` drops the largest, the column statistic
      ``v_col`` the second largest. Which of the two a leaf is, the state's path says (a
      ``v_row`` or ``v_col`` component before the parameter's path); when it does not, the
      dimension is the one whose removal gives the leaf's shape, and when several do, the
      largest is dropped (``v_row``'s rule), else the second largest (``v_col``'s);
    * any other leaf (the ``(1,)`` placeholders of unfactored parameters) inherits nothing.

    A leaf whose path ends no parameter's (step counts) tracks none.

    Args:
        state: ``(path, shape)`` per state leaf, paths ``/``-joined like ``0/v_col/wi/kernel``.
        params: ``(path, shape, entries)`` per parameter, one entry per dimension.

    Returns:
        Per state leaf, a :class:`Followed` (the parameter's index and the inherited entries,
        ``None`` if it inherits nothing), or ``None`` if it tracks no parameter.

    Example:
        >>> from flax_escale.plan._follow import follow_params
        >>> params = [("embed", (16, 16), ("vocab", "hidden_state")), ("bias", (16,), ("tp",))]
        >>> state = [("0/v_row/embed", (16,)), ("0/v_col/embed", (16,)),
        ...          ("0/v/bias", (16,)), ("0/v_row/bias", (1,)), ("0/count", ())]
        >>> [f and f.entries for f in follow_params(state, params)]
        [('vocab',), ('hidden_state',), ('tp',), None, None]
        >>> follow_params(state, params)[3:]  # a placeholder beside its parameter; a count
        [Followed(param=1, entries=None), None]
    """
    params = params if isinstance(params, list) else list(params)

    def agree(i: int, j: int) -> bool:
        (_, shape_i, entries_i), (_, shape_j, entries_j) = params[i], params[j]
        return tuple(shape_i) == tuple(shape_j) and tuple(entries_i) == tuple(entries_j)

    lookup = _ParamLookup([path for path, _, _ in params], agree)
    followed: list[Followed[T] | None] = []
    append = followed.append
    # Adam's two moments of a parameter inherit the same: one Followed for both.
    whole: dict[int, Followed[T]] = {}
    for path, shape in state:
        found = lookup.match(path)
        if found is None:
            append(None)
            continue
        index, start = found
        _, param_shape, entries = params[index]
        shape, param_shape = tuple(shape), tuple(param_shape)
        if shape == param_shape:  # (most state: Adam's moments, momentum) keeps every entry
            same = whole.get(index)
            if same is None:
                same = whole[index] = Followed(index, tuple(entries))
            append(same)
            continue
        kept = _kept_dims(shape, param_shape, _factored_role(path[:start].split("/")))
        append(Followed(index, None if kept is None else tuple(entries[d] for d in kept)))
    return followed


def _factored_role(prefix: Sequence[str]) -> str | None:
    # Only the part of the path before the parameter's own: a parameter may be named v_row.
    for key in reversed(prefix):
        if key in (_ROW, _COL):
            return key
    return None


def _kept_dims(
    leaf: tuple[int, ...], param: tuple[int, ...], role: str | None
) -> tuple[int, ...] | None:
    # The parameter dimensions a state leaf keeps, in order; None when it follows none.
    if leaf == param:
        return tuple(range(len(param)))
    if len(param) < 2 or len(leaf) != len(param) - 1:
        return None
    removable = [d for d in range(len(param)) if param[:d] + param[d + 1 :] == leaf]
    if not removable:
        return None
    # The same call optax makes (optax._src.factorized), so ties order exactly as there.
    order = np.argsort(param)
    largest, second = int(order[-1]), int(order[-2])
    by_role = {_ROW: largest, _COL: second}.get(role) if role else None
    dropped = next(d for d in (by_role, largest, second, removable[-1]) if d in removable)
    return tuple(d for d in range(len(param)) if d != dropped)


class _ParamLookup:
    """Finds the parameter an optimizer state leaf tracks, from the end of the leaf's path.

    Optimizer states repeat the parameter tree under their own keys (``opt_state/0/mu/...``),
    so a state leaf's path ends with the end of its parameter's path. Every path ending (whole
    ``/``-separated components) is indexed whose owners all agree (one parameter, or copies
    that ``agree(i, j)`` says are alike, such as a parameter and its Adam moments); the longest
    ending a leaf's path shares wins. A parameter with the empty path (params that are one
    array) ends every path. Endings are kept as strings, which the garbage collector does not
    track: a large model has hundreds of thousands of them.

    Example:
        >>> from flax_escale.plan._follow import _ParamLookup
        >>> lookup = _ParamLookup(["p/up/w", "p/down/w"], lambda i, j: False)
        >>> lookup.match("opt_state/w") is None  # "w" ends both paths: it names neither
        True
        >>> lookup.match("opt_state/0/mu/down/w")  # (parameter, where the ending starts)
        (1, 15)
    """

    def __init__(self, paths: Sequence[str], agree: Callable[[int, int], bool]) -> None:
        by_ending: dict[str, int] = {}
        disputed = set()
        longest = 0
        for index, path in enumerate(paths):
            longest = max(longest, path.count("/") + 1)
            # Every ending, the whole path first; the empty path is its own only ending.
            start = 0
            while True:
                ending = path[start:]
                first = by_ending.setdefault(ending, index)
                if first != index and ending not in disputed and not agree(first, index):
                    disputed.add(ending)
                start = path.find("/", start) + 1
                if not start:
                    break
        for ending in disputed:
            del by_ending[ending]
        self._by_ending = by_ending
        self._longest = longest

    def match(self, path: str) -> tuple[int, int] | None:
        """The parameter whose path ends ``path``, and where that ending starts in ``path``."""
        by_ending = self._by_ending
        # No ending has more components than the longest parameter path: skip to there.
        start = 0
        for _ in range(path.count("/") + 1 - self._longest):
            start = path.find("/", start) + 1
        while True:
            index = by_ending.get(path[start:])
            if index is not None:
                return index, start
            start = path.find("/", start) + 1
            if not start:
                # Only a parameter that is one bare array (the empty path) ends every path.
                index = by_ending.get("")
                return None if index is None else (index, len(path))
