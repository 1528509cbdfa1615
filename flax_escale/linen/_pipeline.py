"""A Linen layer stack (``nn.scan``) run as a pipeline over the stage mesh axis."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError
from flax_escale.pipeline import PipelineError, Remat, pipeline

__all__ = ["pipelined"]


def pipelined(
    block: type[nn.Module],
    length: int,
    *,
    microbatches: int,
    repeats: int = 1,
    remat: Remat = None,
    axis: str = "pp",
    name: str = "layers",
) -> type[nn.Module]:
    """``block`` stacked ``length`` times like ``nn.scan``, applied as a pipeline over ``axis``.

    The returned class is what ``nn.scan(block, variable_axes={"params": 0},
    split_rngs={"params": True}, length=length, metadata_params={nn.PARTITION_NAME: name})``
    returns, with the same constructor, the same parameters (same tree, same values, the
    stacked dimension named ``name``) and the same result; applied, it runs the stack with
    :func:`flax_escale.pipeline.pipeline` instead of a scan, each stage of the ``axis`` mesh
    axis running its own layers on one microbatch at a time. Initializing it runs the scan,
    so a pipelined model's parameters are a scanned model's.

    ``block`` is called as an ``nn.scan`` body: ``block(...)(x, *args)`` returns
    ``(x, y)``; the pipeline carries ``x`` only, so ``y`` must be ``None`` (per-layer outputs,
    such as a mixture of experts' auxiliary loss, are not pipelined).

    Args:
        block: The layer's Linen module class.
        length: The number of layers.
        microbatches: How many microbatches the batch is cut into (a multiple of the stages).
        repeats: How many times each stage runs on each microbatch (``1``: GPipe; more: the
            circular schedule).
        remat: What each stage recomputes in the backward pass
            (:data:`flax_escale.pipeline.Remat`).
        axis: The stage mesh axis.
        name: The stacked dimension's logical name.

    Returns:
        The stacked module class; its instances return ``(x, None)`` like the scanned one.

    Raises:
        EscaleTypeError: If ``block`` is not a Linen module class.
        PipelineError: When applied: as :func:`flax_escale.pipeline.pipeline` does, and if a
            layer returns a per-layer output other than ``None``.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.linen import pipelined
        >>> class Block(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x, _):
        ...         return jnp.tanh(nn.Dense(8)(x)), None
        >>> stack = pipelined(Block, 4, microbatches=2)(name="blocks")
        >>> x = jnp.ones((8, 8))
        >>> variables = stack.init(jax.random.key(0), x, None)
        >>> mesh = create_mesh((2, 4), ("pp", "fsdp"))
        >>> with jax.set_mesh(mesh):
        ...     y, _ = jax.jit(stack.apply)(variables, x, None)
        >>> scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
        ...                   length=4)(name="blocks")
        >>> bool(jnp.allclose(y, scanned.apply(variables, x, None)[0], atol=1e-6))
        True
    """
    if not (isinstance(block, type) and issubclass(block, nn.Module)):
        raise EscaleTypeError(
            f"block must be a flax.linen Module class, got {check.describe(block)}; pass the "
            "class (Block), not an instance."
        )
    length = check.positive_int(length, "length")
    scanned = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=length,
        metadata_params={nn.PARTITION_NAME: name},
    )
    fields = [f.name for f in dataclasses.fields(block) if f.init and f.name not in _SCOPE]

    class Pipelined(scanned):  # type: ignore[misc, valid-type]
        def __call__(self, x: jax.Array, *args: Any) -> tuple[jax.Array, None]:
            if self.is_initializing():
                return super().__call__(x, *args)
            one = block(**{f: getattr(self, f) for f in fields}, parent=None)

            def layer(params: Any, h: jax.Array) -> jax.Array:
                out, extra = one.apply({"params": params}, h, *args)
                if extra is not None:
                    raise PipelineError(
                        f"{block.__name__} returns a per-layer output besides the activations "
                        f"({check.describe(extra)}); a pipeline carries the activations only: "
                        "return (x, None), or run this stack with nn.scan."
                    )
                return out

            params = nn.meta.unbox(self.variables["params"])
            y = pipeline(
                layer,
                params,
                x,
                microbatches=microbatches,
                repeats=repeats,
                remat=remat,
                axis=axis,
            )
            return y, None

    Pipelined.__name__ = Pipelined.__qualname__ = f"Pipelined{block.__name__}"
    return Pipelined


_SCOPE = ("parent", "name")
