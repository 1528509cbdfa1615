"""``jax.shard_map`` with its specs given as logical names, resolved by the one resolver."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import RulesLike, as_logical_rules
from flax_escale.sharding._constraint import apply_spec
from flax_escale.sharding._map_axes import MapAxes, arrays_of

__all__ = ["logical_shard_map"]


def logical_shard_map(
    f: Callable[..., Any],
    *,
    in_axes: Sequence[Any],
    out_axes: Any,
    mesh: Mesh | AbstractMesh | None = None,
    rules: RulesLike = None,
    strict: bool = False,
    check_vma: bool = True,
) -> Callable[..., Any]:
    """``jax.shard_map`` whose ``in_specs`` and ``out_specs`` are logical names.

    The names resolve as parameters' and activations' do (shape-aware for the inputs, whose
    shapes are known at the call), so a body written once runs on any mesh the rules map its
    names onto: ``("batch", "sequence", None)`` is split over ``(fsdp, dp)`` and ``sp`` on one
    mesh and over ``(fsdp, dp, ep)`` on another. Each input is first constrained to its spec
    (a ``jax.sharding.reshard`` on Explicit mesh axes, which ``jax.shard_map`` would otherwise
    refuse), so the layout change is a visible step of the program.

    A logical name names one dimension throughout: an output's dimension named like an
    input's is split as the first input naming it was (so the blocks the body returns make
    up the input's shape again). Where that input's dimension was corrected (6 rows do not
    split over ``fsdp=4``), the output's is corrected alike, with its own warning (or, with
    ``strict``, error) naming ``out_axes``.

    Args:
        f: The per-device body, as for ``jax.shard_map``.
        in_axes: One entry per positional argument: a tuple of logical names (or ``None``) per
            dimension, or a pytree (dict, list) whose leaves are such tuples. A
            ``PartitionSpec`` leaf is taken as it is (for a layout the body computes itself).
        out_axes: The same for the outputs: one tuple of names (for every output), or a pytree
            of them shaped like the outputs.
        mesh: The mesh; defaults to the current mesh.
        rules: The rules; defaults to Flax's rules context, then to ``PartitionAxis()``.
        strict: Raise instead of correcting (a name whose mesh axes do not divide its
            dimension, a name without a rule); otherwise corrections warn.
        check_vma: Passed to ``jax.shard_map``.

    Returns:
        A function of the same arguments as ``f``, running ``f`` on each device's blocks.

    Raises:
        NoMeshError: At the call, if there is no mesh.
        EscaleError: At the call, naming the ``in_axes`` or ``out_axes`` entry: if ``in_axes``
            has not one entry per argument; if an entry's structure differs from its
            argument's or the outputs'; if an entry is longer than its array's rank; if a
            ``PartitionSpec`` names an axis the mesh lacks or twice, or does not divide its
            input; if an output left unsplit over a mesh axis varies over it.
        EscaleTypeError: If ``f`` is not callable, ``in_axes`` is not a sequence, an entry is
            not a tuple of names, a flag is not a bool, or an argument is not an array; at
            the call, if ``mesh`` is an ``AbstractMesh`` and no mesh of its shape is set.
        ShardingResolutionError: At the call, if an entry names one logical name twice or more
            dimensions than its input has; with ``strict``, if a name's axes do not fit its
            dimension or a name has no rule.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import create_mesh
        >>> from flax_escale.sharding import logical_shard_map
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> def local_sum(x):  # the sum of each device's rows, kept per block
        ...     return x.sum(axis=0, keepdims=True)
        >>> f = logical_shard_map(local_sum, in_axes=[("batch", "hidden_state")],
        ...                       out_axes=("batch", "hidden_state"), mesh=mesh)
        >>> jax.jit(f)(jnp.ones((8, 6))).shape  # one row per fsdp device, tp keeps the columns
        (4, 6)
    """
    if isinstance(in_axes, str) or not isinstance(in_axes, Sequence):
        raise EscaleTypeError(
            f"in_axes must be a sequence with one entry per argument, got "
            f"{check.describe(in_axes)}; e.g. in_axes=[('batch', 'hidden_state')]."
        )
    in_axes = tuple(in_axes)
    f = check.callable_(f, "f", "pass the per-device body, e.g. lambda x: x * 2.")
    strict, check_vma = check.flag(strict, "strict"), check.flag(check_vma, "check_vma")
    mesh = check.optional_mesh(mesh)
    name = getattr(f, "__name__", type(f).__name__)

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        args = arrays_of(name, in_axes, args)
        on = mesh if mesh is not None else current_mesh()
        if isinstance(on, AbstractMesh) and jax.sharding.get_abstract_mesh() != on:
            # XLA finds no devices for a shard_map over a mesh that only names axes; it fails
            # at run time in its own words, so say it before anything is traced.
            raise EscaleTypeError(
                f"logical_shard_map({name!r}): mesh is an AbstractMesh {dict(on.shape)}, which "
                "names no devices, and no mesh of that shape is set around the call; pass the "
                "concrete jax.sharding.Mesh (create_mesh(...)), or call inside "
                "`with jax.set_mesh(mesh):` with the concrete mesh."
            )
        axes = MapAxes(name, on, as_logical_rules(rules), strict)
        in_specs = axes.inputs(in_axes, args)
        out_specs = axes.outputs(out_axes)
        placed = jax.tree.map(lambda s, x: apply_spec(x, s, on), in_specs, args)

        @functools.wraps(f)
        def checked(*blocks: Any) -> Any:
            out = f(*blocks)
            # Before jax.shard_map compares the outputs with out_specs, in its own words.
            axes.check_outputs(out_axes, out)
            return out

        body = jax.shard_map(
            checked, mesh=on, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
        try:
            return body(*placed)
        except EscaleError:
            raise
        except ValueError as error:
            if "out_specs" not in str(error):
                raise
            lines = str(error).splitlines()
            said = next((line for line in lines if line.startswith("out_specs is")), lines[0])
            raise EscaleError(
                f"logical_shard_map({name!r}): out_axes {out_axes!r} resolve to {out_specs} on "
                f"mesh {dict(on.shape)}, which the body's outputs do not fit: an output left "
                "unsplit over a mesh axis must be the same on every device of that axis. Split "
                "the output over those axes in out_axes (name its dimensions as the inputs' that "
                "vary over them), reduce over them in the body (jax.lax.psum), or pass "
                f"check_vma=False if the values do agree. JAX says: {said}"
            ) from error

    return mapped
