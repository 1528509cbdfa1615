"""An NNX layer stack run as a pipeline over the stage mesh axis."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleTypeError
from flax_escale.pipeline import Remat, pipeline
from flax_escale.resolve import RulesLike

__all__ = ["pipeline_stack"]


def pipeline_stack(
    stack: nnx.Module,
    x: jax.Array,
    *,
    microbatches: int,
    repeats: int = 1,
    remat: Remat = None,
    axis: str = "pp",
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
) -> jax.Array:
    """Runs a stacked NNX module (``stack_layers``, ``nnx.vmap``) as a pipeline over ``axis``.

    The same result as running the layers one after the other (``nnx.scan`` over the stack),
    computed by :func:`flax_escale.pipeline.pipeline`: each stage of the ``axis`` mesh axis
    runs its own layers on one microbatch at a time. Call it in the model's ``__call__``
    where it would scan the stack; gradients reach the stack's parameters as through a scan.
    The layers are called with the activations only, and their variables are read, not
    updated (a layer that updates a variable, such as batch statistics, cannot be pipelined).

    Args:
        stack: The stacked layers: every variable has the layer count as its leading
            dimension.
        x: The activations, batch first.
        microbatches: How many microbatches the batch is cut into (a multiple of the stages).
        repeats: How many times each stage runs on each microbatch (``1``: GPipe; more: the
            circular schedule).
        remat: What each stage recomputes in the backward pass
            (:data:`flax_escale.pipeline.Remat`).
        axis: The stage mesh axis.
        mesh: The mesh; defaults to the current mesh.
        rules: The rules whose stage form applies inside the stages.

    Returns:
        The activations after the stack, shaped like ``x``.

    Raises:
        EscaleTypeError: If ``stack`` is not an ``nnx.Module``.
        PipelineError: As :func:`flax_escale.pipeline.pipeline` does.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from flax_escale import create_mesh
        >>> from flax_escale.nnx import pipeline_stack, stack_layers
        >>> mesh = create_mesh((2, 4), ("pp", "fsdp"))
        >>> stack = stack_layers(lambda rngs: nnx.Linear(8, 8, rngs=rngs), 4, nnx.Rngs(0))
        >>> x = jnp.ones((8, 8))
        >>> with jax.set_mesh(mesh):
        ...     y = nnx.jit(lambda s, x: pipeline_stack(s, x, microbatches=2))(stack, x)
        >>> @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        ... def scanned(h, layer):
        ...     return layer(h)
        >>> bool(jnp.allclose(y, scanned(x, stack), atol=1e-6))
        True
    """
    if not isinstance(stack, nnx.Module):
        raise EscaleTypeError(
            f"stack must be a stacked nnx.Module (stack_layers, nnx.vmap), got "
            f"{check.describe(stack)}; a pytree of stacked arrays runs with "
            "flax_escale.pipeline.pipeline(layer, params, x, ...)."
        )
    graphdef, state = nnx.split(stack)

    def layer(params: Any, h: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params)(h)

    return pipeline(
        layer,
        state,
        x,
        microbatches=microbatches,
        repeats=repeats,
        remat=remat,
        axis=axis,
        mesh=mesh,
        rules=rules,
    )
