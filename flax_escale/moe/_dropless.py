"""Dropless dispatch: every token to the devices holding its experts and back, in shard_map."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from flax_escale._specs import mesh_axes_of
from flax_escale.errors import EscaleError, NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.moe._experts import EXPERT_AXES, GatedExperts
from flax_escale.moe._layout import Dispatch
from flax_escale.moe._routing import Routing
from flax_escale.resolve import as_logical_rules, resolve_logical_axes
from flax_escale.sharding import logical_shard_map

__all__ = ["Exchange", "dropless_dispatch"]

Exchange = Literal["all_to_all", "ragged_all_to_all"]
"""How tokens cross the expert axis: a sorted, padded ``jax.lax.all_to_all`` that runs on
every backend, or ``jax.lax.ragged_all_to_all``, which sends only the rows it has (XLA's TPU
and GPU backends run it; XLA:CPU cannot, so :func:`~flax_escale.moe.moe_mlp` refuses it on a
mesh of CPU devices)."""

_TOKENS = ("batch", "sequence", None)


class _Setup(NamedTuple):
    """How a body computes: the gate's activation, the exchange, and the mesh axes it uses."""

    activation: Callable[[jax.Array], jax.Array]
    exchange: Exchange
    expert_axes: tuple[str, ...]  # the expert dimension's: the exchange crosses them
    sum_axes: tuple[str, ...]  # the intermediate dimension's, that the tokens leave free


def dropless_dispatch(
    x: jax.Array,
    routing: Routing,
    experts: GatedExperts,
    dispatch: Dispatch,
    exchange: Exchange,
) -> jax.Array:
    """Computes every token's experts, none dropped, moving tokens rather than weights.

    Each device sorts its token assignments by expert, sends each to the device holding that
    expert (an all-to-all over the mesh axes of the ``expert`` dimension), runs its own experts
    as grouped matmuls (``jax.lax.ragged_dot``) over what it received, and sends the results
    back the same way. The body is a :func:`~flax_escale.sharding.logical_shard_map`, so the
    same code runs on any mesh: tokens are split as ``(batch, sequence)`` resolve, experts as
    ``expert`` does, and their intermediate dimension's mesh axes (``tp``) are summed over.
    Without a mesh it is the same computation on one device. ``strict`` makes what the
    body's specs cannot apply an error, as :func:`~flax_escale.constrain`'s does.

    Raises:
        EscaleError: For ``exchange="ragged_all_to_all"`` across the devices of a CPU mesh,
            which XLA:CPU cannot run; for experts and tokens that share only some mesh axes; for
            a batch the devices of an expert group cannot share equally.
    """
    activation, mesh, rules, strict = dispatch
    if mesh is None:
        try:
            mesh = current_mesh()
        except NoMeshError:
            return _local(x, routing, experts, _Setup(activation, exchange, (), ()))
    frozen = as_logical_rules(rules)
    token_spec = resolve_logical_axes(_TOKENS, frozen, shape=x.shape, mesh=mesh).spec
    token_axes = _axes_of(token_spec, [0, 1])
    stored = resolve_logical_axes(
        EXPERT_AXES["wi_gate"], frozen, shape=experts.wi_gate.shape, mesh=mesh
    ).spec
    expert_axes = _axes_of(stored, [0])
    if set(expert_axes) & set(token_axes) and not set(expert_axes) <= set(token_axes):
        raise EscaleError(
            f"dropless dispatch: the experts are split over {expert_axes} and the tokens over "
            f"{token_axes}, which share some of those mesh axes but not all; map 'batch' to "
            "all of the expert axes (PartitionAxis(ep_as_fsdp=True)) or to none of them."
        )
    if exchange == "ragged_all_to_all" and expert_axes and _platform(mesh) == "cpu":
        raise EscaleError(
            f"dropless dispatch: exchange='ragged_all_to_all' would cross the experts' mesh "
            f"axes {expert_axes} on CPU devices, and XLA:CPU cannot run a ragged-all-to-all; "
            "on CPU pass exchange='all_to_all' (the padded exchange, the same results), or "
            "compile for a TPU or GPU mesh (flax_escale.mesh.Target.named('v5p-16').mesh(...) "
            "compiles for a TPU slice from any machine)."
        )
    # Inside the body each device holds whole rows of its experts (the hidden dimension is
    # gathered, as FSDP gathers any weight before its use); the intermediate dimension stays
    # split over the mesh axes the tokens do not use, and the outputs are summed over them.
    sum_axes = tuple(
        a for a in _axes_of(stored, [2]) if a not in token_axes and a not in expert_axes
    )
    kernel = PartitionSpec(expert_axes or None, None, sum_axes or None)
    split_tokens = not set(expert_axes) <= set(token_axes)
    out_axes: tuple[str | None, ...] | PartitionSpec = _TOKENS
    if split_tokens:
        # Each device of an expert group takes its share of the batch, which then leaves
        # the body split over the expert axes too (minor to the batch's own axes).
        batch_axes = _axes_of(token_spec, [0])
        if x.shape[0] % math.prod(mesh.shape[a] for a in (*batch_axes, *expert_axes)):
            raise EscaleError(
                f"dropless dispatch: the batch of x {tuple(x.shape)} is split over "
                f"{batch_axes or 'no mesh axis'}, and each device of the expert "
                f"axes {expert_axes} takes an equal share of it, which needs a batch that "
                "divides by their product; use such a batch, or PartitionAxis(ep_as_fsdp=True) "
                "so that the batch is split over the expert axes already."
            )
        sequence = token_spec[1] if len(token_spec) > 1 else None
        out_axes = PartitionSpec((*batch_axes, *expert_axes), sequence, None)
    setup = _Setup(activation, exchange, expert_axes, sum_axes)
    body = functools.partial(_body, setup=setup, split_tokens=split_tokens)
    mapped = logical_shard_map(
        body,
        in_axes=[_TOKENS, _TOKENS, _TOKENS, GatedExperts(kernel, kernel, _transposed(kernel))],
        out_axes=out_axes,
        mesh=mesh,
        rules=frozen,
        strict=strict,
    )
    return mapped(x, routing.experts, routing.weights, experts)


