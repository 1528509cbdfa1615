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
        tokens: Which batch dimensions count tokens, for the tokens per device that each
            compiled mesh's notes weigh against the hardware
            (:attr:`~flax_escale.sizing.Workload.token_dims`): ``None`` for the default,
            ``i`` for ``batch[i]`` by the default's rule, or ``(i, n)`` for the first ``n``
            dimensions of ``batch[i]``. By default the tokens are those of the first integer
            array (token ids): its first two dimensions, batch x sequence (its one, for a
            vector). Without one, those of the first array: a float array of rank 3 or more is
            batch x sequence x features, so its first two count; a matrix is rows of features,
            so only its rows count (a ``(64, 1024)`` float batch is 64 tokens).
        layers: The layer count of the model's stack of identical layers, which a pipeline
            splits into stages; needed with ``pipelined``.
        pipelined: A function called as ``pipelined(microbatches=m, repeats=v, remat=r)``
            returning the Workload whose model runs its stack with
            :func:`flax_escale.nnx.pipeline_stack` (or :func:`flax_escale.linen.pipelined`)
            over the mesh's ``pp`` axis, with those settings
            (:data:`flax_escale.pipeline.Remat` for ``r``). Given it, :func:`plan_mesh` also
            plans pipelines: ``pp`` (stages dividing ``layers``), microbatches, repeats and a
            rematerialization policy. Without it, no pipeline is planned.
        context_parallel: A function called as ``context_parallel(strategy)`` (one of
            :data:`flax_escale.context.CONTEXT_STRATEGIES`) returning the Workload whose attention
            runs with :func:`flax_escale.context.context_attention` by that strategy. Given
            it, :func:`plan_mesh` also plans context parallelism on the meshes whose sequence
            axes split the sequence. Without it, attention is left to XLA on every mesh.

    Raises:
        EscaleTypeError: For a missing ``tx``, a batch that is not a tuple of arrays,
            ``init_kwargs`` that are not a mapping, a ``step`` or ``loss`` that is not a
            function taking the arguments it is called with, or ``tokens`` that is neither an
            index nor an ``(index, dimensions)`` pair, or a ``pipelined`` or
            ``context_parallel`` that is not a function.
        EscaleError: For ``pipelined`` without ``layers``, ``layers`` below 1, or ``tokens``
            naming an array the batch lacks, a scalar, or more
            dimensions than its array has.
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
    tokens: int | tuple[int, int] | None = None
    layers: int | None = None
    pipelined: Callable[..., Workload] | None = None
    context_parallel: Callable[[str], Workload] | None = None

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
        self._check_pipeline()
        if self.context_parallel is not None:
            check.callable_(self.context_parallel, "Workload context_parallel")
        # The model, its arguments and the options are checked here, once for every mesh.
        _ = self.call, self.options, self.token_dims

    def _check_pipeline(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", check.positive_int(self.layers, "Workload layers"))
        if self.pipelined is None:
            return
        check.callable_(self.pipelined, "Workload pipelined")
        if self.layers is None:
            raise EscaleError(
                "Workload: pipelined is given without layers; the planner splits the stack's "
                "layers into stages, so pass layers=<the stack's layer count> as well."
            )

    @functools.cached_property
    def token_dims(self) -> tuple[int, tuple[int, ...]] | None:
        """``(i, dims)``: the dimensions of ``batch[i]`` that count tokens (see ``tokens``).

        ``None`` when no batch array has a dimension.

        Example:
            >>> import jax, jax.numpy as jnp, optax
            >>> from flax import nnx
            >>> from flax_escale.sizing import Workload
            >>> def linear(rngs):
            ...     return nnx.Linear(1024, 1024, rngs=rngs)
            >>> def planned(*batch, **options):
            ...     return Workload(linear, 0, tx=optax.sgd(0.1), batch=batch, **options)
            >>> ids = jax.ShapeDtypeStruct((64, 1024), jnp.int32)
            >>> rows = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
            >>> planned(rows, ids).token_dims  # the token ids: batch x sequence
            (1, (0, 1))
            >>> planned(rows).token_dims  # rows of features: one token each
            (0, (0,))
            >>> planned(rows, ids, tokens=(0, 2)).token_dims  # said otherwise
            (0, (0, 1))
        """
        batch = self.batch or ()
        if self.tokens is None:
            ints = [i for i, x in enumerate(batch) if len(x.shape) and _is_int(x)]
            shaped = [i for i, x in enumerate(batch) if len(x.shape)]
            if not shaped:
                return None
            index = (ints or shaped)[0]
            return index, _default_dims(batch[index])
        index, count = self._checked_tokens(len(batch))
        rank = len(batch[index].shape)
        if not rank:
            raise EscaleError(
                f"Workload: tokens={self.tokens!r} names batch[{index}], a scalar, which has no "
                "dimension to count tokens along; name an array of the batch."
            )
        if count is None:
            return index, _default_dims(batch[index])
        if count > rank:
            raise EscaleError(
                f"Workload: tokens={self.tokens!r} counts {count} dimensions of batch[{index}], "
                f"which has {rank} (shape {tuple(batch[index].shape)}); pass ({index}, 2) for "
                f"batch x sequence or ({index}, 1) for rows."
            )
        return index, tuple(range(count))

    def _checked_tokens(self, size: int) -> tuple[int, int | None]:
        # An index alone, or (index, dimensions); each an int, the index within the batch.
        pair = isinstance(self.tokens, tuple) and len(self.tokens) == 2
        index, count = self.tokens if pair else (self.tokens, None)
        hint = "pass tokens=0 for batch[0], or tokens=(0, 2) for its first two dimensions"
        try:
            index = check.non_negative_int(index, "Workload tokens")
            if count is not None:
                count = check.positive_int(count, "Workload tokens' dimensions")
        except (EscaleError, EscaleTypeError) as error:
            raise type(error)(
                f"Workload: tokens must be a batch index or an (index, dimensions) pair, got "
                f"{check.describe(self.tokens)}; {hint}."
            ) from None
        if index >= size:
            raise EscaleError(
                f"Workload: tokens={self.tokens!r} names batch[{index}], and the batch has "
                f"{size} array(s); {hint}."
            )
        return index, count

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


def _is_int(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.integer))


def _default_dims(x: Any) -> tuple[int, ...]:
    # Token ids are (batch, sequence); a float array is (batch, sequence, features) from rank
    # 3 on, and a matrix is rows of features, each row one token.
    rank = len(x.shape)
    return (0, 1) if rank >= 3 or (rank == 2 and _is_int(x)) else (0,)


def _takes(
    fn: Callable[..., Any], name: str, first: tuple[str, ...], batch: tuple[Any, ...]
) -> None:
    # Checked against the call the training step makes, so that a wrong signature is said once,
    # here, rather than as Python's error from inside the trace on every mesh.
    arguments = [*first, *(f"batch[{i}]" for i in range(len(batch)))]
    check.takes_positional(
        fn, len(arguments), f"Workload {name}", f"{name}({', '.join(arguments)})"
    )
