"""A mixture-of-experts MLP: route, dispatch by the chosen strategy, combine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.moe._capacity import capacity_dispatch
from flax_escale.moe._dropless import Exchange, dropless_dispatch
from flax_escale.moe._experts import GatedExperts, checked_activation
from flax_escale.moe._layout import Dispatch, expert_rules
from flax_escale.moe._routing import route_top_k
from flax_escale.resolve import RulesLike
from flax_escale.sharding import constrain

__all__ = ["STRATEGIES", "MoeOutput", "Strategy", "moe_mlp"]

Strategy = Literal["capacity", "dropless"]
"""How :func:`moe_mlp` sends tokens to their experts: one of :data:`STRATEGIES`."""
STRATEGIES: tuple[Strategy, ...] = ("capacity", "dropless")
"""The dispatch strategies of :func:`moe_mlp`."""
_EXCHANGES = ("all_to_all", "ragged_all_to_all")
_ACTIVATION = ("batch", "sequence", "hidden_state")


class MoeOutput(NamedTuple):
    """What :func:`moe_mlp` returns.

    Attributes:
        output: ``(batch, sequence, hidden)``, the weighted sum of each token's experts.
        aux_loss: The router's load-balancing loss (see :class:`Routing`).
        dropped: How many token assignments found their expert full (int32; always 0 for
            the dropless strategy). Their share of the output is zero.
    """

    output: jax.Array
    aux_loss: jax.Array
    dropped: jax.Array


def moe_mlp(
    x: jax.Array,
    router_kernel: jax.Array,
    experts: GatedExperts,
    *,
    top_k: int,
    strategy: Strategy = "capacity",
    capacity_factor: float | None = None,
    exchange: Exchange | None = None,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
    strict: bool = False,
) -> MoeOutput:
    """Each token through its ``top_k`` experts, sharded by the logical rules.

    Two strategies, one result when nothing overflows:

    - ``"capacity"`` (GShard's): each sequence's tokens take fixed-size slots per expert
      (``capacity_factor`` times an even share); one-hot einsums dispatch and combine them, and
      logical constraints put the experts on ``ep``, so XLA moves tokens with all-to-alls.
      Shapes are static and the matmuls dense, which suits TPUs; assignments beyond capacity
      are dropped and counted in ``dropped``. The dispatch masks grow with the square of the
      sequence length, so keep sequences (the groups) to a few thousand tokens.
    - ``"dropless"``: a :func:`~flax_escale.sharding.logical_shard_map` body sorts the
      assignments by expert, sends them to the devices that hold their experts, and runs
      grouped matmuls (``jax.lax.ragged_dot``); nothing is dropped and no slot is computed in
      vain. ``exchange`` picks the collective: ``"all_to_all"`` (padded to the worst case of
      every row going to one device: ``ep`` times the bytes, runs everywhere) or
      ``"ragged_all_to_all"`` (only the rows sent; TPU and GPU: refused on a mesh of CPU
      devices, which cannot run it).

    ``capacity_factor`` belongs to the capacity strategy and ``exchange`` to the dropless one:
    either given with the other strategy is refused rather than ignored (``None``, the default,
    is each one's default: 1.25 and ``"all_to_all"``).

    When the rules cannot split the experts (their number does not divide ``ep``, say), every
    device computes every expert: that warns with a
    :class:`~flax_escale.ShardingCorrectionWarning` naming ``experts.wi_gate``, or with
    ``strict=True`` raises, for both strategies alike.

    A batch of no tokens gives an empty output, an ``aux_loss`` of 0 (nothing to balance) and
    finite gradients.

    Args:
        x: ``(batch, sequence, hidden)`` activations.
        router_kernel: ``(hidden, num_experts)``.
        experts: The experts' kernels.
        top_k: Experts per token.
        strategy: ``"capacity"`` or ``"dropless"``.
        capacity_factor: Slots per expert, as a multiple of an even share (``"capacity"``
            only; ``None``: 1.25).
        exchange: ``"all_to_all"`` or ``"ragged_all_to_all"`` (``"dropless"`` only; ``None``:
            ``"all_to_all"``).
        activation: The gate's activation, a function of one array (``jax.nn.silu``: SwiGLU;
            ``jax.nn.gelu``: GeGLU). A name such as ``"silu"`` is refused: pass the function.
        mesh: The mesh; defaults to the current one (none: one device).
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        strict: Raise :class:`~flax_escale.ShardingResolutionError` where the rules cannot
            apply as written (experts that do not split, an activation's dimension that does
            not divide its mesh axes) instead of warning.

    Returns:
        The :class:`MoeOutput`.

    Raises:
        EscaleError: For an unknown strategy or exchange, an option of the other strategy, a
            capacity factor that is not above 0, shapes that do not fit together (named in the
            message), or ``exchange="ragged_all_to_all"`` over the experts' axes of a CPU mesh.
        EscaleTypeError: If ``x``, ``router_kernel`` or a kernel is not an array, ``experts``
            not a :class:`GatedExperts`, ``capacity_factor`` not a number, ``activation`` not a
            function, or ``strict`` not a bool.
        ShardingResolutionError: With ``strict``, for what the rules cannot apply.

    Example:
        >>> import jax
        >>> from flax_escale.moe import GatedExperts, moe_mlp
        >>> keys = jax.random.split(jax.random.key(0), 5)
        >>> x = jax.random.normal(keys[0], (2, 8, 16))
        >>> router = jax.random.normal(keys[1], (16, 4))
        >>> experts = GatedExperts(*(jax.random.normal(k, s) * 0.1 for k, s in zip(
        ...     keys[2:], [(4, 16, 32), (4, 16, 32), (4, 32, 16)])))
        >>> capacity = moe_mlp(x, router, experts, top_k=2, capacity_factor=4.0)
        >>> dropless = moe_mlp(x, router, experts, top_k=2, strategy="dropless")
        >>> int(capacity.dropped), bool(jax.numpy.allclose(capacity.output, dropless.output,
        ...                                                  atol=1e-5))
        (0, True)
    """
    options = _options(strategy, capacity_factor, exchange, activation, mesh, strict)
    _check_shapes(x, router_kernel, experts)
    rules = expert_rules(experts, options.mesh, rules, strict=options.strict)
    x = constrain(x, _ACTIVATION, mesh=options.mesh, rules=rules, strict=options.strict)
    logits = jnp.einsum("bsh,he->bse", x, router_kernel)
    routing = route_top_k(logits, top_k)
    dispatch = Dispatch(options.activation, options.mesh, rules, options.strict)
    if options.strategy == "capacity":
        out, dropped = capacity_dispatch(x, routing, experts, dispatch, options.capacity_factor)
    else:
        out = dropless_dispatch(x, routing, experts, dispatch, options.exchange)
        dropped = jnp.zeros((), jnp.int32)
    out = constrain(out, _ACTIVATION, mesh=options.mesh, rules=rules, strict=options.strict)
    return MoeOutput(out, routing.aux_loss, dropped.astype(jnp.int32))


class _Options(NamedTuple):
    """:func:`moe_mlp`'s options, checked once, with each strategy's defaults filled in."""

    strategy: Strategy
    capacity_factor: float
    exchange: Exchange
    activation: Callable[[jax.Array], jax.Array]
    mesh: Mesh | AbstractMesh | None
    strict: bool


def _options(
    strategy: object,
    capacity_factor: object,
    exchange: object,
    activation: object,
    mesh: object,
    strict: object,
) -> _Options:
    if strategy not in STRATEGIES:
        raise EscaleError(f"moe_mlp: strategy must be one of {STRATEGIES}, got {strategy!r}.")
    # An option of the other strategy would do nothing: say so rather than ignore it.
    if strategy == "capacity" and exchange is not None:
        raise EscaleError(
            f"moe_mlp: exchange={exchange!r} is an option of strategy='dropless', and the "
            "capacity strategy has no exchange to choose (XLA moves its dispatched tokens); "
            "drop exchange=, or pass strategy='dropless'."
        )
    if strategy == "dropless" and capacity_factor is not None:
        raise EscaleError(
            f"moe_mlp: capacity_factor={capacity_factor!r} is an option of "
            "strategy='capacity', and the dropless strategy has no capacity (it drops no "
            "token); drop capacity_factor=, or pass strategy='capacity'."
        )
    exchange = "all_to_all" if exchange is None else exchange
    if exchange not in _EXCHANGES:
        raise EscaleError(f"moe_mlp: exchange must be one of {_EXCHANGES}, got {exchange!r}.")
    factor = 1.25 if capacity_factor is None else capacity_factor
    return _Options(
        strategy=strategy,
        capacity_factor=check.positive_number(factor, "moe_mlp: capacity_factor"),
        exchange=exchange,
        activation=checked_activation(activation, "moe_mlp: activation"),
        mesh=check.optional_mesh(mesh, "moe_mlp: mesh"),
        strict=check.flag(strict, "moe_mlp: strict"),
    )


def _check_shapes(x: jax.Array, router_kernel: jax.Array, experts: GatedExperts) -> None:
    check.instance(experts, GatedExperts, "experts", "GatedExperts(wi_gate, wi_up, wo)")
    kernels = [(f"experts.{name}", kernel) for name, kernel in experts._asdict().items()]
    for name, value in [("x", x), ("router_kernel", router_kernel), *kernels]:
        if not isinstance(getattr(value, "shape", None), tuple) or not hasattr(value, "dtype"):
            raise EscaleTypeError(
                f"moe_mlp: {name} must be an array, got {check.describe(value)}; pass a "
                "jax.Array (jnp.asarray(...) makes one)."
            )
    if jnp.ndim(x) != 3 or jnp.ndim(experts.wi_gate) != 3:
        raise EscaleError(
            f"moe_mlp: x must be (batch, sequence, hidden) and experts.wi_gate (experts, "
            f"hidden, mlp), got shapes {tuple(jnp.shape(x))} and "
            f"{tuple(jnp.shape(experts.wi_gate))}."
        )
    hidden = jnp.shape(x)[-1]
    num_experts, expert_hidden, mlp = jnp.shape(experts.wi_gate)
    shapes = {
        "x": (jnp.shape(x), (None, None, hidden)),
        "router_kernel": (jnp.shape(router_kernel), (hidden, num_experts)),
        "experts.wi_up": (jnp.shape(experts.wi_up), (num_experts, hidden, mlp)),
        "experts.wo": (jnp.shape(experts.wo), (num_experts, mlp, hidden)),
    }
    if expert_hidden != hidden:
        shapes["experts.wi_gate"] = (jnp.shape(experts.wi_gate), (num_experts, hidden, mlp))
    for name, (shape, want) in shapes.items():
        fits = len(shape) == len(want) and all(
            w is None or s == w for s, w in zip(shape, want, strict=True)
        )
        if not fits:
            raise EscaleError(
                f"moe_mlp: {name} has shape {tuple(shape)}; with x {tuple(jnp.shape(x))} and "
                f"experts.wi_gate {tuple(jnp.shape(experts.wi_gate))} (experts, hidden, mlp) it "
                f"must be {tuple('any' if w is None else w for w in want)}."
            )
