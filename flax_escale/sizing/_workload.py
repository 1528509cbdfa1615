"""A training workload: a model, its optimizer, batch and step, checked once for every mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._api import front_end
from flax_escale._frontend import InitOptions, Overrides
from flax_escale._frontend import _pipeline as pipeline
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.linen._at_use import data_axes
from flax_escale.plan import USE_IDLE_AXES, ShardingPlan
from flax_escale.resolve import RulesLike

__all__ = ["Workload", "mean_square"]


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
        return self._front_end.name == "linen"

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
        return pipeline.checked_call(self._front_end, self.model, self.rng, self.args, kwargs)

    @functools.cached_property
    def options(self) -> InitOptions:
        """The planning options, checked and frozen once (the rules as they are now)."""
        return InitOptions.create(
            rules=self.rules,
            overrides=self.overrides,
            use_idle_axes=self.use_idle_axes,
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
