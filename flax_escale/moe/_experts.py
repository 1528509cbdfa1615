"""The experts' weights and their two ways of computing: dense per slot, grouped per row."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh

from flax_escale import _checks as check
from flax_escale._specs import without_unit_explicit_axes
from flax_escale.errors import EscaleTypeError, NoMeshError
from flax_escale.mesh import current_mesh
from flax_escale.resolve import RulesLike, as_logical_rules, enforce, resolve_logical_axes
from flax_escale.sharding import constrain

__all__ = ["DISPATCHED_AXES", "EXPERT_AXES", "GatedExperts", "checked_activation", "explicit_mesh"]

DISPATCHED_AXES = ("expert", "expert_batch", None, "hidden_state")
"""The logical axes of tokens seated in the experts' slots: ``(expert, group, slot, hidden)``."""

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
        """The number of experts (the kernels' first dimension).

        Raises:
            EscaleTypeError: If ``wi_gate`` is not an array of at least one dimension.
        """
        shape = getattr(self.wi_gate, "shape", None)
        if not isinstance(shape, tuple) or not shape:
            raise EscaleTypeError(
                f"GatedExperts.wi_gate must be an (expert, hidden_state, mlp_intermediate) "
                f"array, got {check.describe(self.wi_gate)}; pass the experts' kernels."
            )
        return shape[0]

    def dense(
        self,
        x: jax.Array,
        activation: Callable[[jax.Array], jax.Array],
        *,
        mesh: Mesh | AbstractMesh | None = None,
        rules: RulesLike = None,
        strict: bool = False,
    ) -> jax.Array:
        """Each expert on its own slots: ``x`` is ``(expert, group, slot, hidden)``.

        ``activation`` is the gate's function (``jax.nn.silu``); ``strict`` makes what the
        constraints cannot apply an error, as :func:`~flax_escale.constrain`'s does.

        Raises:
            EscaleTypeError: If ``activation`` is not a function of one array.
        """
        activation = checked_activation(activation, "GatedExperts.dense: activation")
        explicit = explicit_mesh(mesh)

        def einsum(subscripts: str, a: jax.Array, kernel: jax.Array, axes: tuple) -> jax.Array:
            if explicit is None:
                return jnp.einsum(subscripts, a, kernel)
            # On Explicit axes JAX asks for the output's layout whenever the operands split
            # the contracted dimension differently (activations' hidden on tp, kernels' on
            # fsdp): it is the one the next constraint asks for anyway.
            shape = (*a.shape[:3], kernel.shape[2])
            resolution = resolve_logical_axes(
                axes, as_logical_rules(rules), shape=shape, mesh=explicit
            )
            spec = without_unit_explicit_axes(enforce(resolution, strict=strict).spec, explicit)
            return jnp.einsum(subscripts, a, kernel, out_sharding=spec)

        hidden_axes = ("expert", "expert_batch", None, "mlp_intermediate")
        gate = einsum("egch,ehf->egcf", x, self.wi_gate, hidden_axes)
        up = einsum("egch,ehf->egcf", x, self.wi_up, hidden_axes)
        hidden = constrain(
            activation(gate) * up, hidden_axes, mesh=mesh, rules=rules, strict=strict
        )
        return einsum("egcf,efh->egch", hidden, self.wo, DISPATCHED_AXES)

    def grouped(
        self,
        rows: jax.Array,
        group_sizes: jax.Array,
        activation: Callable[[jax.Array], jax.Array],
    ) -> jax.Array:
        """Rows sorted by expert, ``group_sizes[e]`` of them for expert ``e``, then the rest.

        One grouped matmul (``jax.lax.ragged_dot``) per kernel; rows past the groups (the
        padding of a fixed-size buffer) come out as zeros.

        Raises:
            EscaleTypeError: If ``activation`` is not a function of one array.
        """
        activation = checked_activation(activation, "GatedExperts.grouped: activation")
        gate = jax.lax.ragged_dot(rows, self.wi_gate, group_sizes)
        up = jax.lax.ragged_dot(rows, self.wi_up, group_sizes)
        return jax.lax.ragged_dot(activation(gate) * up, self.wo, group_sizes)


def checked_activation(value: object, argument: str) -> Callable[[jax.Array], jax.Array]:
    """``value`` if it is a function of one array; a name such as ``"silu"`` is refused.

    Example:
        >>> import jax
        >>> from flax_escale.moe._experts import checked_activation
        >>> checked_activation(jax.nn.gelu, "activation") is jax.nn.gelu
        True
        >>> checked_activation("silu", "activation")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        flax_escale.errors.EscaleTypeError: activation must be a function, ... e.g. jax.nn.silu, ...
    """
    if isinstance(value, str) and callable(getattr(jax.nn, value, None)):
        hint = f"pass the function itself, e.g. jax.nn.{value}, not its name."
    else:
        hint = "pass a function of one array, e.g. jax.nn.silu."
    function = check.callable_(value, argument, hint)
    check.takes_positional(function, 1, argument, "activation(x)")
    return function


def explicit_mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh | None:
    """``mesh`` (else the current one) when it has Explicit axes; ``None`` otherwise."""
    if mesh is None:
        try:
            mesh = current_mesh()
        except NoMeshError:
            return None
    return mesh if AxisType.Explicit in mesh.axis_types else None
