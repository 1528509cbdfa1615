"""t5x's partitioner: one object holding the mesh and the logical-axis rules.

It answers what a training loop asks (which specs a train state gets; through its data side,
which slice of the batch this process loads) and runs jitted functions under its mesh and
rules, so that activation constraints inside them act. t5x's own partitioner enters the legacy
``with mesh:`` context, under which current Flax silently drops logical constraints; this one
uses :func:`~flax_escale.use_sharding` (``jax.set_mesh`` and Flax's rules).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from flax_escale import _checks as check
from flax_escale._specs import mesh_axes_of
from flax_escale.axes import LogicalRules, PartitionAxis
from flax_escale.errors import EscaleError, EscaleTypeError, MeshError
from flax_escale.mesh import assert_same_mesh
from flax_escale.plan import USE_IDLE_AXES, ShardingPlan
from flax_escale.resolve import RulesLike, as_logical_rules
from flax_escale.sharding import use_sharding
from flax_escale.sharding._transfer import as_named_sharding, is_spec_leaf
from flax_escale.t5x._argnums import check_arity, jit_argnums
from flax_escale.t5x._axes import standard_logical_axis_rules
from flax_escale.t5x._data import DataPartitioning
from flax_escale.t5x._mesh import default_mesh
from flax_escale.t5x._state import StatePartitioning

__all__ = ["PartitionedFunction", "Partitioner"]

_T5X_AXES = ("data", "model")


class PartitionedFunction:
    """A jitted function that runs, lowers and traces under a mesh and logical-axis rules.

    Made by :meth:`Partitioner.partition`. Calling it (or :meth:`lower`) enters
    :func:`~flax_escale.use_sharding`, so that logical constraints inside the function resolve
    on the partitioner's mesh with its rules when it is traced.
    """

    def __init__(self, jitted: Any, mesh: Mesh, rules: LogicalRules) -> None:
        self.jitted = jitted
        self.mesh = mesh
        self.rules = rules
        try:
            self._signature: inspect.Signature | None = inspect.signature(jitted)
        except (TypeError, ValueError):  # no signature to read: the call says what is wrong
            self._signature = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the jitted function under the mesh and rules.

        Raises:
            EscaleTypeError: If the arguments do not fit the function's parameters, or some are
                given by keyword.
        """
        self._check_arguments(args, kwargs)
        with use_sharding(self.mesh, self.rules):
            return self.jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """``jax.jit(...).lower`` under the mesh and rules.

        Raises:
            EscaleTypeError: If the arguments do not fit the function's parameters, or some are
                given by keyword.
        """
        self._check_arguments(args, kwargs)
        with use_sharding(self.mesh, self.rules):
            return self.jitted.lower(*args, **kwargs)

    def _check_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = getattr(self.jitted, "__name__", "the function")
        if self._signature is not None:
            try:
                self._signature.bind(*args, **kwargs)
            except TypeError as error:
                raise EscaleTypeError(
                    f"PartitionedFunction: {name} cannot take {len(args)} positional and "
                    f"{len(kwargs)} keyword arguments ({error}); pass them as the function takes "
                    "them."
                ) from None
        if kwargs:
            # jax.jit refuses keywords whenever in_shardings is given, which partition() does.
            raise EscaleTypeError(
                f"PartitionedFunction: {name} was given the keyword arguments {sorted(kwargs)}; "
                "a partitioned function takes its arguments by position only (in_axis_resources "
                "gives them their specs in order), so pass them positionally."
            )


