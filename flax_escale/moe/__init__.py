"""Mixture of experts: top-k routing and two ways to dispatch tokens to experts over ``ep``.

Models declare their experts' kernels with the logical names ``(expert, hidden_state,
mlp_intermediate)`` and ``(expert, mlp_intermediate, hidden_state)``
(:data:`EXPERT_AXES`), so the rules put the experts on ``ep`` and the rest of each kernel
where any weight's would go; :func:`moe_mlp` then routes each token and dispatches it with
the chosen strategy (capacity-based einsums, or dropless ``shard_map`` with grouped matmuls).
The functions take arrays, so Linen and NNX modules share them (``examples/linen_moe.py``,
``examples/nnx_moe.py``). ``PartitionAxis(ep_as_fsdp=True)`` lets ``ep`` split the batch
and the other weights outside the experts.
"""

from flax_escale.moe._capacity import expert_capacity
from flax_escale.moe._dropless import Exchange
from flax_escale.moe._experts import EXPERT_AXES, GatedExperts
from flax_escale.moe._layer import STRATEGIES, MoeOutput, Strategy, moe_mlp
from flax_escale.moe._routing import Routing, route_top_k

__all__ = [
    "EXPERT_AXES",
    "STRATEGIES",
    "Exchange",
    "GatedExperts",
    "MoeOutput",
    "Routing",
    "Strategy",
    "expert_capacity",
    "moe_mlp",
    "route_top_k",
]
