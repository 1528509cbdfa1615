"""Capacity-based dispatch (GShard's): dense one-hot dispatch and combine, overflow dropped."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flax_escale import _checks as check
from flax_escale.errors import EscaleError
from flax_escale.moe._experts import DISPATCHED_AXES, GatedExperts, explicit_mesh
from flax_escale.moe._layout import Dispatch
from flax_escale.moe._routing import Routing
from flax_escale.sharding import constrain

__all__ = ["capacity_dispatch", "expert_capacity"]

# The dispatched tokens: experts over ep, and the groups (sequences) over the batch's other axes.
_RETURNED = (None, "batch", None, "hidden_state")


def expert_capacity(group_size: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """How many tokens of one group each expert takes: ``ceil(factor * size * k / experts)``.

    Never below one slot, so a group of no tokens still has a buffer's shape.

    Args:
        group_size: Tokens per group (a sequence's length), at least 0.
        num_experts: The number of experts, at least 1.
        top_k: Experts per token, from 1 to ``num_experts``.
        capacity_factor: Slots per expert as a multiple of an even share, above 0.

    Raises:
        EscaleTypeError: For an argument of the wrong type (a float size, a string factor).
        EscaleError: For a negative group, no experts, a ``top_k`` out of its range, or a
            factor that is not a finite number above 0.

    Example:
        >>> from flax_escale.moe import expert_capacity
        >>> expert_capacity(group_size=32, num_experts=8, top_k=2, capacity_factor=1.25)
        10
    """
    group_size = check.non_negative_int(group_size, "expert_capacity: group_size")
    num_experts = check.positive_int(num_experts, "expert_capacity: num_experts")
    top_k = check.positive_int(top_k, "expert_capacity: top_k")
    if top_k > num_experts:
        raise EscaleError(
            f"expert_capacity: top_k must be at most num_experts ({num_experts}), got {top_k}: "
            "a token goes to top_k different experts; pass a top_k from 1 to num_experts."
        )
    capacity_factor = check.positive_number(capacity_factor, "expert_capacity: capacity_factor")
    return max(1, math.ceil(capacity_factor * group_size * top_k / num_experts))


def capacity_dispatch(
    x: jax.Array,
    routing: Routing,
    experts: GatedExperts,
    dispatch: Dispatch,
    capacity_factor: float,
) -> tuple[jax.Array, jax.Array]:
    """Sends each sequence's tokens to their experts in fixed-size slots, and back.

    Each sequence is a group; each expert takes :func:`expert_capacity` of its tokens, first
    choices before second choices and earlier tokens first (GShard's priority). The dispatched
    ``(expert, group, slot, hidden)`` array is constrained to ``DISPATCHED_AXES``, so XLA moves the
    tokens from the batch's layout to the experts' with an all-to-all over ``ep`` (and back).
    ``strict`` makes what the constraints cannot apply an error, as
    :func:`~flax_escale.constrain`'s does.

    Returns:
        The combined ``(batch, sequence, hidden)`` output and how many token assignments
        found their expert full (their share of the output is zero).
    """
    activation, mesh, rules, strict = dispatch
    groups, group_size, _ = x.shape
    top_k = routing.experts.shape[-1]
    num_experts = experts.num_experts
    capacity = expert_capacity(group_size, num_experts, top_k, capacity_factor)
    chosen = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.int32)  # (g, s, k, e)
    # Slots are taken in (choice, token) order, so every first choice is seated before any
    # second choice: the cumulative count of each expert along that order is the slot.
    by_priority = chosen.transpose(0, 2, 1, 3).reshape(groups, top_k * group_size, num_experts)
    slot = (jnp.cumsum(by_priority, axis=1) * by_priority).sum(-1) - 1
    slot = slot.reshape(groups, top_k, group_size).transpose(0, 2, 1)  # (g, s, k)
    seated = slot < capacity
    place = chosen * seated[..., None]
    dispatch = jnp.einsum("gske,gskc->gsec", place, jax.nn.one_hot(slot, capacity, dtype=jnp.int32))
    weighted = jnp.einsum(
        "gske,gskc,gsk->gsec",
        place.astype(jnp.float32),
        jax.nn.one_hot(slot, capacity, dtype=jnp.float32),
        routing.weights,
    )
    dispatched = jnp.einsum("gsec,gsh->egch", dispatch.astype(x.dtype), x)
    dispatched = constrain(dispatched, DISPATCHED_AXES, mesh=mesh, rules=rules, strict=strict)
    out = experts.dense(dispatched, activation, mesh=mesh, rules=rules, strict=strict)
    if explicit_mesh(mesh) is not None:
        # On Explicit axes the combine's operands must agree on the groups' sharding: the
        # experts' outputs go back to the tokens' layout first (the all-to-all back over ep).
        # On Auto axes XLA chooses that move itself (and constraining it there measured worse:
        # reshardings on fsdp2 x ep4, fsdp2 x ep2 x tp2).
        out = constrain(out, _RETURNED, mesh=mesh, rules=rules, strict=strict)
    else:
        out = constrain(out, DISPATCHED_AXES, mesh=mesh, rules=rules, strict=strict)
    combined = jnp.einsum("egch,gsec->gsh", out, weighted.astype(out.dtype))
    dropped = top_k * groups * group_size - seated.sum()
    return combined, dropped
