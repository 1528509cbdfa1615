"""The two programs a workload compiles to on one mesh, lowered: its init and training step.

The step is lowered with the train state it holds (parameters and optimizer state, each with
its sharding): a Flax ``TrainState`` for Linen, the model and optimizer's state for NNX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.linen._at_use import data_axes, gathering_apply
from flax_escale.nnx._init import optimizer_layout
from flax_escale.plan import ShardingPlan
from flax_escale.plan._optimizer import shardings_checked
from flax_escale.sharding._use_sharding import sharding_context
from flax_escale.sizing._workload import Workload, mean_square
from flax_escale.tools import batch_sharding

__all__ = [
    "Programs",
    "batch_shardings",
    "lower_programs",
    "lower_step",
    "step_state",
    "trace_step",
]


@dataclasses.dataclass(frozen=True)
class Programs:
    """A workload on one mesh, lowered: its plan, init and step, and the state's bytes.

    Attributes:
        plan: The variables' sharding plan.
        init: The sharded initializer, lowered.
        step: The training step, lowered with the train state's shardings in and out (its
            buffers donated) and the batch split as :func:`~flax_escale.batch_sharding` says.
        state_bytes: Bytes of the train state (parameters, optimizer state, step) on the
            device that holds the most.
    """

    plan: ShardingPlan
    init: jax.stages.Lowered
    step: jax.stages.Lowered
    state_bytes: int


def batch_shardings(workload: Workload, mesh: Mesh) -> list[Any]:
    """The sharding of every array of the workload's batch on ``mesh``."""
    return [
        batch_sharding(mesh, tuple(x.shape), rules=workload.options.rules)
        if len(x.shape)
        else NamedSharding(mesh, PartitionSpec())
        for x in workload.batch
    ]


def lower_programs(workload: Workload, mesh: Mesh, plan: ShardingPlan | None = None) -> Programs:
    """Lowers the workload's init and training step on ``mesh`` without allocating anything.

    Args:
        workload: The workload.
        mesh: The mesh.
        plan: Its sharding plan on ``mesh``, if already made.

    Returns:
        The :class:`Programs`.

    Raises:
        EscaleTypeError: If the step does not return what it should (Linen: the updated
            ``TrainState`` and arrays; NNX: arrays), or the loss returns no floating-point
            value.
        EscaleError: If the loss returns an array that is not a scalar.
    """
    plan = workload.plan(mesh) if plan is None else plan
    init = workload.lower_init(mesh)
    step, state_bytes = _lower_step(workload, mesh, plan)
    return Programs(plan, init, step, state_bytes)


def lower_step(
    workload: Workload, mesh: Mesh, plan: ShardingPlan | None = None
) -> jax.stages.Lowered:
    """The training step of :func:`lower_programs` alone, for a caller that needs no init.

    Raises:
        EscaleTypeError: As :func:`lower_programs`.
        EscaleError: As :func:`lower_programs`.
    """
    return _lower_step(workload, mesh, workload.plan(mesh) if plan is None else plan)[0]


def _lower_step(
    workload: Workload, mesh: Mesh, plan: ShardingPlan
) -> tuple[jax.stages.Lowered, int]:
    # The step lowered, and the train state's bytes on the device that holds the most.
    traced, state_bytes = trace_step(workload, mesh, plan)
    with sharding_context(mesh, workload.options.rules):
        return traced.lower(), state_bytes


def trace_step(workload: Workload, mesh: Mesh, plan: ShardingPlan) -> tuple[jax.stages.Traced, int]:
    """The training step of :func:`lower_programs` traced (its jaxpr), not lowered.

    Returns:
        The traced step and the train state's bytes on the device that holds the most.

    Raises:
        EscaleTypeError: As :func:`lower_programs`.
        EscaleError: As :func:`lower_programs`.
    """
    state, step = step_state(workload, mesh, plan)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch = batch_shardings(workload, mesh)
    jitted = jax.jit(
        step,
        in_shardings=(shardings, *batch),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    examples = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip(workload.batch, batch, strict=True)
    ]
    with sharding_context(mesh, workload.options.rules):
        traced = jitted.trace(state, *examples)
    return traced, _max_device_bytes(state)


