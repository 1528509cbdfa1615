"""Running a stack of identical layers as a pipeline over a mesh axis, inside one ``jax.jit``.

The stage axis (``pp``) is manual (``jax.shard_map`` over that axis only); every other mesh axis
stays with the compiler, so fsdp, tp, ep and sp work inside each stage as they do outside a
pipeline. Each device holds its stage's chunks of the stack: the stack ``[layers, ...]`` is seen
as ``[repeats, stages * layers_per_stage, ...]`` with the second dimension on the stage axis, so
with one repeat the stack's own layout (its ``layers`` dimension on ``pp``) is already the
stages'. A loop of :attr:`Schedule.iterations` steps runs every stage on the microbatch in
front of it, then passes each stage's output to the next stage with one collective permute
(the last stage's to the first, where it waits in the microbatch buffer for its next repeat,
and after the last one is the output).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules
from flax_escale.errors import EscaleTypeError
from flax_escale.mesh import current_mesh
from flax_escale.pipeline._schedule import PipelineError, Schedule
from flax_escale.resolve import RulesLike, as_logical_rules

__all__ = ["REMAT_POLICIES", "Remat", "pipeline", "stage_rules"]

Remat: TypeAlias = Literal["none", "layer", "iteration", "save_dots"] | None
"""What a stage recomputes in the backward pass instead of keeping.