def _platform(mesh: Mesh | AbstractMesh) -> str | None:
    """The platform of the mesh's devices; ``None`` for an abstract mesh that names none."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return getattr(getattr(mesh, "abstract_device", None), "platform", None)


def _transposed(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(spec[0], spec[2], spec[1])


def _axes_of(spec: PartitionSpec, dims: list[int]) -> tuple[str, ...]:
    return tuple(a for d in dims if d < len(spec) for a in mesh_axes_of(spec[d]))


def _body(
    x: jax.Array,
    experts_of: jax.Array,
    weights: jax.Array,
    experts: GatedExperts,
    *,
    setup: _Setup,
    split_tokens: bool,
) -> jax.Array:
    if split_tokens:
        # The tokens are the same on every device of an expert group: each takes its share.
        size = jax.lax.axis_size(setup.expert_axes)
        index = jax.lax.axis_index(setup.expert_axes)
        x, experts_of, weights = (
            jax.lax.dynamic_slice_in_dim(a, index * (a.shape[0] // size), a.shape[0] // size)
            for a in (x, experts_of, weights)
        )
    return _local(x, Routing(experts_of, weights, None), experts, setup)


def _local(x: jax.Array, routing: Routing, experts: GatedExperts, setup: _Setup) -> jax.Array:
    """One device's tokens through the experts of its group, with every row kept."""
    *lead, hidden = x.shape
    top_k = routing.experts.shape[-1]
    tokens = math.prod(lead)
    rows = tokens * top_k
    flat = routing.experts.reshape(rows)
    order = jnp.argsort(flat, stable=True)
    sent = x.reshape(tokens, hidden)[order // top_k]
    groups = jax.lax.axis_size(setup.expert_axes) if setup.expert_axes else 1
    counts = jnp.bincount(flat, length=experts.num_experts * groups).astype(jnp.int32)
    if setup.expert_axes:
        out = _exchanged(sent, flat[order], counts, experts, setup)
    else:
        out = experts.grouped(sent, counts, setup.activation)
        out = jax.lax.psum(out, setup.sum_axes) if setup.sum_axes else out
    per_row = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
    per_row = per_row.reshape(tokens, top_k, hidden)
    mixed = jnp.einsum(
        "tkh,tk->th", per_row, routing.weights.reshape(tokens, top_k).astype(per_row.dtype)
    )
    return mixed.reshape(x.shape)


def _exchanged(
    sent: jax.Array,
    sent_experts: jax.Array,
    counts: jax.Array,
    experts: GatedExperts,
    setup: _Setup,
) -> jax.Array:
    """``sent`` (rows sorted by expert) through the experts, wherever they are, and back."""
    activation, exchange, expert_axes, sum_axes = setup
    rows, hidden = sent.shape
    peers = jax.lax.axis_size(expert_axes)
    local = experts.num_experts
    to_peer = counts.reshape(peers, local)
    sizes = to_peer.sum(axis=1)
    offsets = jnp.cumsum(sizes) - sizes
    # What each peer sends here, per expert of this device: row p of peer s's block.
    from_peer = jax.lax.all_to_all(to_peer, expert_axes, 0, 0, tiled=True)
    received_sizes = from_peer.sum(axis=1)
    if exchange == "all_to_all":
        peer = sent_experts // local
        slot = jnp.arange(rows) - offsets[peer]
        blocks = jnp.zeros((peers, rows, hidden), sent.dtype).at[peer, slot].set(sent)
        received = jax.lax.all_to_all(blocks, expert_axes, 0, 0, tiled=True)
    else:
        here = jax.lax.axis_index(expert_axes)
        received = jax.lax.ragged_all_to_all(
            sent,
            jnp.zeros((peers * rows, hidden), sent.dtype),
            offsets,
            sizes,
            jnp.full((peers,), here * rows, jnp.int32),
            received_sizes,
            axis_name=expert_axes,
        ).reshape(peers, rows, hidden)
    # Sort what arrived by local expert (rows past each peer's block last) for the grouped
    # matmuls, then undo the sort.
    ends = jnp.cumsum(from_peer, axis=1)
    expert_of_row = (jnp.arange(rows)[None, :, None] >= ends[:, None, :]).sum(-1)
    by_expert = jnp.argsort(expert_of_row.reshape(-1), stable=True)
    out = experts.grouped(received.reshape(-1, hidden)[by_expert], from_peer.sum(0), activation)
    out = jax.lax.psum(out, sum_axes) if sum_axes else out
    out = jnp.zeros_like(out).at[by_expert].set(out, unique_indices=True)
    if exchange == "all_to_all":
        back = jax.lax.all_to_all(out.reshape(peers, rows, hidden), expert_axes, 0, 0, tiled=True)
        return back[peer, slot]
    # Each block goes back to where its sender took it from.
    sender_offsets = jax.lax.all_to_all(offsets, expert_axes, 0, 0, tiled=True)
    return jax.lax.ragged_all_to_all(
        out,
        jnp.zeros((rows, hidden), out.dtype),
        jnp.arange(peers, dtype=jnp.int32) * rows,
        received_sizes,
        sender_offsets,
        sizes,
        axis_name=expert_axes,
    )
