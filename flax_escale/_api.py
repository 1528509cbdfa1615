"""One name, either Flax API: the library's entry points for declaring, planning and initializing.

These are the library's entry points; each hands the model to the Linen or NNX front end by what
it is. Their docstrings hold the description of the arguments both front ends share; the front
ends' own functions (``flax_escale.linen.*``, ``flax_escale.nnx.*``) refer to it and describe only
what differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._frontend import _pipeline as pipeline
from flax_escale._frontend._options import InitOptions
from flax_escale._frontend._overrides import Overrides
from flax_escale._frontend._patterns import AxesPatterns
from flax_escale.errors import EscaleTypeError
from flax_escale.linen import _annotate as linen_annotate
from flax_escale.linen import _init as linen_init
from flax_escale.nnx import _annotate as nnx_annotate
from flax_escale.nnx import _init as nnx_init
from flax_escale.plan import USE_IDLE_AXES, ShardingPlan
from flax_escale.resolve import RulesLike

__all__ = ["front_end", "init_sharded", "lower_init", "plan_sharding", "sharded_module"]


def sharded_module(
    cls: Any = None, /, patterns: Mapping[str, Sequence[str | None]] | None = None
) -> Any:
    """Declares the logical axes of a Linen or NNX module's parameters, by path pattern.

    ``@sharded_module({pattern: logical axes})`` (or ``patterns=`` as a keyword, or a bare
    ``@sharded_module`` on a class with a ``patterns`` attribute). A pattern is a regular
    expression matched on whole trailing components of a parameter's path relative to the
    decorated module (``"kernel"`` matches ``wi/kernel``; ``"wi/kernel"`` does not match
    ``xwi/kernel``); the first pattern that matches wins, the innermost decorated module
    first, and a parameter that already carries its own annotation keeps it. Subclasses of a
    decorated class are decorated too (their own ``patterns`` extend the parent's). Values
    are untouched and the model's own code reads them as it does undecorated (plain arrays,
    a tied embedding's ``.T`` included): the names are kept beside them, for
    :func:`init_sharded` to resolve.

    The class goes to :func:`flax_escale.sharded_module` (a ``flax.linen.Module``) or
    :func:`flax_escale.sharded_module` (a ``flax.nnx.Module``).

    Raises:
        EscaleTypeError: If the class is not a Flax module class.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import sharded_module
        >>> @sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
        ... class Up(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(16)(x)
        >>> Up().init(jax.random.key(0), jnp.ones((1, 8)))["params"]["Dense_0"]["kernel"].names
        ('hidden_state', 'mlp_intermediate')
    """
    if cls is None or isinstance(cls, Mapping):
        declared = cls if patterns is None else patterns
        # Checked now, so that a malformed mapping is refused at the call, not when (or if)
        # the decorator is applied to a class.
        AxesPatterns.compile("sharded_module patterns", declared)
        return lambda target: sharded_module(target, patterns=declared)
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        return linen_annotate.sharded_module(cls, patterns=patterns)
    if isinstance(cls, type) and issubclass(cls, nnx.Module):
        return nnx_annotate.sharded_module(cls, patterns=patterns)
    raise EscaleTypeError(
        "sharded_module decorates Flax module classes: flax.linen.Module classes or "
        f"flax.nnx.Module classes, got {cls!r}."
    )


def plan_sharding(
    model: Any,
    mesh: Mesh,
    rng: Any,
    *args: Any,
    rules: RulesLike = None,
    strict: bool = False,
    overrides: Overrides | None = None,
    use_idle_axes: bool = USE_IDLE_AXES,
    **kwargs: Any,
) -> ShardingPlan:
    """The sharding every variable of ``model`` gets on ``mesh``, without creating any.

    The model is only traced (``jax.eval_shape``). Every annotation is read the one way (Flax's
    Linen boxes, ``param_with_axes``, NNX metadata, ``sharded_module`` declarations) and
    resolved by the one resolver, shape-aware on ``mesh``; unannotated variables are
    replicated; what cannot apply is corrected and warned about (or raises with ``strict``).

    Args:
        model: A ``flax.linen.Module`` instance (traced as ``model.init(rng, *args)``), or an
            NNX module class or any callable taking ``rngs=`` (traced as
            ``model(*args, rngs=nnx.Rngs(rng))``).
        mesh: The mesh.
        rng: For Linen, a key or a dict of keys, as ``model.init`` takes; for NNX, an ``int``
            seed, a key, or a dict of them by stream name, for ``nnx.Rngs``.
        *args: Example inputs (Linen) or constructor arguments (NNX).
        rules: The logical-axis rules, a ``PartitionAxis`` or pairs; defaults to Flax's rules
            context, then to ``PartitionAxis()``'s.
        strict: Raise on any correction, logical name without a rule, or pattern that
            matched nothing, instead of warning.
        overrides: ``{path pattern: logical axes}`` replacing the annotation of every variable
            a pattern matches, the model's own included: how to correct a model without
            editing its files.
        use_idle_axes: A variable of at least 1 MiB that the rules leave unsplit over a mesh
            axis other variables are split over gets that axis on a dimension it divides,
            recorded in the plan (never for activations).
        **kwargs: What the front end passes on (Linen: ``method=`` and ``model.init``'s
            keywords; NNX: constructor keywords).

    Returns:
        The :class:`~flax_escale.ShardingPlan`: specs, shardings, corrections, ``describe()``.

    Raises:
        EscaleTypeError: If ``model`` is neither kind.
        ShardingResolutionError: With ``strict=True``, if anything could not apply.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax_escale as fe
        >>> model = nn.Dense(16, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
        >>> plan = fe.plan_sharding(model, mesh, jax.random.key(0), jnp.ones((2, 8)))
        >>> plan["params/kernel"].spec
        P(('fsdp', 'sp'), 'tp')
    """
    return pipeline.plan(
        _request(
            model,
            mesh,
            rng,
            args,
            kwargs,
            InitOptions.create(
                rules=rules, strict=strict, overrides=overrides, use_idle_axes=use_idle_axes
            ),
        )
    )[1]


def init_sharded(
    model: Any,
    mesh: Mesh,
    rng: Any,
    *args: Any,
    rules: RulesLike = None,
    strict: bool = False,
    overrides: Overrides | None = None,
    use_idle_axes: bool = USE_IDLE_AXES,
    **kwargs: Any,
) -> Any:
    """Creates a model's variables directly in their sharded layout.

    One ``jax.jit`` of the model's initializer with ``out_shardings`` from
    :func:`plan_sharding` (same arguments): no device ever holds a whole variable that its spec
    splits, and the values are those of the same initializer jitted on one device.

    Args:
        model: As for :func:`plan_sharding`.
        mesh: The mesh.
        rng: As for :func:`plan_sharding`.
        *args: As for :func:`plan_sharding`.
        rules: As for :func:`plan_sharding`.
        strict: As for :func:`plan_sharding`.
        overrides: As for :func:`plan_sharding`.
        use_idle_axes: As for :func:`plan_sharding`.
        **kwargs: As for :func:`plan_sharding`.

    Returns:
        For a Linen model, its variables (unboxed ``jax.Array``s with ``NamedSharding``s); for
        an NNX model, the module, whose variables' ``out_sharding`` metadata holds their specs.

    Raises:
        EscaleTypeError: If ``model`` is neither kind.
        MeshError: Under ``jax.distributed``, on every process, if the processes built
            different meshes.

    Example:
        >>> import jax
        >>> from flax import nnx
        >>> import flax_escale as fe
        >>> @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
        ... class Up(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.wi = nnx.Linear(8, 16, use_bias=False, rngs=rngs)
        >>> up = fe.init_sharded(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
        >>> up.wi.kernel.get_value().sharding.spec
        P(('fsdp', 'sp'), 'tp')
    """
    return pipeline.init(
        _request(
            model,
            mesh,
            rng,
            args,
            kwargs,
            InitOptions.create(
                rules=rules, strict=strict, overrides=overrides, use_idle_axes=use_idle_axes
            ),
        )
    )


def lower_init(
    model: Any,
    mesh: Mesh,
    rng: Any,
    *args: Any,
    rules: RulesLike = None,
    strict: bool = False,
    overrides: Overrides | None = None,
    use_idle_axes: bool = USE_IDLE_AXES,
    **kwargs: Any,
) -> jax.stages.Lowered:
    """The sharded initializer :func:`init_sharded` runs, lowered but neither compiled nor run.

    ``lower_init(...).compile().memory_analysis()`` gives the bytes each device needs,
    temporaries included, for shapes as large as real models without allocating anything.
    Arguments are :func:`plan_sharding`'s.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax_escale as fe
        >>> model = nn.Dense(64, use_bias=False, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> lowered = fe.lower_init(model, fe.create_mesh((1, 8, 1, 1, 1)), jax.random.key(0),
        ...                         jnp.ones((2, 64)))
        >>> lowered.compile().memory_analysis().output_size_in_bytes  # 64 * 64 * 4 B / 8
        2048
    """
    return pipeline.lower(
        _request(
            model,
            mesh,
            rng,
            args,
            kwargs,
            InitOptions.create(
                rules=rules, strict=strict, overrides=overrides, use_idle_axes=use_idle_axes
            ),
        )
    )[2]


def front_end(model: Any) -> pipeline.FrontEnd:
    """The front end of ``model``: Linen's for a module instance, NNX's for a constructor.

    Raises:
        EscaleTypeError: If ``model`` is neither (a Linen class is told to be instantiated).
    """
    if isinstance(model, nn.Module):
        return linen_init.FRONT_END
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise EscaleTypeError(
            f"model must be a flax.linen.Module instance, got the class {model.__name__}; "
            f"pass {model.__name__}(...) with its attributes."
        )
    if callable(model) and not isinstance(model, nnx.Module):
        return nnx_init.FRONT_END
    if isinstance(model, nnx.Module):
        raise EscaleTypeError(
            f"model is an NNX module already built (a {type(model).__name__}); the entry points "
            "build it themselves, born sharded: pass its class, or a function that builds it "
            f"from its rngs, such as lambda rngs: {type(model).__name__}(..., rngs=rngs)."
        )
    raise EscaleTypeError(
        "model must be a flax.linen.Module instance, or an NNX module class or a callable "
        f"taking rngs= that builds the module, got {check.describe(model)}."
    )


def _request(
    model: Any, mesh: Mesh, rng: Any, args: tuple, kwargs: dict, options: InitOptions
) -> pipeline.Request:
    # The one model-kind check of a call, then the mesh and the call checked into the request
    # its stage runs on.
    return pipeline.request(front_end(model), model, mesh, rng, args, kwargs, options)
