"""A small-config rewrite of Flax's ``examples/gemma`` NNX transformer (Gemma 3 style).

Written here, not copied: it reproduces what the sharding library sees of the example, namely
its module tree and variable names (``embedder/embedding``, ``layers/{i}/attn/q_einsum/kernel``,
``attn/kv_einsum`` or ``attn/qkv_einsum``, ``attn/attn_vec_einsum``, ``mlp/gate_proj``,
``mlp/up_proj``, ``mlp/down_proj``, the ``RMSNorm`` scales, ``final_norm``), its layer types
(``nnx.Embed`` subclass, ``nnx.Einsum``, ``nnx.Linear``, ``nnx.Dropout``, a ``nnx.List`` of
blocks) and its sharding style: a frozen ``ShardingConfig`` of ``PartitionSpec`` s naming mesh
axes directly (``fsdp`` and ``tp`` by default), given to the variables as
``kernel_metadata={"out_sharding": ...}`` and to the activations as the ``out_sharding=``
argument of each projection, which is what ``jax.make_mesh``'s Explicit axes expect. The KV
cache, sampling and the intermediate-capture hooks are left out.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

K_MASK = -2.3819763e38  # what masked logits are set to, as in the example


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Mesh-axis specs for weights (``*_weight_*``) and activations (``act_*``).

    The letters say the dimensions: b batch, t time, d model, f feed-forward, n heads, k kv
    heads, h head dim, v vocabulary, c/s the stacked q-k-v (or k-v) index.
    """

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    qkv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_sbtnh: P | None = None
    fsdp_axis_name: str = "fsdp"
    tensor_parallel_axis_name: str = "tp"

    @staticmethod
    def no_sharding() -> ShardingConfig:
        return ShardingConfig()

    @staticmethod
    def fsdp_tp_sharding(
        fsdp_axis_name: str = "fsdp", tensor_parallel_axis_name: str = "tp"
    ) -> ShardingConfig:
        """The example's FSDP + tensor-parallel layout (for training)."""
        fsdp, tp = fsdp_axis_name, tensor_parallel_axis_name
        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None),
            qkv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(tp),
            act_btd=P(fsdp, None, tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_sbtnh=P(None, fsdp, None, tp, None),
            fsdp_axis_name=fsdp,
            tensor_parallel_axis_name=tp,
        )


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The example's text-only transformer configuration (a subset of its fields)."""

    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    final_logit_softcap: float | None
    use_post_attn_norm: bool
    use_post_ffw_norm: bool
    attention_types: Sequence[AttentionType]
    use_qk_norm: bool = False
    sliding_window_size: int | None = None
    rope_base_frequency: int = 10_000
    dtype: Any = jnp.float32
    weight_dtype: Any = jnp.float32
    dropout_rate: float = 0.0
    shd_config: ShardingConfig = dataclasses.field(default_factory=ShardingConfig.no_sharding)

    def query_pre_attn_scalar(self) -> float:
        return self.head_dim**-0.5


def small_config(
    shd_config: ShardingConfig | None = None, num_kv_heads: int = 2
) -> TransformerConfig:
    """Gemma 3's structure (local then global attention, qk norm, post norms) at tiny widths.

    ``num_kv_heads=2`` (of 4 heads) takes the grouped-query path (``q_einsum`` and
    ``kv_einsum``); ``num_kv_heads=4`` takes the fused ``qkv_einsum`` path.
    """
    return TransformerConfig(
        num_layers=2,
        num_embed=256,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=num_kv_heads,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL),
        use_qk_norm=True,
        sliding_window_size=8,
        shd_config=shd_config or ShardingConfig.no_sharding(),
    )