class Partitioner(DataPartitioning, StatePartitioning):
    """Partitions train states and functions over a mesh with logical-axis rules (t5x style).

    The arguments are t5x's ``PjitPartitioner``'s, in its order, plus ``mesh``. The mesh is
    ``mesh`` when given; otherwise it is built on first use by
    :func:`~flax_escale.t5x.default_mesh` from ``num_partitions``, ``model_parallel_submesh`` or
    ``ici_mesh_shape`` with ``dcn_mesh_shape`` (axes ``data, model``, with ``replica`` in front
    for a multi-slice mesh). The rules default to t5x's
    :func:`~flax_escale.t5x.standard_logical_axis_rules` on such a mesh (``batch`` split over
    ``replica`` and ``data`` on a multi-slice one), and to :class:`~flax_escale.PartitionAxis`'s
    on any other mesh. Rules must only name axes of the mesh. Logical axes resolve with the
    library's resolver, shape-aware where shapes are known. The data side (``data_*``,
    :meth:`get_data_layout`, :meth:`get_local_chunk_info`) and the state side
    (:meth:`get_logical_axes`, :meth:`get_mesh_axes`, :meth:`plan_sharding`,
    :meth:`move_params_to_devices`) come from its two base classes.

    Args:
        num_partitions: Devices per model replica (the ``model`` axis size).
        model_parallel_submesh: The ``(x, y, z, core)`` TPU tile of one model replica.
        params_on_devices: t5x's flag for keeping parameters in device memory, kept as
            ``params_on_devices`` for t5x's trainer, which reads it to decide whether to
            call :meth:`move_params_to_devices`; the partitioner itself places what it is given.
        backend: The platform whose devices make the default mesh.
        ici_mesh_shape: Per-slice ``(replica, data, model)`` shape of a multi-slice mesh.
        dcn_mesh_shape: Between-slices shape of a multi-slice mesh.
        logical_axis_rules: The rules, or a ``PartitionAxis``; see above for the default.
        mesh: A mesh to use instead of building one (any axes, e.g. from ``create_mesh``).
        use_idle_axes: Put mesh axes the rules leave idle to use on parameters and optimizer
            state of at least 1 MiB, as :func:`flax_escale.init_sharded` does (``False``: the
            rules' specs exactly, as t5x gives them).

    Raises:
        MeshError: If no way to build a mesh is given, or ``mesh`` comes with mesh-building
            arguments, or ``model_parallel_submesh`` is not four sizes.
        EscaleTypeError: If ``num_partitions`` is not an int, ``model_parallel_submesh`` not a
            sequence of sizes, ``mesh`` not a mesh, or ``logical_axis_rules`` not rules.

    Example:
        >>> from flax_escale import create_mesh
        >>> from flax_escale.t5x import Partitioner
        >>> partitioner = Partitioner(mesh=create_mesh((2, 4, 1, 1, 1)))
        >>> partitioner.data_partition_spec, partitioner.data_mesh_size
        (P(('fsdp', 'dp'),), 8)
        >>> t5x = Partitioner(num_partitions=2)  # the CPU default: one row per process
        >>> dict(t5x.mesh.shape), t5x.data_partition_spec
        ({'data': 1, 'model': 8}, P('data',))
    """

    def __init__(
        self,
        num_partitions: int | None = None,
        model_parallel_submesh: Sequence[int] | None = None,
        params_on_devices: bool = True,
        backend: str | None = None,
        ici_mesh_shape: Sequence[int] | None = None,
        dcn_mesh_shape: Sequence[int] | None = None,
        logical_axis_rules: RulesLike | PartitionAxis = None,
        *,
        mesh: Mesh | None = None,
        use_idle_axes: bool = USE_IDLE_AXES,
    ) -> None:
        if num_partitions is not None:
            num_partitions = check.positive_int(num_partitions, "num_partitions")
        if model_parallel_submesh is not None:
            model_parallel_submesh = check.sizes(model_parallel_submesh, "model_parallel_submesh")
        check.optional_mesh(mesh, "mesh")
        builders = {
            "num_partitions": num_partitions,
            "model_parallel_submesh": model_parallel_submesh,
            "ici_mesh_shape": ici_mesh_shape,
            "dcn_mesh_shape": dcn_mesh_shape,
        }
        given = [name for name, value in builders.items() if value is not None]
        multi_slice = ici_mesh_shape is not None and dcn_mesh_shape is not None
        if mesh is not None and given:
            raise MeshError(
                f"Partitioner: mesh= was given together with {', '.join(given)}; pass either a "
                "mesh or the arguments to build one."
            )
        if mesh is None and not (num_partitions or model_parallel_submesh or multi_slice):
            raise MeshError(
                "Partitioner: give mesh=, num_partitions, model_parallel_submesh, or both "
                "ici_mesh_shape and dcn_mesh_shape, so that a mesh can be built."
            )
        if model_parallel_submesh is not None and len(tuple(model_parallel_submesh)) != 4:
            raise MeshError(
                f"Partitioner: model_parallel_submesh {tuple(model_parallel_submesh)} must be "
                "four sizes (x, y, z, core), e.g. (2, 2, 1, 2)."
            )
        self.params_on_devices = params_on_devices
        self.use_idle_axes = check.flag(use_idle_axes, "use_idle_axes")
        self._mesh = mesh
        self._builders = builders
        self._backend = backend
        self._multi_slice = multi_slice
        self._given_rules = _checked_rules(logical_axis_rules)

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The mesh; built on first use when none was given, and checked against the rules.

        On several processes, every process must arrive at the same mesh: a process whose
        mesh differs makes this raise :class:`~flax_escale.MeshError` on all of them.
        """
        mesh = self._mesh
        if mesh is None:
            mesh = default_mesh(backend=self._backend, **self._builders)
        assert_same_mesh(mesh)
        _check_rules_fit(self._rules_for(mesh), mesh)
        return mesh

    @functools.cached_property
    def logical_axis_rules(self) -> LogicalRules:
        """The logical-axis rules, as ``(name, mesh axes)`` pairs in priority order."""
        return self._rules_for(self.mesh)

    def _rules_for(self, mesh: Mesh) -> LogicalRules:
        if self._given_rules is not None:
            return as_logical_rules(self._given_rules)
        if not set(_T5X_AXES) <= set(mesh.axis_names):
            return as_logical_rules(PartitionAxis())
        rules = standard_logical_axis_rules()
        if self._multi_slice:
            rules = [(n, ("replica", "data") if n == "batch" else a) for n, a in rules]
        return as_logical_rules(rules)

    # The state side, with its argument checked first: a string or None would otherwise give
    # None back (or an error from inside JAX). The documentation is the base class's.

    def get_logical_axes(self, train_state: Any) -> Any:
        return super().get_logical_axes(check.tree_of_arrays(train_state, "train_state"))

    def get_mesh_axes(self, train_state: Any, *, strict: bool = False) -> Any:
        tree = check.tree_of_arrays(train_state, "train_state")
        return super().get_mesh_axes(tree, strict=check.flag(strict, "strict"))

    def plan_sharding(self, train_state: Any, *, strict: bool = False) -> ShardingPlan:
        tree = check.tree_of_arrays(train_state, "train_state")
        return super().plan_sharding(tree, strict=check.flag(strict, "strict"))

    def move_params_to_devices(self, train_state: Any, train_state_axes: Any) -> Any:
        tree = check.tree_of_arrays(train_state, "train_state")
        return super().move_params_to_devices(tree, train_state_axes)

    get_logical_axes.__doc__ = StatePartitioning.get_logical_axes.__doc__
    get_mesh_axes.__doc__ = StatePartitioning.get_mesh_axes.__doc__
    plan_sharding.__doc__ = StatePartitioning.plan_sharding.__doc__
    move_params_to_devices.__doc__ = StatePartitioning.move_params_to_devices.__doc__

    # Functions.

    def partition(
        self,
        fn: Callable[..., Any],
        in_axis_resources: Any,
        out_axis_resources: Any,
        static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (),
    ) -> PartitionedFunction:
        """``jax.jit(fn)`` with the given input and output specs, run under the mesh and rules.

        Args:
            fn: The function.
            in_axis_resources: One spec per (non-static) positional argument, or a prefix of
                them: ``PartitionSpec`` or ``NamedSharding`` leaves, ``None`` for replicated.
            out_axis_resources: The same for the outputs.
            static_argnums: Positional arguments that are compile-time constants: an index or
                a sequence of them (negative ones count from the end). They get no entry in
                ``in_axis_resources``.
            donate_argnums: Positional arguments whose buffers the function may reuse, indexed
                like ``static_argnums`` (among all positional arguments).

        Returns:
            A :class:`PartitionedFunction`, which takes its arguments by position only.

        Raises:
            EscaleTypeError: If ``fn`` is not a function, ``static_argnums`` or
                ``donate_argnums`` is not an int or a sequence of ints, or ``in_axis_resources``
                is a tuple whose length does not fit ``fn``'s positional parameters less the
                static ones.
            EscaleError: If an index in ``static_argnums`` or ``donate_argnums`` is past
                ``fn``'s positional parameters, or one argument is both static and donated.

        Example:
            >>> import jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec
            >>> from flax_escale import create_mesh
            >>> from flax_escale.t5x import Partitioner
            >>> partitioner = Partitioner(mesh=create_mesh((1, 8, 1, 1, 1)))
            >>> double = partitioner.partition(lambda x: 2 * x, None, PartitionSpec("fsdp"))
            >>> double(jnp.arange(8.0)).sharding.spec
            P('fsdp',)
        """
        check.callable_(fn, "fn", "pass the step function itself, e.g. partition(train_step, ...).")
        static, donate = jit_argnums(fn, static_argnums, donate_argnums)
        in_shardings = self._shardings(in_axis_resources)
        out_shardings = self._shardings(out_axis_resources)
        check_arity(fn, in_axis_resources, static)
        jitted = jax.jit(
            fn,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            static_argnums=static,
            donate_argnums=donate,
        )
        return PartitionedFunction(jitted, self.mesh, self.logical_axis_rules)

    def compile(self, partitioned_fn: PartitionedFunction, *args: Any) -> jax.stages.Compiled:
        """Lowers and compiles ``partitioned_fn`` for arguments like ``args`` (or their shapes).

        Example:
            >>> import jax
            >>> import jax.numpy as jnp
            >>> from flax_escale import create_mesh
            >>> from flax_escale.t5x import Partitioner
            >>> partitioner = Partitioner(mesh=create_mesh((1, 8, 1, 1, 1)))
            >>> total = partitioner.partition(jnp.sum, None, None)
            >>> compiled = partitioner.compile(total, jax.ShapeDtypeStruct((8,), jnp.float32))
            >>> compiled.input_shardings[0][0].is_fully_replicated, float(compiled(jnp.ones(8)))
            (True, 8.0)
        """
        return partitioned_fn.lower(*args).compile()

    def _shardings(self, resources: Any) -> Any:
        return jax.tree.map(
            lambda r: as_named_sharding(r, self.mesh), resources, is_leaf=is_spec_leaf
        )


def _checked_rules(rules: Any) -> LogicalRules | None:
    # Refused here rather than on first use of the mesh, naming the argument.
    if rules is None:
        return None
    try:
        return as_logical_rules(rules)
    except EscaleError as error:
        raise type(error)(f"Partitioner: logical_axis_rules: {error}") from None


def _check_rules_fit(rules: LogicalRules, mesh: Mesh) -> None:
    absent = sorted({a for _, target in rules for a in mesh_axes_of(target)} - set(mesh.axis_names))
    if absent:
        raise MeshError(
            f"Partitioner: the logical_axis_rules name mesh axes {absent} that the mesh "
            f"{dict(mesh.shape)} lacks. Pass logical_axis_rules written for this mesh (a "
            "PartitionAxis whose fields name only its axes, say), or build the mesh with those "
            "axes (of size 1 where unused)."
        )
