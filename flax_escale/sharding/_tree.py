"""A tree's shardings from its logical annotations, in Flax's naming family."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_escale.errors import EscaleTypeError
from flax_escale.mesh import _validate as check
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes
from flax_escale.sharding._annotation import annotated_leaves
from flax_escale.sharding._paths import is_box
from flax_escale.sharding._plan import build_plan

__all__ = ["logical_to_mesh_sharding"]


def logical_to_mesh_sharding(
    tree: Any, mesh: Mesh, rules: RulesLike = None, *, strict: bool = False
) -> Any:
    """The ``NamedSharding`` of every leaf of ``tree``, from logical axis names.

    Like Flax's ``nn.logical_to_mesh_sharding``, ``tree`` may hold one logical spec per leaf (a
    ``PartitionSpec`` or tuple of logical names, as ``nn.get_partition_spec`` gives them; a
    ``None`` leaf stays ``None``, as in Flax), resolved with the one resolver. It may also be
    the annotated variables themselves (``jax.eval_shape`` of a Linen ``init``, an NNX state or
    module, a train state): then every annotation is read the one way and resolution is
    shape-aware, so every sharding divides its array, and optimizer state follows its parameter.
    What cannot apply warns (``strict`` raises).

    Args:
        tree: Logical specs, or annotated (abstract) variables.
        mesh: The mesh.
        rules: The logical-axis rules; defaults to Flax's rules context, then to
            ``PartitionAxis()``'s.
        strict: Raise instead of correcting.

    Returns:
        A tree of ``NamedSharding`` shaped like ``tree`` (one per spec, box or variable).

    Raises:
        EscaleTypeError: If ``mesh`` is not a mesh, ``tree`` is a string or ``None``, or a
            leaf is a bare string rather than a spec.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import flax_escale as fe
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
        >>> specs = {"w": P("hidden_state", "mlp_intermediate"), "b": P()}
        >>> shardings = fe.logical_to_mesh_sharding(specs, mesh)
        >>> shardings["w"].spec, shardings["b"].spec
        (P(('fsdp', 'sp'), 'tp'), P())
        >>> model = nn.Dense(6, kernel_init=nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")))
        >>> abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8)))
        >>> fe.logical_to_mesh_sharding(abstract, mesh)["params"]["kernel"].spec  # 6 % tp=2
        P(('fsdp', 'sp'), 'tp')
    """
    mesh = check.mesh(mesh)
    strict = check.flag(strict, "strict")
    if isinstance(tree, str) or tree is None:
        raise EscaleTypeError(
            f"tree must be a tree of logical specs or annotated variables, got "
            f"{check.describe(tree)}; pass e.g. {{'kernel': PartitionSpec('hidden_state', "
            "'mlp_intermediate')}, or jax.eval_shape of the model's init."
        )
    if isinstance(tree, (nnx.Module, nnx.Optimizer)) or any(
        is_box(leaf) or hasattr(leaf, "shape") for leaf in _leaves(tree)
    ):
        treedef, items = annotated_leaves(tree)
        return build_plan(treedef, items, mesh, rules=rules, strict=strict).shardings()
    frozen = as_logical_rules(rules)

    def sharding(names: Any) -> NamedSharding:
        if isinstance(names, str):
            raise EscaleTypeError(
                f"tree: a leaf is the string {names!r}, not a logical spec; pass "
                f"PartitionSpec({names!r}) or ({names!r},) for a one-dimensional array."
            )
        resolution = resolve_logical_axes(tuple(names), frozen, mesh=mesh, strict=strict)
        return NamedSharding(mesh, enforce(resolution, strict=strict, stacklevel=3).spec)

    return jax.tree.map(sharding, tree, is_leaf=_is_logical_spec)


def _is_logical_spec(x: Any) -> bool:
    # A plain tuple of names is a spec; other tuples (optax states, namedtuples) are containers.
    if isinstance(x, PartitionSpec):
        return True
    return (
        type(x) is tuple
        and all(e is None or isinstance(e, (str, tuple)) for e in x)
        and all(isinstance(a, str) for e in x if isinstance(e, tuple) for a in e)
    )


def _leaves(tree: Any) -> list[Any]:
    return jax.tree.leaves(tree, is_leaf=lambda x: is_box(x) or _is_logical_spec(x))
