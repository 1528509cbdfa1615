"""One context for running a model sharded: the mesh and the logical-axis rules together."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import flax.linen as nn
import jax
from jax.sharding import Mesh

from flax_escale.axes.partition_axis import LogicalRules
from flax_escale.resolve.fit import mesh_axes_of
from flax_escale.resolve.logical import RulesLike, as_logical_rules

__all__ = ["use_sharding"]


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: RulesLike = None) -> Iterator[LogicalRules]:
    """Sets ``mesh`` as the current mesh and ``rules`` as Flax's logical-axis rules.

    Inside, activation constraints (:func:`~flax_escale.constrain`, Flax's own
    ``nn.with_logical_constraint``) resolve on ``mesh`` with ``rules``, in and out of
    ``jax.jit``: a function traced inside keeps its constraints in the compiled program. It is
    ``jax.set_mesh(mesh)`` and ``flax.linen.logical_axis_rules(rules)`` in one, never the legacy
    ``with mesh:`` (under which Flax drops logical constraints).

    Flax's own logical constraints (``nn.with_logical_constraint``, and the one Flax adds when a
    ``nn.LogicallyPartitioned`` parameter is unboxed) look the rules up themselves and fail on a
    mesh axis the mesh lacks; so the rules set for Flax send such targets to ``None``, which is
    what the library's resolver makes of them too (that dimension is left unsharded).

    Args:
        mesh: The mesh.
        rules: The rules (see :func:`~flax_escale.as_logical_rules`); a ``PartitionAxis`` is
            translated. Defaults to the rules already set, then to ``PartitionAxis()``'s.

    Yields:
        The rules, as ``(name, mesh axes)`` pairs (before sending absent axes to ``None``).

    Example:
        >>> mesh = create_mesh((1, 4, 1, 2, 1))
        >>> with use_sharding(mesh):
        ...     y = jax.jit(lambda x: constrain(x, ("batch", "hidden_state")))(jnp.ones((8, 4)))
        >>> y.sharding.spec
        P('fsdp', 'tp')
    """
    frozen = as_logical_rules(rules)
    available = [
        (name, target if set(mesh_axes_of(target)) <= set(mesh.axis_names) else None)
        for name, target in frozen
    ]
    with jax.set_mesh(mesh), nn.logical_axis_rules(available):
        yield frozen