``None`` or ``"none"`` keeps every layer's activations; ``"layer"`` keeps each layer's input
and recomputes its inside; ``"iteration"`` keeps only each iteration's input and recomputes
the stage's layers; ``"save_dots"`` keeps the results of matrix multiplications without batch
dimensions (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) per layer.
"""
REMAT_POLICIES: tuple[str, ...] = ("none", "layer", "iteration", "save_dots")
"""The names ``remat=`` accepts (besides ``None``, which is ``"none"``); see :data:`Remat`."""

Layer = Callable[[Any, jax.Array], jax.Array]


def pipeline(
    layer: Layer,
    params: Any,
    x: jax.Array,
    *,
    microbatches: int,
    repeats: int = 1,
    remat: Remat = None,
    axis: str = "pp",
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
) -> jax.Array:
    """Runs ``layer`` over a stack of parameters as a pipeline over the mesh axis ``axis``.

    The result equals ``jax.lax.scan`` of ``layer`` over the stack (the layers in stack order)
    applied to ``x``; each stage computes only its own layers, on one microbatch of ``x`` at a
    time. Call it inside ``jax.jit`` (or ``nnx.jit``), from a model's ``__call__``;
    :func:`flax_escale.nnx.pipeline_stack` and :func:`flax_escale.linen.pipelined` call it for
    a stacked NNX module and a Linen ``nn.scan`` stack.

    The layers' own activation constraints apply inside each stage with the rules less
    ``axis`` (:func:`stage_rules`): the stage axis belongs to the stages there, and a rule that
    sends ``batch`` to ``pp`` outside a pipeline (``pp`` as data parallelism) does not apply
    inside.

    Args:
        layer: One layer, ``layer(params_of_one_layer, activations) -> activations`` of the
            same shape.
        params: The stack: a pytree whose leaves all have the number of layers as their
            leading dimension.
        x: The activations, batch first; cut into ``microbatches`` along the batch.
        microbatches: How many microbatches (a multiple of the stages).
        repeats: How many times each stage runs on each microbatch (``1``: GPipe; more: the
            circular schedule, with the stack cut into ``stages * repeats`` chunks and a
            bubble ``repeats`` times smaller).
        remat: What each stage recomputes in the backward pass (see :data:`Remat`).
        axis: The stage mesh axis.
        mesh: The mesh; defaults to the current mesh.
        rules: The rules whose stage form applies inside the stages; defaults to Flax's rules
            context, then to ``PartitionAxis()``.

    Returns:
        The activations after the whole stack, shaped like ``x``.

    Raises:
        PipelineError: If the mesh has no ``axis``, the stack's layers do not split into
            ``stages * repeats`` chunks, the microbatches are not a multiple of the stages or
            do not divide the batch, or the leaves of ``params`` disagree on the layer count.
        EscaleTypeError: If ``layer`` is not callable, ``remat`` is not one of
            :data:`REMAT_POLICIES`, or ``x`` is not an array with a batch dimension.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.pipeline import pipeline
        >>> mesh = create_mesh((2, 4), ("pp", "fsdp"))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> stack = jax.random.normal(jax.random.key(0), (4, 8, 8)) / 3
        >>> x = jnp.ones((16, 8))
        >>> with jax.set_mesh(mesh):
        ...     y = jax.jit(lambda s, x: pipeline(layer, s, x, microbatches=4))(stack, x)
        >>> scanned = jax.lax.scan(lambda h, w: (layer(w, h), None), x, stack)[0]
        >>> bool(jnp.allclose(y, scanned, atol=1e-6))
        True
    """
    layer = check.callable_(layer, "layer", "pass a function (params, x) -> x of one layer")
    kind = _remat_kind(remat)
    if not isinstance(x, jax.Array | jax.ShapeDtypeStruct) and not hasattr(x, "shape"):
        raise EscaleTypeError(f"x must be an array, got {check.describe(x)}.")
    if not x.shape:
        raise EscaleTypeError(
            f"x must have a batch dimension to cut into microbatches, got a scalar {x!r}."
        )
    on = check.optional_mesh(mesh)
    on = current_mesh() if on is None else on
    stages = _stages(on, axis)
    schedule = Schedule(stages, microbatches, repeats, _layer_count(params))
    rows = schedule.microbatch_size(x.shape[0])
    weights = jax.tree.map(
        functools.partial(_chunked, on, axis, repeats, stages * schedule.layers_per_stage),
        params,
    )
    frozen = as_logical_rules(rules)
    data = _data_axes(frozen, on, axis, rows)
    # Microbatch i is rows i, i + m, i + 2m, ...: each microbatch takes an equal share of every
    # device's rows, so cutting the batch moves nothing.
    x = _on_data_axes(on, data, x)
    weights = jax.tree.map(functools.partial(_whole_over_data, on, axis, data), weights)
    batched = x.reshape(rows, microbatches, *x.shape[1:]).swapaxes(0, 1)
    rows_spec = PartitionSpec(None, data or None)
    run = jax.shard_map(
        functools.partial(_loop, _stage_body(layer, kind, repeats), schedule, axis, data),
        mesh=on,
        in_specs=(jax.tree.map(lambda _: PartitionSpec(None, axis), weights), rows_spec),
        out_specs=rows_spec,
        axis_names=frozenset({axis, *data}),
    )
    with nn.logical_axis_rules(stage_rules(frozen, axis, data=data)):
        out = run(weights, batched)
    return out.swapaxes(0, 1).reshape(x.shape)


def stage_rules(
    rules: LogicalRules, axis: str = "pp", *, data: tuple[str, ...] = ()
) -> LogicalRules:
    """``rules`` less the stage axis and the ``data`` axes: the rules in force inside the stages.

    Inside a pipeline the stage axis belongs to the stages, and the data axes the batch is
    split over are the stages' own too (each device runs its rows of every microbatch), so no
    constraint there may name them.

    Example:
        >>> from flax_escale.pipeline import stage_rules
        >>> stage_rules((("batch", ("fsdp", "dp", "pp")), ("layers", "pp")))
        (('batch', ('fsdp', 'dp')), ('layers', None))
        >>> stage_rules((("batch", ("fsdp", "pp")), ("embed", ("fsdp", "tp"))), data=("fsdp",))
        (('batch', None), ('embed', 'tp'))
    """
    gone = {axis, *data}
    kept = []
    for name, target in rules:
        axes = mesh_axes_of(target)
        if gone.intersection(axes):
            left = tuple(a for a in axes if a not in gone)
            target = left if len(left) > 1 else (left[0] if left else None)
        kept.append((name, target))
    return tuple(kept)


def _loop(
    body: Callable[[Any, jax.Array, jax.Array], jax.Array],
    schedule: Schedule,
    axis: str,
    data: tuple[str, ...],
    weights: Any,
    batched: jax.Array,
) -> jax.Array:
    # One device: its stage's chunks [repeats, layers_per_stage, ...] whole over the data axes
    # (gathered once, before the program enters the loop) and its rows of every microbatch.
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    stage = jax.lax.axis_index(axis)
    forward = [(i, (i + 1) % p) for i in range(p)]
    # The weights meet each device's own rows: said once here, the gradients add up locally
    # through every iteration and are summed over the data axes once, after the loop (said at
    # each use, they would be summed at each use, in every iteration).
    if data:
        weights = jax.lax.pcast(weights, data, to="varying")
    per_repeat = jax.tree.map(
        lambda a: a.reshape(v, schedule.layers_per_stage, *a.shape[2:]), weights
    )

    def arrive(state: jax.Array, buffer: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        # Every stage's output moves on to the next stage; the last stage's reaches the first,
        # which files it under its microbatch (work item t - p) for its next repeat, or as
        # the output after the last.
        arriving = jax.lax.ppermute(state, axis, forward)
        slot = jnp.mod(t - p, m)
        kept = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
        filed = jnp.where(t >= p, arriving, kept)
        return arriving, jax.lax.dynamic_update_index_in_dim(buffer, filed, slot, 0)

    def iteration(t: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        state, buffer = carry
        arriving, buffer = arrive(state, buffer, t)
        # Stage s works on item t - s: microbatch (t - s) mod m, repeat (t - s) // m.
        fresh = jax.lax.dynamic_index_in_dim(buffer, jnp.mod(t, m), keepdims=False)
        inputs = jnp.where(stage == 0, fresh, arriving)
        repeat = jnp.clip((t - stage) // m, 0, v - 1)
        return body(per_repeat, repeat, inputs), buffer

    # The loop's state differs from stage to stage from its first iteration on: say so of its
    # initial value, which is the same everywhere.
    state, buffer = jax.lax.pcast((jnp.zeros_like(batched[0]), batched), (axis,), to="varying")
    state, buffer = jax.lax.fori_loop(0, schedule.iterations, iteration, (state, buffer))
    _, buffer = arrive(state, buffer, jnp.asarray(schedule.iterations))
    # The outputs are on the first stage; every stage returns them (one sum over the axis, in
    # float32 or wider: XLA:CPU fails to compile a bfloat16 sum over part of a mesh's axes, and
    # adding zeros is exact in any type).
    first = jnp.where(stage == 0, buffer, jnp.zeros_like(buffer))
    wide = jnp.promote_types(first.dtype, jnp.float32)
    return jax.lax.psum(first.astype(wide), axis).astype(first.dtype)


def _chunked(
    mesh: Mesh | AbstractMesh, axis: str, repeats: int, width: int, stack: jax.Array
) -> jax.Array:
    # [layers, ...] as [repeats, stages * layers_per_stage, ...]. With several repeats the
    # stages' layers are not the stack's contiguous blocks: on Explicit axes the new dimensions
    # are unsharded first (the stage axis then splits the second; both directions of the
    # reshape have a sharding JAX accepts). On Auto axes the stack is held to its own layout
    # (layers on the stage axis), which holds its gradient there too: the chunks' layout is no
    # layout of the stack, and XLA would return the gradient whole on every device.
    shape = (repeats, width, *stack.shape[1:])
    if repeats == 1:
        return stack.reshape(shape)
    if AxisType.Explicit not in mesh.axis_types:
        own = PartitionSpec(axis, *(PartitionSpec.UNCONSTRAINED,) * (stack.ndim - 1))
        return jax.lax.with_sharding_constraint(stack, NamedSharding(mesh, own)).reshape(shape)
    sharding = getattr(jax.typeof(stack), "sharding", None)
    given = tuple(getattr(sharding, "spec", ()))
    spec = (*given, *(None,) * (stack.ndim - len(given)))
    chunks = jax.lax.reshape(stack, shape, out_sharding=PartitionSpec(None, None, *spec[1:]))
    return jax.sharding.reshard(chunks, PartitionSpec(None, axis, *spec[1:]))


def _data_axes(
    rules: LogicalRules, mesh: Mesh | AbstractMesh, axis: str, rows: int
) -> tuple[str, ...]:
    # The mesh axes the stages run manually besides the stage axis: the batch's (as the rules
    # place it), less any axis the rules give first to something other than a batch (an
    # expert's ep stays with the compiler), less size-1 axes, and only as many as split a
    # microbatch's rows evenly.
    first: dict[str, tuple[str, ...]] = {}
    for name, target in rules:
        first.setdefault(name, mesh_axes_of(target))
    batch = first.get("batch", ())
    batch_like = {batch, first.get("expert_batch", batch)}
    taken = {a for axes in first.values() if axes not in batch_like for a in axes}
    sizes = dict(mesh.shape)
    data: tuple[str, ...] = ()
    for a in batch:
        fits = rows % (math.prod(sizes[d] for d in data) * sizes.get(a, 1)) == 0
        if a != axis and a not in taken and sizes.get(a, 1) > 1 and fits:
            data = (*data, a)
    return data


def _whole_over_data(
    mesh: Mesh | AbstractMesh, axis: str, data: tuple[str, ...], chunks: jax.Array
) -> jax.Array:
    # On Explicit axes, the chunks [repeats, stages * layers_per_stage, ...] on the stage axis
    # and whole over the data axes, as the stages take them: the gather over the data axes is
    # then a visible step of the program, once per step. Auto axes move by themselves.
    if AxisType.Explicit not in mesh.axis_types:
        return chunks
    given = tuple(getattr(getattr(jax.typeof(chunks), "sharding", None), "spec", ()))
    rest = [
        tuple(a for a in mesh_axes_of(entry) if a not in data and a != axis)
        for entry in (*given, *(None,) * (chunks.ndim - len(given)))[2:]
    ]
    wanted = PartitionSpec(None, axis, *(e if len(e) > 1 else (e[0] if e else None) for e in rest))
    if tuple(wanted) == given:
        return chunks
    return jax.sharding.reshard(chunks, wanted)


def _on_data_axes(mesh: Mesh | AbstractMesh, data: tuple[str, ...], x: jax.Array) -> jax.Array:
    # On Explicit axes, the batch laid out on the data axes only (not the stage axis the rules
    # also give it outside the pipeline), so that cutting it into microbatches keeps each
    # device's rows and the stages receive them as they expect; the other dimensions keep
    # their axes. Auto axes move by themselves.
    if AxisType.Explicit not in mesh.axis_types:
        return x
    given = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()))
    rest = (*given, *(None,) * (x.ndim - len(given)))[1:]
    wanted = PartitionSpec(data or None, *rest)
    if tuple(wanted) == given:
        return x
    return jax.sharding.reshard(x, wanted)


def _stage_body(
    layer: Layer, remat: str, repeats: int
) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    # One iteration of one stage: its chunk for the repeat at hand, layer after layer. The
    # chunk is picked inside the body, so that what the backward pass keeps of an iteration
    # is at most the body's inputs: the stage's weights, the same in every iteration, are
    # kept once (with one repeat the pick is static, and the weights are loop invariants),
    # not once per iteration as a picked copy would be.
    step = layer
    if remat == "layer":
        step = jax.checkpoint(layer)
    elif remat == "save_dots":
        step = jax.checkpoint(
            layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )

    def pick(a: jax.Array, repeat: jax.Array) -> jax.Array:
        if repeats == 1:
            return a[0]
        return jax.lax.dynamic_index_in_dim(a, repeat, keepdims=False)

    def body(per_repeat: Any, repeat: jax.Array, x: jax.Array) -> jax.Array:
        chunk = jax.tree.map(functools.partial(pick, repeat=repeat), per_repeat)
        return jax.lax.scan(lambda h, w: (step(w, h), None), x, chunk)[0]

    return jax.checkpoint(body) if remat == "iteration" else body


def _remat_kind(remat: Remat) -> str:
    if remat is None:
        return "none"
    if remat not in REMAT_POLICIES:
        raise EscaleTypeError(
            f"remat must be one of {REMAT_POLICIES} or None, got {remat!r}: 'layer' recomputes "
            "each layer's inside, 'iteration' each iteration's stage, 'save_dots' all but the "
            "weight matmuls."
        )
    return remat


def _stages(mesh: Mesh | AbstractMesh, axis: str) -> int:
    shape = dict(mesh.shape)
    if axis not in shape:
        raise PipelineError(
            f"the mesh {shape} has no pipeline axis {axis!r}: build the mesh with a stage axis, "
            f"e.g. create_mesh((2, -1), ({axis!r}, 'fsdp')) or --mesh {axis}:2,fsdp:4, or pass "
            "axis= naming the mesh axis the stages are on."
        )
    return shape[axis]


def _layer_count(params: Any) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise PipelineError("params has no arrays: pass the stacked parameters of the layers.")
    counts = {}
    for path, leaf in leaves:
        shape = getattr(leaf, "shape", ())
        if not shape:
            raise PipelineError(
                f"params{jax.tree_util.keystr(path)} is a scalar: every leaf of the stack needs "
                "the layer count as its leading dimension."
            )
        counts.setdefault(shape[0], jax.tree_util.keystr(path))
    if len(counts) > 1:
        found = ", ".join(f"params{where}: {n}" for n, where in counts.items())
        raise PipelineError(
            f"the leaves of the stack disagree on the layer count (leading dimension): {found}; "
            "stack every parameter of the layers along one leading axis (stack_layers, nn.scan)."
        )
    return next(iter(counts))
