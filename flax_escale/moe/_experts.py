"""The experts' weights and their two ways of computing: dense per slot, grouped per row."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh

from flax_escale.resolve import RulesLike
from flax_escale.sharding import constrain

__all__ = ["EXPERT_AXES", "GatedExperts"]

EXPERT_AXES = {
    "wi_gate": ("expert", "hidden_state", "mlp_intermediate"),
    "wi_up": ("expert", "hidden_state", "mlp_intermediate"),
    "wo": ("expert", "mlp_intermediate", "hidden_state"),
}
"""The logical axes of each expert kernel, as models annotate them."""


class GatedExperts(NamedTuple):
    """The kernels of ``num_experts`` gated MLPs (SwiGLU's, as in Mixtral and DeepSeek).

    Expert ``e`` maps ``x`` to ``(activation(x @ wi_gate[e]) * (x @ wi_up[e])) @ wo[e]``. A
    pytree, so it passes through ``jax.jit`` and ``jax.shard_map`` whole.

    Attributes:
        wi_gate: ``(expert, hidden_state, mlp_intermediate)``.
        wi_up: ``(expert, hidden_state, mlp_intermediate)``.
        wo: ``(expert, mlp_intermediate, hidden_state)``.
    """

    wi_gate: jax.Array
    wi_up: jax.Array
    wo: jax.Array

    @property
    def num_experts(self) -> int:
        """The number of experts (the kernels' first dimension)."""
        return self.wi_gate.shape[0]

    def dense(
        self,
        x: jax.Array,
        activation: Callable[[jax.Array], jax.Array],
        *,
        mesh: Mesh | AbstractMesh | None = None,
        rules: RulesLike = None,
    ) -> jax.Array:
        """Each expert on its own slots: ``x`` is ``(expert, group, slot, hidden)``."""
        gate = jnp.einsum("egch,ehf->egcf", x, self.wi_gate)
        up = jnp.einsum("egch,ehf->egcf", x, self.wi_up)
        hidden = constrain(
            activation(gate) * up,
            ("expert", "expert_batch", None, "mlp_intermediate"),
            mesh=mesh,
            rules=rules,
        )
        return jnp.einsum("egcf,efh->egch", hidden, self.wo)

    def grouped(
        self,
        rows: jax.Array,
        group_sizes: jax.Array,
        activation: Callable[[jax.Array], jax.Array],
    ) -> jax.Array:
        """Rows sorted by expert, ``group_sizes[e]`` of them for expert ``e``, then the rest.

        One grouped matmul (``jax.lax.ragged_dot``) per kernel; rows past the groups (the
        padding of a fixed-size buffer) come out as zeros.
        """
        gate = jax.lax.ragged_dot(rows, self.wi_gate, group_sizes)
        up = jax.lax.ragged_dot(rows, self.wi_up, group_sizes)
        return jax.lax.ragged_dot(activation(gate) * up, self.wo, group_sizes)
