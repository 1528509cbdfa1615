"""Capacity-based dispatch (GShard's): dense one-hot dispatch and combine, overflow dropped."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from flax_escale.moe._experts import DISPATCHED_AXES, GatedExperts, explicit_mesh
from flax_escale.moe._routing import Routing
from flax_escale.resolve import RulesLike
from flax_escale.sharding import constrain

__all__ = ["capacity_dispatch", "expert_capacity"]

# The dispatched tokens: experts over ep, and the groups (sequences) over the batch's other axes.
_RETURNED = (None, "batch", None, "hidden_state")


def expert_capacity(group_size: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """How many tokens of one group each expert takes: ``ceil(factor * size * k / experts)``.

    Example:
        >>> from flax_escale.moe import expert_capacity
        >>> expert_capacity(group_size=32, num_experts=8, top_k=2, capacity_factor=1.25)
        10
    """
    return max(1, math.ceil(capacity_factor * group_size * top_k / num_experts))


def capacity_dispatch(
    x: jax.Array,
    routing: Routing,
    experts: GatedExperts,
    *,
    activation: Callable[[jax.Array], jax.Array],
    capacity_factor: float,
    mesh: Mesh | AbstractMesh | None,
    rules: RulesLike,
) -> tuple[jax.Array, jax.Array]:
    """Sends each sequence's tokens to their experts in fixed-size slots, and back.

    Each sequence is a group; each expert takes :func:`expert_capacity` of its tokens, first
    choices before second choices and earlier tokens first (GShard's priority). The dispatched
    ``(expert, group, slot, hidden)`` array is constrained to ``DISPATCHED_AXES``, so XLA moves the
    tokens from the batch's layout to the experts' with an all-to-all over ``ep`` (and back).

    Returns:
        The combined ``(batch, sequence, hidden)`` output and how many token assignments
        found their expert full (their share of the output is zero).
    """
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
    dispatched = constrain(dispatched, DISPATCHED_AXES, mesh=mesh, rules=rules)
    out = experts.dense(dispatched, activation, mesh=mesh, rules=rules)
    if explicit_mesh(mesh) is not None:
        # On Explicit axes the combine's operands must agree on the groups' sharding: the
        # experts' outputs go back to the tokens' layout first (the all-to-all back over ep).
        # On Auto axes XLA chooses that move itself (and constraining it there measured worse:
        # reshardings on fsdp2 x ep4, fsdp2 x ep2 x tp2).
        out = constrain(out, _RETURNED, mesh=mesh, rules=rules)
    else:
        out = constrain(out, DISPATCHED_AXES, mesh=mesh, rules=rules)
    combined = jnp.einsum("egch,gsec->gsh", out, weighted.astype(out.dtype))
    dropped = top_k * groups * group_size - seated.sum()
    return combined, dropped
