"""Which tokens each device of a context axis holds: the sequence order that balances causal work.

Split contiguously over ``c`` devices, a causal mask leaves the first device's queries almost
nothing to attend to and the last's almost everything: device ``i`` scores about ``2i + 1``
times the first's pairs, the last ``(2c - 1) / c`` times the mean. Reordering the sequence once,
before the step, evens it out:

- ``"dual_chunk"`` cuts it into ``2c`` chunks and gives device ``i`` chunks ``i`` and
  ``2c - 1 - i``: one early, one late, the same number of pairs on every device;
- ``"striped"`` deals the tokens round robin, token ``t`` to device ``t mod c``: balanced to
  within a row of pairs, and suited to packed data whose documents start anywhere.

Everything indexed by token follows the same order (tokens, labels, positions, segment ids);
a loss averaged over tokens is unchanged, and :meth:`SequenceLayout.restore` puts outputs back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flax_escale import _checks as check
from flax_escale.errors import EscaleError

__all__ = ["BALANCES", "ContextError", "SequenceLayout"]

BALANCES = ("dual_chunk", "striped")
"""The reorderings :class:`SequenceLayout` knows; ``None`` keeps the sequence in order."""


class ContextError(EscaleError):
    """Context parallelism cannot run as asked: a sequence or head count does not split."""


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """The order of a sequence of ``length`` tokens split over ``degree`` devices.

    Attributes:
        length: The tokens of one sequence (the step's sequence dimension).
        degree: The devices the sequence is split over (the context axes' size, ``c``).
        balance: ``"dual_chunk"``, ``"striped"`` or ``None`` (contiguous: no reordering).

    Raises:
        ContextError: If ``degree`` does not divide ``length``, or for ``"dual_chunk"``
            ``2 * degree`` does not; if ``balance`` is not one of :data:`BALANCES` or ``None``.

    Example:
        >>> from flax_escale.context import SequenceLayout
        >>> layout = SequenceLayout(8, 2, "dual_chunk")
        >>> layout.permutation.tolist()  # device 0: chunks 0 and 3, device 1: chunks 1 and 2
        [0, 1, 6, 7, 2, 3, 4, 5]
        >>> layout.pairs()  # causal (query, key) pairs each device scores
        (18, 18)
        >>> SequenceLayout(8, 2, None).pairs()
        (10, 26)
    """

    length: int
    degree: int
    balance: str | None = "dual_chunk"

    def __post_init__(self) -> None:
        check.positive_int(self.length, "length")
        check.positive_int(self.degree, "degree")
        if self.balance is not None and self.balance not in BALANCES:
            raise ContextError(f"balance must be one of {BALANCES} or None, got {self.balance!r}.")
        chunks = 2 * self.degree if self.balance == "dual_chunk" else self.degree
        if self.degree > 1 and self.length % chunks:  # one device holds any sequence in order
            why = (
                f"2 x {self.degree} chunks (balance='dual_chunk')"
                if self.balance == "dual_chunk"
                else f"{self.degree} devices"
            )
            raise ContextError(
                f"a sequence of {self.length} tokens does not split into {why}: pad or cut it "
                f"to a multiple of {chunks} (e.g. {self.length + (-self.length) % chunks}), or "
                "use a context axis that divides it."
            )

    @property
    def permutation(self) -> np.ndarray:
        """``order[t]``: the position in the original sequence of the ``t``-th token held.

        Device ``i`` holds entries ``i * length / degree`` to ``(i + 1) * length / degree``.
        """
        n, c = self.length, self.degree
        if c == 1:
            return np.arange(n)
        if self.balance == "striped":
            return np.arange(n).reshape(n // c, c).T.reshape(n)
        if self.balance == "dual_chunk":
            chunks = np.arange(n).reshape(2 * c, n // (2 * c))
            pairs = [np.concatenate([chunks[i], chunks[2 * c - 1 - i]]) for i in range(c)]
            return np.concatenate(pairs)
        return np.arange(n)

    @property
    def inverse(self) -> np.ndarray:
        """The permutation that puts a sequence in this layout back in order."""
        return np.argsort(self.permutation)

    def positions(self, batch: int | None = None) -> np.ndarray:
        """Each token's position in the original sequence, in this layout's order.

        Args:
            batch: With a batch size, the positions repeated for every row, ``(batch, length)``.
        """
        order = self.permutation.astype(np.int32)
        return order if batch is None else np.broadcast_to(order, (batch, self.length)).copy()

    def apply(self, tree: Any, axis: int = 1) -> Any:
        """Every array of ``tree`` put in this layout's order along ``axis``.

        Tokens, labels, positions and segment ids go through the same call, once per batch
        (on the host, before the step), so that every array indexed by token agrees.

        Raises:
            ContextError: If an array's ``axis`` is not ``length`` long.
        """
        return self._take(tree, self.permutation, axis, "apply")

    def restore(self, tree: Any, axis: int = 1) -> Any:
        """The inverse of :meth:`apply`: outputs per token back in the original order."""
        return self._take(tree, self.inverse, axis, "restore")

    def pairs(self, causal: bool = True) -> tuple[int, ...]:
        """The (query, key) pairs each device's queries score, counted over the whole sequence.

        The figure balancing evens out: without a mask every device scores
        ``length ** 2 / degree``; under a causal mask query ``t`` scores ``t + 1`` keys.
        """
        counts = self.permutation + 1 if causal else np.full(self.length, self.length)
        return tuple(int(c) for c in counts.reshape(self.degree, -1).sum(axis=1))

    def imbalance(self, causal: bool = True) -> float:
        """The busiest device's pairs over the mean (1.0: balanced)."""
        pairs = self.pairs(causal)
        return max(pairs) * len(pairs) / sum(pairs)

    def describe(self) -> str:
        """One line: the order and how evenly a causal mask's work falls on the devices."""
        if self.degree == 1:
            return f"{self.length} tokens on one device"
        how = {
            "dual_chunk": f"device i holds chunks i and {2 * self.degree - 1}-i of "
            f"{2 * self.degree}",
            "striped": f"token t on device t mod {self.degree}",
            None: "contiguous, not balanced",
        }[self.balance]
        return (
            f"{self.length} tokens over {self.degree} devices, {how}; causal work: busiest "
            f"device {self.imbalance():.2f}x the mean"
        )

    def _take(self, tree: Any, order: np.ndarray, axis: int, what: str) -> Any:
        def take(x: Any) -> Any:
            shape = np.shape(x)
            found = shape[axis] if -len(shape) <= axis < len(shape) else None
            if found != self.length:
                has = "no axis" if found is None else f"{found} entries along axis"
                raise ContextError(
                    f"SequenceLayout.{what}: an array of shape {shape} has {has} {axis}, not "
                    f"the layout's {self.length} tokens; pass arrays indexed by token along "
                    f"axis {axis} (tokens, labels, positions, segment ids)."
                )
            if isinstance(x, jax.Array):
                return jnp.take(x, jnp.asarray(order), axis=axis)
            return np.take(np.asarray(x), order, axis=axis)

        return jax.tree.map(take, tree)
