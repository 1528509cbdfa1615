"""Context attention inside another ``shard_map`` (a pipeline's stages), and how values vary.

A pipeline runs its stages as a ``shard_map`` manual over the stage axis and the batch's axes;
:func:`~flax_escale.context.context_attention` called in a stage maps the remaining axes
itself. JAX (0.10 to 0.12) differentiates neither form of such a nested map: one that tracks
how values vary (``check_vma``) keeps values for the backward pass in layouts that name the
outer map's axes, which the compiler refuses; one that does not loses the outer axes'
variation of the cotangents, so that JAX sums them over those axes. :func:`inside_manual`
gives the nested map its own gradient instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from flax_escale.resolve import RulesLike
from flax_escale.sharding import logical_shard_map

__all__ = ["inside_manual", "laid_out_like", "manual_around", "tied", "varying"]


def varying(x: jax.Array) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (``.mat.varying`` of its type, ``.vma`` before)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def tied(tree: Any, inputs: tuple[Any, ...]) -> Any:
    """``tree`` said to vary over every manual mesh axis ``inputs`` vary over.

    The running state meets the inputs in every block, and both branches of a skipped block's
    ``lax.cond`` must agree on how they vary; where nothing tracks variation, no axis is added.
    """
    axes = frozenset().union(*(varying(x) for x in inputs if x is not None))

    def tie(x: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - varying(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(tie, tree)


def laid_out_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` in the layout of ``like`` on Explicit mesh axes; on Auto axes, as it is.

    A gradient must come back laid out as its input was.
    """
    if AxisType.Explicit not in jax.sharding.get_abstract_mesh().axis_types:
        return x
    return jax.sharding.reshard(x, jax.typeof(like).sharding.spec)


def manual_around() -> bool:
    """Whether the call is inside another ``shard_map`` (a pipeline's stages)."""
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    return bool(manual)


def inside_manual(
    body: Callable[..., jax.Array],
    in_axes: Sequence[PartitionSpec],
    out_spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
    rules: RulesLike,
) -> Callable[..., jax.Array]:
    """``body`` mapped inside another ``shard_map``, with its own gradient.

    The forward map does not track variation (its output is then said to vary as its inputs
    do); the backward map does, running the body again and differentiating it within the
    map: the forward pass is computed twice. ``body`` takes ``(q, k, v, *tokens)``; the
    gradient reaches ``q``, ``k`` and ``v``.
    """
    forward = logical_shard_map(
        body, in_axes=in_axes, out_axes=out_spec, mesh=mesh, rules=rules, check_vma=False
    )

    def grads(q: jax.Array, k: jax.Array, v: jax.Array, *rest: jax.Array) -> list[jax.Array]:
        *tokens, cotangent = rest
        out, vjp = jax.vjp(lambda q, k, v: body(q, k, v, *tokens), q, k, v)
        return list(vjp(tied(cotangent, (out,))))

    backward = logical_shard_map(
        grads,
        in_axes=[*in_axes, out_spec],
        out_axes=list(in_axes[:3]),
        mesh=mesh,
        rules=rules,
        check_vma=True,
    )

    def primal(*args: jax.Array) -> jax.Array:
        # Said to vary as the inputs do over the outer map's axes: a map that does not track
        # variation returns values that vary over none, whose cotangents JAX would then sum
        # over those axes.
        return tied(forward(*args), args)

    def run(*args: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return primal(*args), args

    def back(args: tuple[jax.Array, ...], cotangent: jax.Array) -> tuple[Any, ...]:
        grads = [
            laid_out_like(g, x) for g, x in zip(backward(*args, cotangent), args[:3], strict=True)
        ]
        return (*grads, *(None for _ in args[3:]))

    mapped = jax.custom_vjp(primal)
    mapped.defvjp(run, back)
    return mapped
