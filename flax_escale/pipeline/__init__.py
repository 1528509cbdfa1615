"""Pipeline parallelism: a stack of identical layers run as stages over a ``pp`` mesh axis.

:func:`pipeline` runs any layer function over a stacked pytree of parameters (GPipe, or the
circular schedule with ``repeats``) inside one ``jax.jit``; :class:`Schedule` holds the
figures a schedule fixes (iterations, bubble, activations in flight). The NNX and Linen front
ends wrap it for their stacks (:func:`flax_escale.nnx.pipeline_stack`,
:func:`flax_escale.linen.pipelined`).
"""

from flax_escale.pipeline._run import REMAT_POLICIES, Remat, pipeline, stage_rules
from flax_escale.pipeline._schedule import PipelineError, Schedule

__all__ = ["REMAT_POLICIES", "PipelineError", "Remat", "Schedule", "pipeline", "stage_rules"]
