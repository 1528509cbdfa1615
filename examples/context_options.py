"""The examples' long-context options: ``--seq``, ``--context-parallel``, ``--balance``.

A mesh with a sequence axis (``--mesh fsdp:2,sp:4``) splits the activations along the
sequence. With ``--context-parallel`` the model's attention brings each device the keys and
values its queries need by :func:`flax_escale.context.context_attention`: ``all_gather``,
``ring`` (passed round the devices, each hop hidden behind a chunk's attention), ``ulysses``
(the sequence split traded for a heads split) or ``auto`` (the cheapest by the cost formulas).
Under a causal mask a contiguous split leaves the last device about ``(2c - 1) / c`` times the
mean work, so the batch is reordered once, on the host, by a
:class:`~flax_escale.context.SequenceLayout` (``--balance``): inputs, labels and positions
alike, so each token keeps its own position (rotary angles, position embeddings, the mask)
and its own label, and the mean loss is the same. Without ``--context-parallel`` the models
attend as before.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

import flax_escale as fe
from flax_escale.context import (
    BALANCES,
    CONTEXT_STRATEGIES,
    ContextError,
    ContextPlan,
    SequenceLayout,
    plan_attention,
)

DEFAULT_BALANCE = "dual_chunk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the sequence length and the context-parallel options to an example's command line."""
    parser.add_argument(
        "--seq",
        type=int,
        default=32,
        help="tokens per training sequence (default %(default)s); with --context-parallel, a "
        "multiple of 2 x the mesh's sp size (balance dual_chunk) or of its sp size",
    )
    parser.add_argument(
        "--context-parallel",
        choices=(*CONTEXT_STRATEGIES, "auto"),
        default=None,
        help="with an sp axis in --mesh: how attention gets the keys and values of the other "
        "devices' tokens (all_gather, ring, ulysses, or auto: the cheapest by the cost "
        "formulas); default: attention left to XLA",
    )
    parser.add_argument(
        "--balance",
        choices=(*BALANCES, "none"),
        default=None,
        help="with --context-parallel: the order the batch is put in so that causal attention "
        f"costs every device the same ({DEFAULT_BALANCE}, the default: chunks i and 2c-1-i on "
        "device i; striped: token t on device t mod c; none: contiguous, unbalanced)",
    )


class Context(NamedTuple):
    """How a context-parallel step runs: the attention's plan and the batch's order."""

    asked: str  # the --context-parallel strategy, "auto" included
    plan: ContextPlan
    layout: SequenceLayout


Config = TypeVar("Config")


def configure(
    config: Config,
    args: argparse.Namespace,
    mesh: jax.sharding.Mesh | None,
    rules: fe.PartitionAxis | None = None,
) -> tuple[Config, Context | None]:
    """``config`` (an example's ``Config``) with ``--context-parallel``, and how it runs (or None).

    The context degree is the size of the mesh axes that ``rules`` give the query sequence
    (``sp`` by default), as :func:`~flax_escale.context.plan_attention` resolves it; the
    layout splits ``--seq`` that many ways.

    Raises:
        ContextError: If ``--balance`` is given without ``--context-parallel``, or
            ``--context-parallel`` with a mesh that does not split the sequence or has a ``pp``
            axis, or if ``--seq`` does not split over the sequence axes (twice, for
            dual_chunk), or ulysses is asked where the heads do not split (the message names
            the numbers).
    """
    if args.context_parallel is None:
        if args.balance is not None:
            raise ContextError(
                f"--balance {args.balance} orders the batch for context parallelism: add "
                "--context-parallel (e.g. ring) and a mesh with an sp axis."
            )
        return config, None
    unsplit = ContextError(
        f"--context-parallel {args.context_parallel} splits attention over the mesh axes of "
        f"the sequence, and --mesh {args.mesh} does not split it: add an sp axis, e.g. "
        "--mesh fsdp:2,sp:4."
    )
    if mesh is None:
        raise unsplit
    if dict(mesh.shape).get(fe.mesh.PIPELINE_AXIS, 1) > 1:
        # The pipeline carries the activations from stage to stage, not the positions.
        raise ContextError(
            f"--context-parallel with a pipeline (--mesh {args.mesh}) is not supported by the "
            "examples: drop the pp axis, e.g. --mesh fsdp:2,sp:4."
        )
    # One device's queries and keys, as the model makes them (a GPT's keys have every head).
    kv_heads = getattr(config, "kv_heads", config.heads)
    query = jax.ShapeDtypeStruct((args.batch, args.seq, config.heads, config.head_dim), jnp.float32)
    key = jax.ShapeDtypeStruct((args.batch, args.seq, kv_heads, config.head_dim), jnp.float32)
    rules = fe.PartitionAxis() if rules is None else rules
    plan = plan_attention(query, key, strategy=args.context_parallel, mesh=mesh, rules=rules)
    if plan.degree == 1:
        raise unsplit
    balance = args.balance or DEFAULT_BALANCE
    layout = plan.layout(None if balance == "none" else balance)
    configured = dataclasses.replace(config, context_parallel=args.context_parallel)
    return configured, Context(args.context_parallel, plan, layout)


def describe(context: Context) -> str:
    """The line the examples print beside their plan: the strategy, the balance, the bytes."""
    why = (
        f"auto's pick: {context.plan.choice.reason}"
        if context.asked == "auto"
        else f"--context-parallel {context.asked}"
    )
    return f"{context.plan.describe()} ({why}); balance: {context.layout.describe()}"


def next_token_batch(
    context: Context, tokens: jax.Array | np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(inputs, labels, positions)`` of ``(batch, seq + 1)`` tokens, in the layout's order.

    Reordered once, on the host, before the step: every array indexed by token follows the
    same permutation, so each input keeps its label (the token after it) and its position.
    """
    tokens = np.asarray(tokens)
    rows, length = tokens.shape[0], tokens.shape[1] - 1
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
    return context.layout.apply((tokens[:, :-1], tokens[:, 1:], positions))


def step_batch(context: Context | None, tokens: jax.Array) -> tuple[jax.Array, ...]:
    """What the step takes for ``(batch, seq + 1)`` tokens, laid out on the current mesh.

    The tokens, or with ``context`` the :func:`next_token_batch` of them.
    """
    batch = (tokens,) if context is None else next_token_batch(context, tokens)
    return tuple(fe.constrain(x, ("batch", "sequence")) for x in batch)


def batch_shapes(batch: int, seq: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of :func:`next_token_batch`'s arrays: what a context-parallel step takes."""
    return (jax.ShapeDtypeStruct((batch, seq), jnp.int32),) * 3
