"""The mixture-of-experts examples' configurations and rules, shared by Linen and NNX."""

from __future__ import annotations

import dataclasses

import jax

import flax_escale as fe
from flax_escale import moe

RULES = fe.PartitionAxis(ep_as_fsdp=True)
"""Outside the experts, ``ep`` splits the batch and the other weights as ``fsdp`` does."""

EXPERT_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", 1, 2, 0)
"""Each expert initialized as its own dense layer: the fan-in is the kernels' middle dimension."""


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4  # the NNX example's grouped-query attention reads it; Linen's has none
    head_dim: int = 16
    mlp: int = 64  # each expert's intermediate size
    experts: int = 8
    top_k: int = 2
    shared_experts: int = 0  # always-on experts of the same size beside the routed ones
    layers: int = 2
    max_len: int = 32
    rope_base: float = 10_000.0
    strategy: moe.Strategy = "capacity"
    capacity_factor: float = 1.25
    exchange: moe.Exchange = "all_to_all"
    aux_loss_weight: float = 0.01


# Mixtral 8x7B: 8 experts of 14,336, two per token, grouped-query attention with 8 KV heads.
MIXTRAL_8X7B = Config(
    vocab=32_000,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    mlp=14_336,
    experts=8,
    top_k=2,
    layers=32,
    max_len=4096,
    rope_base=1e6,
)
# DeepSeekMoE 16B: many small experts (64 of 1,408, six per token) and two shared ones.
DEEPSEEK_MOE_16B = Config(
    vocab=102_400,
    hidden=2048,
    heads=16,
    kv_heads=16,
    head_dim=128,
    mlp=1408,
    experts=64,
    top_k=6,
    shared_experts=2,
    layers=28,
    max_len=4096,
)
SMALL = Config()
CONFIGS = {"small": SMALL, "mixtral-8x7b": MIXTRAL_8X7B, "deepseek-moe-16b": DEEPSEEK_MOE_16B}