def apply_rope(
    inputs: jax.Array, positions: jax.Array, head_dim: int, max_wavelength: int
) -> jax.Array:
    """Rotary position embedding on ``inputs`` ``[B, T, N, H]`` at ``positions`` ``[B, T]``."""
    exponents = jnp.arange(head_dim // 2) * 2 / head_dim
    angles = positions[:, :, None, None] / (max_wavelength**exponents)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(inputs, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(inputs.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a zero-initialized scale applied as ``1 + scale``."""

    def __init__(
        self,
        dim: int,
        *,
        scale_metadata: dict[str, Any] | None = None,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        weight_dtype: Any = jnp.float32,
    ):
        self.dtype = dtype
        init = nnx.initializers.zeros_init()
        self.scale = nnx.Param(init(rngs.params(), dim, weight_dtype), **(scale_metadata or {}))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.asarray(x, jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return jnp.asarray(normed, self.dtype) * (1.0 + jnp.asarray(self.scale, self.dtype))


class ScaledEmbed(nnx.Embed):
    """Embedding lookup scaled by ``sqrt(features)``; ``attend`` gives the tied logits."""

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        y = super().__call__(x, out_sharding)
        return y * jnp.sqrt(y.shape[-1])


class Attention(nnx.Module):
    """Grouped-query (or fused q-k-v) attention with RoPE, qk norm and a sliding window."""

    def __init__(
        self,
        config: TransformerConfig,
        attn_type: AttentionType,
        *,
        rngs: nnx.Rngs,
    ):
        shd = config.shd_config
        n, k, d, h = config.num_heads, config.num_kv_heads, config.embed_dim, config.head_dim
        common = {"dtype": config.dtype, "param_dtype": config.weight_dtype, "rngs": rngs}
        self.shd_config = shd
        self.attn_type = attn_type
        self.sliding_window_size = config.sliding_window_size
        self.query_pre_attn_scalar = config.query_pre_attn_scalar()
        self.rope_base_frequency = config.rope_base_frequency
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.attn_vec_einsum = nnx.Einsum(
            "BTNH,NHD->BTD",
            (n, h, d),
            kernel_metadata={"out_sharding": shd.o_weight_nhd},
            **common,
        )
        if n == k:
            self.qkv_einsum = nnx.Einsum(
                "BTD,SNDH->SBTNH",
                (3, n, d, h),
                kernel_metadata={"out_sharding": shd.qkv_weight_cndh},
                **common,
            )
            self.kv_shd = shd.act_sbtnh
        else:
            self.qkv_einsum = None
            self.q_einsum = nnx.Einsum(
                "BTD,NDH->BTNH",
                (n, d, h),
                kernel_metadata={"out_sharding": shd.q_weight_ndh},
                **common,
            )
            self.kv_einsum = nnx.Einsum(
                "BTD,CKDH->CBTKH",
                (2, k, d, h),
                kernel_metadata={"out_sharding": shd.kv_weight_cndh},
                **common,
            )
            self.kv_shd = shd.act_sbtnh
        if config.use_qk_norm:
            self._query_norm = RMSNorm(h, rngs=rngs, dtype=config.dtype)
            self._key_norm = RMSNorm(h, rngs=rngs, dtype=config.dtype)
        self.use_qk_norm = config.use_qk_norm
        self.dropout = nnx.Dropout(config.dropout_rate)

    def __call__(
        self, x: jax.Array, segment_pos: jax.Array, attn_mask: jax.Array, rngs: Any = None
    ) -> jax.Array:
        if self.qkv_einsum is not None:
            query, key, value = self.qkv_einsum(x, out_sharding=self.shd_config.act_sbtnh)
        else:
            query = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
            key, value = self.kv_einsum(x, out_sharding=self.kv_shd)
        if self.use_qk_norm:
            query, key = self._query_norm(query), self._key_norm(key)
        query = apply_rope(query, segment_pos, self.head_dim, self.rope_base_frequency)
        key = apply_rope(key, segment_pos, self.head_dim, self.rope_base_frequency)
        query = query * self.query_pre_attn_scalar

        b, t, n, h = query.shape
        groups = n // self.num_kv_heads
        grouped = query.reshape(b, t, self.num_kv_heads, groups, h)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", grouped, key).reshape(b, t, n, -1)

        if self.attn_type == AttentionType.LOCAL_SLIDING:
            ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
            window = self.sliding_window_size
            attn_mask = attn_mask * jnp.triu(ones, 1 - window) * jnp.tril(ones, window - 1)
        logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
        probs = self.dropout(jax.nn.softmax(logits, axis=-1).astype(key.dtype), rngs=rngs)

        probs = probs.reshape(b, t, self.num_kv_heads, groups, -1)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value).reshape(b, t, n, h)
        return self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)


class FeedForward(nnx.Module):
    """Gated GELU feed-forward: ``down(gelu(gate(x)) * up(x))``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        shd = config.shd_config
        d, f = config.embed_dim, config.hidden_dim
        common = {
            "use_bias": False,
            "rngs": rngs,
            "kernel_init": nnx.initializers.normal(),
            "dtype": config.dtype,
            "param_dtype": config.weight_dtype,
        }
        self.gate_proj = nnx.Linear(
            d, f, kernel_metadata={"out_sharding": shd.ffw_weight_df}, **common
        )
        self.up_proj = nnx.Linear(
            d, f, kernel_metadata={"out_sharding": shd.ffw_weight_df}, **common
        )
        self.down_proj = nnx.Linear(
            f, d, kernel_metadata={"out_sharding": shd.ffw_weight_fd}, **common
        )
        self.dropout = nnx.Dropout(config.dropout_rate)
        self.shd_config = shd

    def __call__(self, x: jax.Array, rngs: Any = None) -> jax.Array:
        gate = nnx.gelu(self.gate_proj(x, out_sharding=self.shd_config.act_btf))
        hidden = self.dropout(
            gate * self.up_proj(x, out_sharding=self.shd_config.act_btf), rngs=rngs
        )
        return self.down_proj(hidden, out_sharding=self.shd_config.act_btd)


class Block(nnx.Module):
    """Norm, attention, optional post norm, residual; norm, MLP, optional post norm, residual."""

    def __init__(self, config: TransformerConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            metadata = {"out_sharding": config.shd_config.rms_norm_weight}
            return RMSNorm(config.embed_dim, scale_metadata=metadata, rngs=rngs, dtype=config.dtype)

        self.pre_attention_norm = norm()
        self.attn = Attention(config, attn_type, rngs=rngs)
        self.post_attention_norm = norm() if config.use_post_attn_norm else None
        self.pre_ffw_norm = norm()
        self.mlp = FeedForward(config, rngs=rngs)
        self.post_ffw_norm = norm() if config.use_post_ffw_norm else None
        self.dropout = nnx.Dropout(config.dropout_rate)

    def __call__(
        self, x: jax.Array, segment_pos: jax.Array, attn_mask: jax.Array, rngs: Any = None
    ) -> jax.Array:
        attn = self.attn(self.pre_attention_norm(x), segment_pos, attn_mask, rngs=rngs)
        if self.post_attention_norm is not None:
            attn = self.post_attention_norm(attn)
        x = x + attn
        ffw = self.mlp(self.pre_ffw_norm(x), rngs=rngs)
        if self.post_ffw_norm is not None:
            ffw = self.post_ffw_norm(ffw)
        return self.dropout(x + ffw, rngs=rngs)


class Transformer(nnx.Module):
    """Embedder, the blocks, a final norm, and logits tied to the embedding."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.embedder = ScaledEmbed(
            config.num_embed,
            config.embed_dim,
            dtype=config.dtype,
            param_dtype=config.weight_dtype,
            rngs=rngs,
            embedding_metadata={"out_sharding": config.shd_config.emb_vd},
        )
        self.layers = nnx.List(
            [
                Block(config, attn_type, rngs=rngs)
                for attn_type in config.attention_types[: config.num_layers]
            ]
        )
        self.final_norm = RMSNorm(
            config.embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=config.dtype,
        )
        self.final_dropout = nnx.Dropout(config.dropout_rate, deterministic=False)
        self.final_logits_softcap = config.final_logit_softcap
        self.shd_config = config.shd_config

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array, rngs: Any = None
    ) -> jax.Array:
        x = self.embedder(tokens, out_sharding=self.shd_config.act_btd)
        for layer in self.layers:
            x = layer(x, positions, attention_mask, rngs=rngs)
        x = self.final_dropout(self.final_norm(x), rngs=rngs)
        logits = self.embedder.attend(x, out_sharding=self.shd_config.act_btd)
        if self.final_logits_softcap is not None:
            logits = jnp.tanh(logits / self.final_logits_softcap) * self.final_logits_softcap
        return logits


def make_causal_attn_mask(input_mask: jax.Array) -> jax.Array:
    """``[B, L, L]``: position i sees the non-padding positions j <= i."""
    length = input_mask.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    return input_mask[..., None, :] * causal[None]


def build_positions_from_mask(input_mask: jax.Array) -> jax.Array:
    """RoPE positions from the mask: the count of real tokens before each one."""
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)
