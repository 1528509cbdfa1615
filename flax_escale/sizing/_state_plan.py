"""The plan of everything a workload's training step holds: parameters and optimizer state."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from flax_escale.plan import ShardingPlan, annotated_leaves, build_plan
from flax_escale.sizing._programs import step_state
from flax_escale.sizing._workload import Workload

__all__ = ["train_state_plan"]


def train_state_plan(workload: Workload, mesh: Mesh) -> ShardingPlan:
    """The workload's train state on ``mesh``, planned: nothing is allocated or compiled.

    The parameters are the workload's own plan (annotations, rules replayed, corrections);
    the optimizer state and step counter follow, each with the sharding the training step
    that :func:`~flax_escale.sizing.plan_mesh` compiles gives it (``shard_over`` included),
    under paths ``opt_state/...`` and ``step``.

    Args:
        workload: The workload.
        mesh: The mesh.

    Returns:
        One plan of parameters, then optimizer state.

    Raises:
        EscaleError: As :func:`~flax_escale.sizing.plan_mesh` raises for the workload (a
            Linen model with collections besides ``params``, say).

    Example:
        >>> import jax, optax
        >>> import flax.linen as nn
        >>> import flax_escale as fe
        >>> from flax_escale.sizing import Workload
        >>> from flax_escale.sizing._state_plan import train_state_plan
        >>> dense = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> work = Workload(dense, 0, (jax.ShapeDtypeStruct((2, 8), "float32"),),
        ...                 tx=optax.adam(1e-3))
        >>> plan = train_state_plan(work, fe.create_mesh((1, 4, 1, 2, 1)))
        >>> [(e.path, e.spec) for e in plan][1:4]  # doctest: +NORMALIZE_WHITESPACE
        [('params/kernel', P(('fsdp', 'sp'), 'tp')), ('opt_state/0/count', P()),
         ('opt_state/0/mu/bias', P(None,))]
    """
    params = workload.plan(mesh)
    # The state the step is lowered with: its optimizer-state shardings are the ones to show.
    state, _ = step_state(workload, mesh, params)
    if workload.is_linen:
        held = {"opt_state": state.opt_state, "step": state.step}
    else:
        held = nnx.to_pure_dict(state[1])  # the optimizer's: opt_state and step
    # Plain arrays carrying their shardings: each leaf is planned as the step holds it (no
    # idle axis added), not resolved again from the names NNX copies onto it.
    treedef, items = annotated_leaves(held, own_sharding=True)
    rest = build_plan(treedef, items, mesh, use_idle_axes=False)
    both = (params.treedef.unflatten([0] * len(params)), rest.treedef.unflatten([0] * len(rest)))
    return ShardingPlan(
        mesh,
        params.entries + rest.entries,
        jax.tree.structure(both),
        notes=params.notes,
        rules=params.rules,
    )
