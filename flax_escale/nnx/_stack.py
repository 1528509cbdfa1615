"""Layer stacks built one layer at a time, for an init whose peak stays near its outputs.

The usual NNX stack, ``nnx.vmap`` over split keys, draws every layer's random numbers at once.
An accelerator fuses them into the initializers' arithmetic; XLA's CPU backend materializes
them, so a sharded init compiled for CPU holds every layer's random bits at once in
temporaries. Made by ``nnx.scan`` instead, one layer is drawn at a time, with the same keys and
so the same values (the documentation's benchmark B1 measures both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import flax.linen as nn
from flax import nnx

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError
from flax_escale.nnx._annotate import stacked
from flax_escale.nnx._signature import binding_error, shown

__all__ = ["stack_layers"]

M = TypeVar("M", bound=nnx.Module)


def stack_layers(
    make: Callable[[nnx.Rngs], M], count: int, rngs: nnx.Rngs, *, name: str = "layers"
) -> M:
    """``count`` layers made by ``make``, stacked along a leading ``name`` axis, one at a time.

    The same module, with the same values, as ``nnx.split_rngs(splits=count)`` and
    ``nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=stacked(name))`` applied to
    ``make``; built by ``nnx.scan``, so that an initializer compiled for CPU draws one layer's
    random numbers at a time (benchmark B1 measures the peak). Run it with
    ``nnx.scan(..., transform_metadata=stacked(name))`` as a vmapped stack.

    Args:
        make: Builds one layer from its ``nnx.Rngs``.
        count: The number of layers.
        rngs: The streams the layers' keys are split from (as ``nnx.split_rngs`` does).
        name: The stacked axis's logical name (unsharded by the default rules).

    Returns:
        The stacked module.

    Raises:
        EscaleTypeError: If ``make`` is not callable (or is a module already built, NNX or
            Linen), does not take one argument or does not return an ``nnx.Module``,
            ``count`` is not a positive int or ``rngs`` not an ``nnx.Rngs``.

    Example:
        >>> from flax import nnx
        >>> from flax_escale.nnx import stack_layers, stacked
        >>> def make(rngs):
        ...     return nnx.Linear(8, 8, rngs=rngs)
        >>> blocks = stack_layers(make, 4, nnx.Rngs(0))
        >>> @nnx.split_rngs(splits=4)
        ... @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=stacked())
        ... def vmapped(rngs):
        ...     return make(rngs)
        >>> kernel, same = blocks.kernel.get_value(), vmapped(nnx.Rngs(0)).kernel.get_value()
        >>> kernel.shape, bool((kernel == same).all())
        ((4, 8, 8), True)
    """
    _check_make(make)
    count = check.positive_int(count, "count")
    if not isinstance(rngs, nnx.Rngs):
        raise EscaleTypeError(
            f"rngs must be an nnx.Rngs, got {check.describe(rngs)}; pass e.g. nnx.Rngs(0)."
        )
    # A module class is read by its __init__: Flax's metaclass shows (*args, **kwargs).
    if binding_error(make, (rngs,), {}) is not None:
        raise EscaleTypeError(
            f"make must take one argument, the layer's nnx.Rngs, got {shown(make)}; pass e.g. "
            "lambda rngs: Block(config, rngs=rngs)."
        )

    @nnx.split_rngs(splits=count)
    @nnx.scan(in_axes=(0,), out_axes=0, transform_metadata=stacked(name), length=count)
    def build(rngs: nnx.Rngs) -> M:
        layer = make(rngs)
        if not isinstance(layer, nnx.Module):
            raise EscaleTypeError(
                f"make must return one layer, an nnx.Module, got {check.describe(layer)}; "
                "pass e.g. lambda rngs: Block(config, rngs=rngs)."
            )
        return layer

    return build(rngs)


def _check_make(make: object) -> None:
    # A built module is often callable itself (its __call__ takes one input), so the checks
    # below would pass it and Flax or JAX would fail on the rngs it is called with.
    if isinstance(make, nnx.Module):
        name = type(make).__name__
        raise EscaleTypeError(
            f"make must build one layer from its rngs, got an instance of {name}, a layer "
            "already built; stack_layers builds every layer itself: "
            f"pass its class, {name}, if it takes only rngs, or e.g. lambda rngs: "
            f"{name}(..., rngs=rngs)."
        )
    if isinstance(make, nn.Module) or (isinstance(make, type) and issubclass(make, nn.Module)):
        shown_as = make.__name__ if isinstance(make, type) else type(make).__name__
        raise EscaleTypeError(
            f"make must build an NNX layer from its rngs, got the flax.linen module {shown_as}; "
            "stack NNX modules (or wrap the Linen one with flax.nnx.bridge.ToNNX inside "
            "make), or stack Linen layers with flax.linen.scan."
        )
    check.callable_(make, "make", "pass a function that builds one layer from its rngs")
