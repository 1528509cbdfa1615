"""A training workload, and the two programs it compiles to on one mesh: init and step."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale import _checks as check
from flax_escale._api import front_end
from flax_escale._frontend import _pipeline as pipeline
from flax_escale._frontend._options import InitOptions
from flax_escale._frontend._overrides import Overrides
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.linen import _init as linen_init
from flax_escale.linen._at_use import data_axes, gathering_apply
from flax_escale.nnx._init import optimizer_layout
from flax_escale.plan import ShardingPlan
from flax_escale.plan._optimizer import shardings_checked
from flax_escale.plan._plan import USE_IDLE_AXES
from flax_escale.resolve import RulesLike
from flax_escale.sharding._use_sharding import sharding_context
from flax_escale.tools._data import batch_sharding

__all__ = ["Programs", "Workload", "lower_programs", "lower_step", "mean_square"]


def mean_square(outputs: Any, *batch: Any) -> jax.Array:
    """The default loss: the mean square of the model's floating-point outputs.

    Any scalar of the outputs costs the same to differentiate as a real loss, up to its own
    few operations; pass ``loss=`` (or ``step=``) to plan the step you will run.
    """
    del batch
    leaves = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        raise EscaleError(
            "the model's outputs hold no floating-point array to take the default loss of; "
            "pass loss=lambda outputs, *batch: ... or step=."
        )
    return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and how it trains: what :func:`plan_mesh` compiles on every candidate mesh.

    Attributes:
        model: A Linen module instance or an NNX module class (or callable taking ``rngs=``),
            as :func:`~flax_escale.init_sharded` takes it.
        rng: Its ``rng`` argument: a key, an int seed, or a dict of them by stream name.
        args: Linen: example inputs for ``model.init``; NNX: constructor arguments.
        tx: The optax optimizer.
        batch: The global batch one step takes, as a tuple of arrays or
            ``jax.ShapeDtypeStruct`` (each split as :func:`~flax_escale.batch_sharding` splits
            it: ``batch``, then ``sequence``). Defaults to ``args`` for Linen; NNX needs it.
        step: The training step. Linen: ``step(state, *batch) -> (state, aux)`` with a Flax
            ``TrainState`` (as :func:`~flax_escale.linen.init_train_state` builds it); NNX:
            ``step(model, optimizer, *batch) -> aux``, updating both in place. Defaults to
            one ``value_and_grad`` of ``loss`` and one optimizer update; for Linen, the
            model's random streams (dropout) draw from ``rng`` folded with the step count.
        loss: ``loss(outputs, *batch) -> scalar`` for the default step (default
            :func:`mean_square`).
        rules: The logical-axis rules (default ``PartitionAxis()``'s).
        overrides: As :func:`~flax_escale.plan_sharding` takes them.
        use_idle_axes: As :func:`~flax_escale.plan_sharding` takes it.
        shard_over: Mesh axes the optimizer state is also split over (ZeRO-1).
        init_kwargs: Keyword arguments for ``model.init`` (Linen) or the constructor (NNX).
        gather_at_use: Linen: the state's ``apply_fn`` gathers each parameter where the model
            reads it, as :func:`~flax_escale.linen.init_train_state` makes it with the same
            flag.

    Raises:
        EscaleTypeError: For a missing ``tx``, a batch that is not a tuple of arrays,
            ``init_kwargs`` that are not a mapping, or a ``step`` or ``loss`` that is not a
            function taking the arguments it is called with.
    """

    model: Any
    rng: Any
    args: tuple[Any, ...] = ()
    tx: optax.GradientTransformation | None = None
    batch: tuple[Any, ...] | None = None
    step: Callable[..., Any] | None = None
    loss: Callable[..., Any] | None = None
    rules: RulesLike = None
    overrides: Overrides | None = None
    use_idle_axes: bool = USE_IDLE_AXES
    shard_over: Sequence[str] = ()
    init_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gather_at_use: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.args, tuple):
            raise EscaleTypeError(
                f"Workload: args must be a tuple, got {check.describe(self.args)}; write "
                "args=(x,) for one input."
            )
        if self.tx is None:
            raise EscaleTypeError(
                "Workload: tx is required; pass the optimizer, optax.adamw(1e-4)."
            )
        check.transformation(self.tx, "Workload tx")
        if not isinstance(self.init_kwargs, Mapping):
            raise EscaleTypeError(
                f"Workload: init_kwargs must be a mapping of keyword arguments, got "
                f"{check.describe(self.init_kwargs)}; write init_kwargs={{'train': False}}."
            )
        if self.is_linen:
            if self.batch is None:
                object.__setattr__(self, "batch", self.args)
        elif self.batch is None:
            raise EscaleTypeError(
                "Workload: batch is required for an NNX model (args are its constructor's); "
                "pass batch=(jax.ShapeDtypeStruct((batch, length), jnp.int32),)."
            )
        if not isinstance(self.batch, tuple):
            raise EscaleTypeError(
                f"Workload: batch must be a tuple of arrays, got {check.describe(self.batch)}; "
                "write batch=(tokens,)."
            )
        for i, leaf in enumerate(self.batch):
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise EscaleTypeError(
                    f"Workload: batch[{i}] is {check.describe(leaf)}, not an array; pass arrays "
                    "or jax.ShapeDtypeStruct."
                )
        if self.loss is not None:
            check.callable_(self.loss, "Workload loss")
            _takes(self.loss, "loss", ("outputs",), self.batch)
        if self.step is not None:
            check.callable_(self.step, "Workload step")
            _takes(
                self.step,
                "step",
                ("state",) if self.is_linen else ("model", "optimizer"),
                self.batch,
            )
        object.__setattr__(self, "shard_over", check.names(self.shard_over, "Workload shard_over"))
        if check.flag(self.gather_at_use, "Workload gather_at_use"):
            if not self.is_linen:
                raise EscaleTypeError(
                    "Workload: gather_at_use is for Linen models, whose parameters Flax unboxes "
                    "where they are read; in an NNX model, constrain a parameter where it is "
                    "used: fe.constrain(self.table[...], ('vocab', None))."
                )
            data_axes(self.rules)  # refused here, not on the first mesh, if nothing to gather
        # The model, its arguments and the options are checked here, once for every mesh.
        _ = self.call, self.options

    @property
    def is_linen(self) -> bool:
        """Whether the model is a Linen module (else NNX)."""
        return self._front_end is linen_init.FRONT_END

    @functools.cached_property
    def _front_end(self) -> pipeline.FrontEnd:
        try:
            return front_end(self.model)
        except EscaleTypeError as error:
            raise EscaleTypeError(f"Workload: {error}") from None

    @functools.cached_property
    def call(self) -> pipeline.ModelCall:
        """The model and its arguments, checked once for every mesh."""
        kwargs = dict(self.init_kwargs)
        method = kwargs.pop("method", None) if self.is_linen else None
        return pipeline.checked_call(
            self._front_end, self.model, self.rng, self.args, kwargs, method
        )

    @functools.cached_property
    def options(self) -> InitOptions:
        """The planning options, checked and frozen once (the rules as they are now)."""
        return InitOptions.create(
            rules=self.rules,
            overrides=self.overrides,
            use_idle_axes=self.use_idle_axes,
            method=dict(self.init_kwargs).get("method") if self.is_linen else None,
        )

    def request(self, mesh: Mesh) -> pipeline.Request:
        """The pipeline's request for ``mesh``."""
        return pipeline.Request(self._front_end, self.call, mesh, self.options)

    @functools.cached_property
    def traced(self) -> pipeline.Traced | None:
        """The variables traced once, when tracing depends on no mesh (NNX); else ``None``."""
        if self._front_end.trace_needs_mesh:
            return None
        return self._front_end.trace(self.call, None, self.options)

    def plan(self, mesh: Mesh) -> ShardingPlan:
        """The variables' sharding plan on ``mesh`` (:func:`~flax_escale.plan_sharding`)."""
        return pipeline.plan(self.request(mesh), self.traced)[1]

    def lower_init(self, mesh: Mesh) -> jax.stages.Lowered:
        """The sharded initializer on ``mesh``, lowered (:func:`~flax_escale.lower_init`)."""
        return pipeline.lower(self.request(mesh), self.traced)[2]


def _takes(
    fn: Callable[..., Any], name: str, first: tuple[str, ...], batch: tuple[Any, ...]
) -> None:
    # Checked against the call the training step makes, so that a wrong signature is said once,
    # here, rather than as Python's error from inside the trace on every mesh.
    arguments = [*first, *(f"batch[{i}]" for i in range(len(batch)))]
    check.takes_positional(
        fn, len(arguments), f"Workload {name}", f"{name}({', '.join(arguments)})"
    )


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
    state, step = (_linen_state if workload.is_linen else _nnx_state)(workload, mesh, plan)
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
        lowered = jitted.lower(state, *examples)
    return lowered, _max_device_bytes(state)


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