def step_state(
    workload: Workload, mesh: Mesh, plan: ShardingPlan
) -> tuple[Any, Callable[..., Any]]:
    """The abstract train state the step is lowered with (its shardings set), and the step.

    Linen: a Flax ``TrainState``; NNX: the state of the model and its optimizer. The step
    takes the state and the batch and returns the state and what the user's step returns
    besides.

    Raises:
        EscaleError: For a Linen model with variable collections besides ``params``.
    """
    return (_linen_state if workload.is_linen else _nnx_state)(workload, mesh, plan)


def _abstract(shape: Sequence[int], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _with_shardings(tree: Any, shardings: Any) -> Any:
    # By leaf order: NNX states hold their arrays in Variables, which the sharding trees do not.
    leaves, treedef = jax.tree.flatten(tree)
    placed = jax.tree.leaves(shardings)
    return treedef.unflatten(
        [_abstract(x.shape, x.dtype, s) for x, s in zip(leaves, placed, strict=True)]
    )


def _linen_state(
    workload: Workload, mesh: Mesh, plan: ShardingPlan
) -> tuple[TrainState, Callable[..., Any]]:
    variables = plan.treedef.unflatten(
        [_abstract(e.shape, e.dtype, NamedSharding(mesh, e.spec)) for e in plan]
    )
    others = sorted(c for c in variables if c != "params" and jax.tree.leaves(variables[c]))
    if others:
        raise EscaleError(
            f"the model has variable collections {others} besides 'params'; plan_mesh plans a "
            "TrainState of parameters only, as init_train_state builds it."
        )
    params = variables["params"]
    tx = workload.tx
    opt = _with_shardings(
        jax.eval_shape(tx.init, params),
        shardings_checked(tx, params, workload.shard_over),
    )
    step = _abstract((), np.int32, NamedSharding(mesh, PartitionSpec()))
    apply_fn = workload.model.apply
    if workload.gather_at_use:
        apply_fn = gathering_apply(apply_fn, params, data_axes(workload.options.rules))
    state = TrainState(step=step, apply_fn=apply_fn, params=params, tx=tx, opt_state=opt)
    user_step = workload.step or _linen_step(workload.loss or mean_square, workload.call.rng)

    def checked_step(state: TrainState, *batch: Any) -> tuple[TrainState, Any]:
        try:
            result = user_step(state, *batch)
        except flax.errors.InvalidRngError as error:
            # Flax's words name the module and the stream, not the step that gives none.
            raise EscaleTypeError(
                f"Workload step: the model draws random numbers the step gives it no key for "
                f"({str(error).split(' (https')[0]}); call the model with keys, as "
                "state.apply_fn(variables, *batch, rngs={'dropout': jax.random.fold_in(key, "
                "state.step)}), or leave step out: the default step gives every stream the "
                "Workload's rng."
            ) from error
        return _linen_result(result, state)

    return state, checked_step


def _linen_step(loss: Callable[..., Any], rng: Any) -> Callable[..., Any]:
    # The model's random streams (dropout, say) draw from the Workload's rng, folded with the
    # step count as a training loop advances it (a key folded with a traced count cannot be
    # folded into a constant by the compiler); one key serves every stream, as in Flax's init.
    streams = rng if isinstance(rng, Mapping) else {"params": rng}

    def step(state: TrainState, *batch: Any) -> tuple[TrainState, jax.Array]:
        keys = {name: jax.random.fold_in(key, state.step) for name, key in streams.items()}

        def objective(params: Any) -> jax.Array:
            outputs = state.apply_fn({"params": params}, *batch, rngs=keys)
            return _scalar_loss(loss(outputs, *batch))

        value, grads = jax.value_and_grad(objective)(state.params)
        return state.apply_gradients(grads=grads), value

    return step


def _linen_result(result: Any, state: TrainState) -> tuple[TrainState, Any]:
    # The step is jitted with the state's shardings out: anything but a state of the same
    # structure would fail there as JAX's "Mismatch details", which names no argument.
    if not (isinstance(result, tuple) and len(result) == 2):
        # A traced TrainState's repr is a page of tracers: its type says enough.
        got = "the TrainState alone" if isinstance(result, TrainState) else check.describe(result)
        raise EscaleTypeError(
            f"Workload step must return (state, aux), got {got}; end it with "
            "`return state.apply_gradients(grads=grads), loss`."
        )
    if jax.tree.structure(result[0]) != jax.tree.structure(state):
        got = (
            "a TrainState of another structure (another apply_fn, tx or opt_state)"
            if isinstance(result[0], TrainState)
            else check.describe(result[0])
        )
        raise EscaleTypeError(
            f"Workload step must return (state, aux) with the TrainState it was given, updated; "
            f"its state is {got}; return state.apply_gradients(grads=grads) or "
            "state.replace(...)."
        )
    return result[0], _aux(result[1])


def _aux(aux: Any) -> Any:
    # What the step reports comes out of the jitted step, which takes arrays and numbers only.
    for leaf in jax.tree.leaves(aux):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            raise EscaleTypeError(
                f"Workload step: what it returns besides the state holds {check.describe(leaf)}, "
                "not an array; return arrays or numbers (the loss, metrics), or None."
            )
    return aux


def _scalar_loss(value: Any) -> Any:
    # jax.grad's own errors ("Gradient only defined for scalar-output functions") name neither
    # the loss nor what it should return.
    hint = "return one floating-point scalar, such as jnp.mean((outputs - targets) ** 2)"
    if isinstance(value, (float, np.floating)):
        return value
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise EscaleTypeError(f"Workload loss returned {check.describe(value)}; {hint}.")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise EscaleTypeError(
            f"Workload loss returned an array of dtype {value.dtype}; {hint} (cast with "
            ".astype(jnp.float32))."
        )
    if value.shape != ():
        raise EscaleError(
            f"Workload loss returned an array of shape {tuple(value.shape)}, not a scalar; {hint}."
        )
    return value


def _nnx_state(
    workload: Workload, mesh: Mesh, plan: ShardingPlan
) -> tuple[nnx.State, Callable[..., Any]]:
    graphdef, values = nnx.split(workload.traced.abstract)
    model = nnx.merge(graphdef, _with_shardings(values, plan.shardings()))
    layout = optimizer_layout(model, workload.tx, shard_over=workload.shard_over)
    opt_values = _with_shardings(layout.abstract, layout.shardings)
    optimizer = nnx.merge(layout.graphdef, opt_values)
    pair_graphdef, state = nnx.split((model, optimizer))
    user_step = workload.step or _nnx_step(workload.loss or mean_square)

    def step(state: nnx.State, *batch: Any) -> tuple[nnx.State, Any]:
        model, optimizer = nnx.merge(pair_graphdef, state)
        aux = _aux(user_step(model, optimizer, *batch))
        return nnx.state((model, optimizer)), aux

    return state, step


def _nnx_step(loss: Callable[..., Any]) -> Callable[..., Any]:
    def step(model: nnx.Module, optimizer: nnx.Optimizer, *batch: Any) -> jax.Array:
        value, grads = nnx.value_and_grad(lambda m: _scalar_loss(loss(m(*batch), *batch)))(model)
        optimizer.update(model, grads)
        return value

    return step


def _max_device_bytes(tree: Any) -> int:
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        shard = math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for device in leaf.sharding.device_set:
            per_device[device] = per_device.get(device, 0) + shard
    return max(per_device.values(), default=0)
