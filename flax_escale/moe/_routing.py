"""Top-k routing: which experts each token goes to, with what weight, and how balanced."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = ["Routing", "route_top_k"]


class Routing(NamedTuple):
    """The routing of a batch of tokens.

    Attributes:
        experts: ``(..., top_k)`` int32: each token's experts, most probable first.
        weights: ``(..., top_k)`` float32: the weights of their outputs, summing to 1.
        aux_loss: The load-balancing loss (a float32 scalar): ``num_experts`` times the sum
            over experts of the share of assignments it received times its mean router
            probability. It is 1 when the router spreads tokens evenly, up to ``num_experts``
            when every token goes to one expert; training adds a small multiple of it to the
            loss so that no expert is starved or overflows. A batch of no tokens has nothing
            to balance: its loss is 0, and so are its gradients.
    """

    experts: jax.Array
    weights: jax.Array
    aux_loss: jax.Array


def route_top_k(logits: jax.Array, top_k: int) -> Routing:
    """Routes each token to its ``top_k`` most probable experts.

    The probabilities are a softmax over all experts, in float32; the weights of the chosen
    experts are renormalized to sum to 1 (so for ``top_k=2`` they are the softmax of the two
    logits, as Mixtral weighs them). Ties go to the lower expert index, on every device alike.

    Args:
        logits: ``(..., num_experts)`` router logits.
        top_k: How many experts each token goes to.

    Returns:
        The :class:`Routing`.

    Raises:
        EscaleTypeError: If ``logits`` is not an array, or ``top_k`` not an int.
        EscaleError: If ``logits`` has no dimension, or ``top_k`` is not between 1 and the
            number of experts.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax_escale.moe import route_top_k
        >>> routing = route_top_k(jnp.array([[0.0, 2.0, 1.0, 0.0]]), top_k=2)
        >>> routing.experts.tolist(), [round(w, 3) for w in routing.weights[0].tolist()]
        ([[1, 2]], [0.731, 0.269])
    """
    num_experts = _num_experts(logits)
    is_int = isinstance(top_k, (int, np.integer)) and not isinstance(top_k, bool)
    if not is_int or not 1 <= top_k <= num_experts:
        raise (EscaleError if is_int else EscaleTypeError)(
            f"route_top_k: top_k must be an int from 1 to the number of experts "
            f"({num_experts}, the last dimension of logits {tuple(logits.shape)}), got {top_k!r}."
        )
    top_k = int(top_k)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, top_k)
    weights = top / top.sum(axis=-1, keepdims=True)
    flat_probs = probs.reshape(-1, num_experts)
    if flat_probs.shape[0] == 0:
        # The shares and mean probabilities of no tokens are 0 / 0: a NaN would poison the loss.
        return Routing(experts.astype(jnp.int32), weights, jnp.zeros((), jnp.float32))
    assigned = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).reshape(-1, num_experts)
    share = assigned.sum(axis=0) / assigned.sum()
    aux_loss = num_experts * jnp.sum(share * flat_probs.mean(axis=0))
    return Routing(experts.astype(jnp.int32), weights, aux_loss)


def _num_experts(logits: object) -> int:
    """The last dimension of ``logits``, which must be an array of at least one dimension."""
    shape = getattr(logits, "shape", None)
    if not isinstance(shape, tuple) or not hasattr(logits, "dtype"):
        raise EscaleTypeError(
            f"route_top_k: logits must be an array (..., num_experts), got "
            f"{check.describe(logits)}; pass jnp.asarray(logits)."
        )
    if not shape:
        raise EscaleError(
            f"route_top_k: logits must have a last dimension of one logit per expert, got the "
            f"scalar {check.describe(logits)}; pass (..., num_experts) logits."
        )
    return shape[-1]
