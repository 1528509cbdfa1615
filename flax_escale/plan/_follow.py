"""The one rule for optimizer state following its parameters, whatever the entries are.

optax and NNX lay optimizer state out beside the parameters it tracks: a state leaf's path
ends with its parameter's, and its shape is the parameter's, or one dimension less (Adafactor's
factored statistics), or a placeholder. :func:`follow_params` says which parameter each leaf
tracks and which of its per-dimension entries (spec entries, logical names) the leaf keeps;
the optimizer-state shardings and the annotation reader both ask it.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    params = list(params)
    lookup = _ParamLookup([(_keys(path), (tuple(shape), tuple(e))) for path, shape, e in params])
    followed: list[Followed[T] | None] = []
    for path, shape in state:
        keys = _keys(path)
        found = lookup.match(keys)
        if found is None:
            followed.append(None)
            continue
        index, start = found
        _, param_shape, entries = params[index]
        kept = _kept_dims(tuple(shape), tuple(param_shape), _factored_role(keys[:start]))
        followed.append(Followed(index, None if kept is None else tuple(entries[d] for d in kept)))
    return followed


def _keys(path: str) -> tuple[str, ...]:
    # The empty path (params that are one bare array) has no components, so every leaf ends it.
    return tuple(path.split("/")) if path else ()


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


class _ParamLookup(Generic[T]):
    """Finds the parameter an optimizer state leaf tracks, from the end of the leaf's path.

    Optimizer states repeat the parameter tree under their own keys (``opt_state/0/mu/...``),
    so a state leaf's path ends with the end of its parameter's path. Every path ending is
    indexed whose owners all carry the same value (one parameter, or copies that agree, such
    as a parameter and its Adam moments); the longest ending a leaf's path shares wins. A
    parameter with the empty path (params that are one array) ends every path.

    Example:
        >>> from flax_escale.plan._follow import _ParamLookup
        >>> lookup = _ParamLookup([(("p", "up", "w"), "up"), (("p", "down", "w"), "down")])
        >>> lookup.match(("opt_state", "w")) is None  # "w" ends both paths: it names neither
        True
        >>> lookup.match(("opt_state", "0", "mu", "down", "w"))  # (parameter, ending's start)
        (1, 3)
    """

    def __init__(self, params: Sequence[tuple[Sequence[str], T]]) -> None:
        self._values = [value for _, value in params]
        owners: dict[tuple[str, ...], list[int]] = {}
        for index, (keys, _) in enumerate(params):
            keys = tuple(keys)
            # Non-empty endings only, but for a parameter whose path is empty (a bare array).
            for start in range(max(len(keys), 1)):
                owners.setdefault(keys[start:], []).append(index)
        self._by_ending = {
            end: found[0]
            for end, found in owners.items()
            if all(self._values[i] == self._values[found[0]] for i in found)
        }

    def match(self, keys: Sequence[str]) -> tuple[int, int] | None:
        """The index of the parameter whose path ends ``keys``, and where that ending starts."""
        keys = tuple(keys)
        for start in range(len(keys) + 1):
            index = self._by_ending.get(keys[start:])
            if index is not None:
                return index, start
        return None
