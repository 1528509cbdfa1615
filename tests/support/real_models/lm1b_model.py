"""A small-config rewrite of Flax's ``examples/lm1b`` decoder-only language model.

Written here, not copied: it reproduces what the sharding library sees of the example, namely
its module tree and parameter names (``decoder/encoderdecoderblock_{i}/...``,
``decoder/Embed_0/embedding``, ``decoder/logitdense/...``), its layer types (``nn.Embed``,
``nn.LayerNorm``, ``nn.MultiHeadDotProductAttention``, ``nn.Dense``, ``nn.Dropout``) and its
annotation style: ``nn.with_logical_partitioning`` on every initializer, in t5x's vocabulary
(``embed``, ``mlp``, ``vocab``, ``kv``). The attention projections are ``nn.DenseGeneral``
kernels of rank 3 annotated with two names, because Flax calls their initializer on the
flattened 2-D shape. Autoregressive decoding is left out (training and init are what is tested).

``scan_layers=True`` is a variant the example does not have: the same blocks stacked with
``nn.scan`` and ``metadata_params={nn.PARTITION_NAME: "layers"}``, as scanned Flax models write
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import struct
from jax import lax

from support.real_models.position import AddPositionEmbs

logical = nn.with_logical_partitioning


@struct.dataclass
class TransformerConfig:
    """The example's hyperparameters (its defaults are much larger; see ``small_config``)."""

    vocab_size: int
    output_vocab_size: int
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)
    posemb_init: Callable | None = None
    scan_layers: bool = struct.field(pytree_node=False, default=False)


def small_config(**changes: Any) -> TransformerConfig:
    """Every width a multiple of 8 (so each annotated dimension splits over 8 devices), 2 layers,
    dropout off."""
    base = {
        "vocab_size": 256,
        "output_vocab_size": 256,
        "emb_dim": 64,
        "num_heads": 8,
        "num_layers": 2,
        "qkv_dim": 64,
        "mlp_dim": 128,
        "max_len": 32,
        "dropout_rate": 0.0,
        "attention_dropout_rate": 0.0,
        "deterministic": True,
    }
    return TransformerConfig(**{**base, **changes})


# The parallelism settings of the example's configs/default.py: its mesh axes and its rules.
MESH_AXES = ("data", "fsdp", "tensor")
LOGICAL_AXIS_RULES = [
    ["mlp", "tensor"],
    ["vocab", "tensor"],
    ["embed", "fsdp"],
    ["heads", "tensor"],
]
DATA_SHARDING = ["data"]


def shift_right(x: jnp.ndarray, axis: int = 1) -> jnp.ndarray:
    """``x`` moved one place along ``axis``, a zero entering first."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (1, 0)
    padded = jnp.pad(x, widths, constant_values=x.dtype.type(0))
    return lax.dynamic_slice_in_dim(padded, 0, x.shape[axis], axis)


def shift_inputs(
    x: jnp.ndarray, segment_ids: jnp.ndarray | None = None, axis: int = 1
) -> jnp.ndarray:
    """Decoder inputs from targets; with packing, each segment starts from 0."""
    shifted = shift_right(x, axis=axis)
    if segment_ids is not None:
        shifted *= segment_ids == shift_right(segment_ids, axis=axis)
    return shifted


class MlpBlock(nn.Module):
    """Dense (embed -> mlp), relu, dropout, Dense (mlp -> embed), dropout."""

    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        config = self.config
        features = inputs.shape[-1] if self.out_dim is None else self.out_dim
        hidden = nn.Dense(
            config.mlp_dim,
            dtype=config.dtype,
            kernel_init=logical(config.kernel_init, ("embed", "mlp")),
            bias_init=logical(config.bias_init, ("mlp",)),
        )(inputs)
        hidden = nn.Dropout(rate=config.dropout_rate)(
            nn.relu(hidden), deterministic=config.deterministic
        )
        out = nn.Dense(
            features,
            dtype=config.dtype,
            kernel_init=logical(config.kernel_init, ("mlp", "embed")),
            bias_init=logical(config.bias_init, ("embed",)),
        )(hidden)
        return nn.Dropout(rate=config.dropout_rate)(out, deterministic=config.deterministic)


def _layer_norm(config: TransformerConfig, name: str | None = None) -> nn.LayerNorm:
    return nn.LayerNorm(
        dtype=config.dtype,
        name=name,
        bias_init=logical(nn.initializers.zeros, ("embed",)),
        scale_init=logical(nn.initializers.ones, ("embed",)),
    )


class EncoderDecoder1DBlock(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, decoder_mask: jnp.ndarray | None = None):
        config = self.config
        assert inputs.ndim == 3, inputs.shape
        x = _layer_norm(config)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            # Two names for kernels of rank 3: the initializer sees the flattened shape.
            kernel_init=logical(config.kernel_init, ("embed", "kv")),
            bias_init=logical(config.bias_init, ("embed",)),
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs
        z = MlpBlock(config=config)(_layer_norm(config)(x))
        return x + z


class _ScanBody(nn.Module):
    """One block in the ``(carry, xs) -> (carry, ys)`` form ``nn.scan`` needs."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, y: jnp.ndarray, decoder_mask: jnp.ndarray | None):
        return EncoderDecoder1DBlock(self.config, name="block")(y, decoder_mask), None


class Decoder(nn.Module):
    """Embedding, position table, the blocks, a final norm and the logits."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        inputs_positions: jnp.ndarray | None = None,
        inputs_segmentation: jnp.ndarray | None = None,
        decoder_mask: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        config = self.config
        assert inputs.ndim == 2, inputs.shape
        if self.shared_embedding is None:
            embed = nn.Embed(
                num_embeddings=config.output_vocab_size,
                features=config.emb_dim,
                embedding_init=logical(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
            )
        else:
            embed = self.shared_embedding
        y = embed(shift_inputs(inputs.astype("int32"), segment_ids=inputs_segmentation))
        y = AddPositionEmbs(config=config, name="posembed_output")(
            y, inputs_positions=inputs_positions
        )
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)

        if config.scan_layers:
            stack = nn.scan(
                _ScanBody,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,),
                length=config.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            y, _ = stack(config, name="encoderdecoderblock")(y, decoder_mask)
        else:
            for layer in range(config.num_layers):
                y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{layer}")(
                    y, decoder_mask=decoder_mask
                )
        y = _layer_norm(config, name="encoderdecoder_norm")(y)

        if config.logits_via_embedding:
            return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
        return nn.Dense(
            config.output_vocab_size,
            dtype=config.dtype,
            kernel_init=logical(config.kernel_init, ("embed", "vocab")),
            bias_init=logical(config.bias_init, ("vocab",)),
            name="logitdense",
        )(y)


class TransformerLM(nn.Module):
    """The decoder-only language model: padding and causal masks, then the decoder."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        inputs_positions: jnp.ndarray | None = None,
        inputs_segmentation: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        config = self.config
        mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
            nn.make_causal_mask(inputs, dtype=config.dtype),
        )
        if inputs_segmentation is not None:
            same_segment = nn.make_attention_mask(
                inputs_segmentation, inputs_segmentation, jnp.equal, dtype=config.dtype
            )
            mask = nn.combine_masks(mask, same_segment)
        logits = Decoder(config=config, name="decoder")(
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            decoder_mask=mask,
        )
        return logits.astype(config.dtype)
