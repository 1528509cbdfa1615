"""The state side of a partitioner: a train state's logical axes, specs and placement.

Every leaf's annotation is read by the library's one reader (Flax boxes, NNX metadata,
optimizer state following its parameter) and resolved by its one resolver, shape-aware, into
the same plan the front ends initialize with.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from flax_escale import _checks as check
from flax_escale._frontend._options import InitOptions
from flax_escale._frontend._pipeline import plan_variables
from flax_escale.axes import LogicalRules
from flax_escale.plan import (
    USE_IDLE_AXES,
    AnnotatedLeaf,
    Annotation,
    ShardingPlan,
    annotated_leaves,
    arrays_only,
)
from flax_escale.sharding import make_shard_and_gather_fns
from flax_escale.t5x._axes import AxisNames

__all__ = ["StatePartitioning"]


class StatePartitioning:
    """Train states' layout on a mesh under logical-axis rules (the state half of a partitioner).

    A base class: the class built on it provides ``mesh`` and ``logical_axis_rules``, and may
    set ``use_idle_axes`` (see :func:`flax_escale.plan_sharding`).
    """

    mesh: Mesh
    logical_axis_rules: LogicalRules
    use_idle_axes: bool = USE_IDLE_AXES

    def get_logical_axes(self, train_state: Any) -> Any:
        """The logical axes of every leaf of a train state, as ``AxisNames`` (``None`` if none).

        Parameters carry their names in Flax's boxes (``nn.LogicallyPartitioned``, as
        ``sharded_module`` and ``nn.with_logical_partitioning`` make them), in a ``params_axes``
        collection kept in the state (t5x's ``param_with_axes``) or in NNX variable metadata
        (``logical_axes``, ``out_sharding``). Optimizer state inherits them: leaves of the
        parameter's shape keep them all, and leaves with a dimension less (Adafactor's factored
        statistics) get the names without it. Other leaves are ``None``. An
        ``AxisNames`` compares equal to the ``PartitionSpec`` of the same names, which is what
        t5x's (Flax's) logical axes are.

        Args:
            train_state: A Flax ``TrainState`` (or ``jax.eval_shape`` of one), NNX state or
                module, or any tree of those.

        Returns:
            A tree shaped like ``train_state`` (boxes replaced) with an ``AxisNames`` or
            ``None`` per leaf.

        Example:
            >>> import flax.linen as nn
            >>> import jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec
            >>> from flax_escale import create_mesh
            >>> from flax_escale.t5x import Partitioner
            >>> partitioner = Partitioner(mesh=create_mesh((1, 4, 1, 2, 1)))
            >>> names = ("hidden_state", "mlp_intermediate")
            >>> kernel = nn.LogicallyPartitioned(jnp.zeros((8, 16)), names)
            >>> axes = partitioner.get_logical_axes({"kernel": kernel, "step": 0})
            >>> axes
            {'kernel': AxisNames('hidden_state', 'mlp_intermediate'), 'step': None}
            >>> axes["kernel"] == PartitionSpec(*names)
            True
        """
        treedef, items = annotated_leaves(train_state)
        return treedef.unflatten(
            [
                None if a is None or a.logical_axes is None else AxisNames(*a.logical_axes)
                for _, _, a in items
            ]
        )

    def plan_sharding(self, train_state: Any, *, strict: bool = False) -> ShardingPlan:
        """The :class:`~flax_escale.ShardingPlan` of the arrays of a train state on the mesh.

        Resolves :meth:`get_logical_axes` (and mesh-axis annotations) with the rules,
        shape-aware: every spec divides its array, and every correction is listed.

        Args:
            train_state: As for :meth:`get_logical_axes`.
            strict: Raise on any correction or logical name without a rule.
        """
        return self._plan(*annotated_leaves(train_state), strict=strict)

    def get_mesh_axes(self, train_state: Any, *, strict: bool = False) -> Any:
        """The ``PartitionSpec`` of every array of a train state, ``None`` where it has no axes.

        As in t5x, a leaf without axis names (``None`` in :meth:`get_logical_axes`: the step,
        an optimizer's counts, Adafactor's ``(1,)`` placeholders, any leaf that is not an
        array) gets ``None``, and a leaf with names gets the ``PartitionSpec`` they resolve to,
        ``P(None, None)`` if they all stay unsharded. The exceptions are this library's: a leaf
        annotated in mesh axes keeps its spec, and so does a leaf without names that the plan
        still shards (over idle mesh axes, see ``use_idle_axes``).

        The result is what :meth:`partition` takes as axis resources for the state: there, as
        in :meth:`move_params_to_devices`, ``None`` is replicated.

        Example:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> from flax import linen as nn
            >>> from flax_escale import create_mesh
            >>> from flax_escale.t5x import Partitioner
            >>> boxed = nn.LogicallyPartitioned
            >>> state = {"kernel": boxed(jnp.zeros((8, 16)), ("hidden_state", "mlp_intermediate")),
            ...          "stack": boxed(jnp.zeros((3,)), ("layers",)),  # names, all unsharded
            ...          "step": jax.ShapeDtypeStruct((), jnp.int32)}  # no names
            >>> Partitioner(mesh=create_mesh((1, 4, 1, 2, 1))).get_mesh_axes(state)
            {'kernel': P(('fsdp', 'sp'), 'tp'), 'stack': P(None,), 'step': None}
        """
        treedef, items = annotated_leaves(train_state)
        specs = iter(self._plan(treedef, items, strict=strict).entries)
        return treedef.unflatten(
            [
                _mesh_axes(next(specs).spec, annotation) if hasattr(value, "shape") else None
                for _, value, annotation in items
            ]
        )

    def move_params_to_devices(self, train_state: Any, train_state_axes: Any) -> Any:
        """Places a (host) train state on the mesh with the given specs, shard by shard.

        Each device receives only its own block; on several processes every process passes
        the same whole values.

        Args:
            train_state: The state, as host or device arrays.
            train_state_axes: Its specs, as :meth:`get_mesh_axes` gives them.

        Returns:
            The state, every array a ``jax.Array`` in its sharding.
        """
        check.structure_like(
            train_state_axes,
            train_state,
            "move_params_to_devices: train_state_axes",
            "train_state",
            is_leaf=lambda x: x is None,
        )
        shard_fns, _ = make_shard_and_gather_fns(train_state_axes, self.mesh)
        return jax.tree.map(lambda fn, x: jax.tree.map(fn, x), shard_fns, train_state)

    def _plan(self, treedef: Any, items: list[AnnotatedLeaf], *, strict: bool) -> ShardingPlan:
        structure, arrays = arrays_only(treedef, items)
        options = InitOptions(
            self.logical_axis_rules, strict=strict, use_idle_axes=self.use_idle_axes
        )
        return plan_variables(structure, arrays, self.mesh, options)


def _mesh_axes(spec: PartitionSpec, annotation: Annotation | None) -> PartitionSpec | None:
    """t5x's entry for an array: ``None`` when it has no axes and the plan leaves it whole."""
    named = annotation is not None and (
        annotation.logical_axes is not None or annotation.mesh_axes is not None
    )
    if named or any(entry is not None for entry in spec):
        return spec
    return None
