"""eformer's sharding methods: the candidates it suggests for a shape, and where they go.

A method is a tuple of mesh axes. For a shape, eformer suggests in priority order: the pair
``(fsdp, sp)`` for arrays of rank 2 or more whose first two dimensions hold at least
``fsdp * sp`` elements, ``dp``, ``sp`` alone when the pair was not suggested, ``tp``, and
``fsdp`` alone when no earlier method has it (each only if the mesh has the axis).

Placing methods on a shape takes two passes, as in eformer. The first is for large
dimensions: a one-axis method goes on the first free dimension of at least ``max(min_shard_size,
elements // (2 * devices))`` that its axis divides; a two-axis method ``(a, b)`` puts ``a`` on
dimension 0 and ``b`` on dimension 1 when both are free and the first two dimensions together
divide by the pair, or else puts the pair together on dimension 0 when the pair does not divide
those two but divides dimension 0, and either placement ends the pass. Only if the first pass
placed nothing does the second run, with ``min_shard_size`` as the bar for one-axis methods and
the ``(fsdp, sp)`` pair spread over dimensions 0 and 1 (or together on dimension 0).
Methods of other lengths are passed over. A spec has one entry per dimension.

Two things eformer does are not done here, as each gives a spec JAX refuses: an axis is
placed on a dimension only if it divides that dimension (eformer checks the pair against the
product of the first two dimensions only, and places the second pass's pair unchecked), and a
mesh axis is used at most once in a spec. A placement either rule forbids is passed over. And
one thing is done differently: a one-axis method whose axis has size 1 is passed over, since
it splits nothing, where eformer spends the dimension on it (``dp`` on an ``fsdp=8`` mesh takes
a 1,024-element vector's only dimension, and the ``fsdp`` method after it finds no room).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from flax_escale.axes import PartitionAxis

__all__ = ["Method", "place_methods", "suggested_methods"]

Method = tuple[str, ...]


def suggested_methods(
    shape: Sequence[int], axis_sizes: Mapping[str, int], paxis: PartitionAxis
) -> list[Method]:
    """The methods eformer suggests for ``shape``, in priority order (see the module doc).

    ``paxis`` names the ``fsdp``, ``sp``, ``dp`` and ``tp`` axes (eformer's literal names by
    default).
    """
    fsdp, sp = paxis.fully_sharded_data_parallel_axis, paxis.sequence_parallel_axis
    dp, tp = paxis.data_parallel_axis, paxis.tensor_parallel_axis
    rank = len(shape)
    pair_fits = (
        rank >= 2
        and fsdp in axis_sizes
        and sp in axis_sizes
        and shape[0] * shape[1] >= axis_sizes[fsdp] * axis_sizes[sp]
    )
    candidates = [
        ((fsdp, sp), pair_fits),
        ((dp,), rank >= 1 and dp in axis_sizes),
        ((sp,), rank >= 2 and sp in axis_sizes and not pair_fits),
        ((tp,), tp in axis_sizes),
    ]
    methods = [method for method, wanted in candidates if wanted]
    if fsdp in axis_sizes and not any(fsdp in method for method in methods):
        methods.append((fsdp,))
    return methods


def place_methods(
    shape: Sequence[int],
    methods: Sequence[Method],
    axis_sizes: Mapping[str, int],
    *,
    devices: int,
    min_shard_size: int,
    pair: Method,
) -> PartitionSpec:
    """The spec eformer's two passes give ``methods`` on ``shape`` (see the module docstring).

    Args:
        shape: The array's shape.
        methods: Tuples of mesh axes of ``axis_sizes``, each naming an axis at most once.
        axis_sizes: The mesh's axis sizes.
        devices: The mesh's device count.
        min_shard_size: The smallest dimension a one-axis method goes on in the second pass.
        pair: The ``(fsdp, sp)`` method, the only pair the second pass places.

    Returns:
        A ``PartitionSpec`` with one entry per dimension (``P()`` for a scalar).
    """
    if not shape:
        return PartitionSpec()
    layout = _Layout(tuple(shape), axis_sizes)
    floor = max(min_shard_size, math.prod(shape) // (2 * devices))
    # A size-1 axis splits nothing: it would only take a dimension a real split could use.
    methods = [m for m in methods if len(m) != 1 or axis_sizes[m[0]] > 1]
    for method in methods:
        if len(method) == 1:
            layout.first_fit(method[0], floor)
        elif len(method) == 2 and layout.place_pair(method, checked_head=True):
            break
    if layout.is_empty():
        for method in methods:
            if len(method) == 1:
                layout.first_fit(method[0], min_shard_size)
            elif method == pair and layout.place_pair(method, checked_head=False):
                break
    return PartitionSpec(*layout.entries)


class _Layout:
    """One spec being filled: an entry per dimension and the mesh axes already used."""

    def __init__(self, shape: tuple[int, ...], axis_sizes: Mapping[str, int]) -> None:
        self.shape = shape
        self.sizes = axis_sizes
        self.entries: list[str | Method | None] = [None] * len(shape)
        self.used: set[str] = set()

    def is_empty(self) -> bool:
        return not self.used

    def _fits(self, dim: int, axes: Method) -> bool:
        return (
            dim < len(self.shape)
            and self.entries[dim] is None
            and self.used.isdisjoint(axes)
            and self.shape[dim] % math.prod(self.sizes[a] for a in axes) == 0
        )

    def _put(self, dim: int, entry: str | Method) -> None:
        self.entries[dim] = entry
        self.used.update((entry,) if isinstance(entry, str) else entry)

    def first_fit(self, axis: str, floor: int) -> None:
        """Puts ``axis`` on the first free dimension of at least ``floor`` that it divides."""
        for dim, size in enumerate(self.shape):
            if size >= floor and self._fits(dim, (axis,)):
                self._put(dim, axis)
                return

    def place_pair(self, pair: Method, *, checked_head: bool) -> bool:
        """Spreads ``pair`` over dimensions 0 and 1, or puts it whole on dimension 0.

        With ``checked_head`` (the first pass), the spread needs the first two dimensions
        together to divide by the pair, each dimension at least as large as its axis, and the
        whole placement is tried only when they do not. Returns whether anything was placed.
        """
        a, b = pair
        spread = self._fits(0, (a,)) and self._fits(1, (b,))
        whole = self._fits(0, pair)
        if checked_head:
            if len(self.shape) < 2:
                return False
            rows, cols = self.shape[:2]
            split = self.sizes[a] * self.sizes[b]
            if rows * cols >= split and rows * cols % split == 0:
                spread = spread and rows >= self.sizes[a] and cols >= self.sizes[b]
                whole = False
            else:
                spread = False
                whole = whole and rows >= split
        if spread:
            self._put(0, a)
            self._put(1, b)
        elif whole:
            self._put(0, pair)
        return spread or whole
