"""A small-config rewrite of Flax's ``examples/wmt`` encoder-decoder translation model.

Written here, not copied: it reproduces what the sharding library sees of the example, namely
its module tree and parameter names (``encoder/encoderblock_{i}/...``,
``decoder/encoderdecoderblock_{i}/...``, ``encoder/encoder_norm``,
``decoder/encoderdecoder_norm``, ``decoder/logitdense`` when logits are not tied) and its
layer types, with the embedding that both halves share created in ``Transformer.setup`` as
``shared_embedding``. Like the example (which trains with ``jax.pmap``), it carries no
sharding annotation at all: no ``nn.with_logical_partitioning``, no logical constraint.
Autoregressive decoding is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax import struct

from support.real_models.position import AddPositionEmbs


@struct.dataclass
class TransformerConfig:
    """The example's hyperparameters (its defaults are much larger; see ``small_config``)."""

    vocab_size: int
    output_vocab_size: int
    share_embeddings: bool = False
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


def small_config(**changes: Any) -> TransformerConfig:
    """The example's default choices (shared embedding, tied logits) at widths that are
    multiples of 8, 2 layers, dropout off."""
    base = {
        "vocab_size": 256,
        "output_vocab_size": 256,
        "share_embeddings": True,
        "logits_via_embedding": True,
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


def shift_right(x: jnp.ndarray) -> jnp.ndarray:
    """Targets moved one place right along axis 1, a zero entering first."""
    return jnp.pad(x, [(0, 0), (1, 0)], constant_values=x.dtype.type(0))[:, :-1]


class MlpBlock(nn.Module):
    """Dense, relu, dropout, Dense, dropout."""

    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs: jnp.ndarray) -> jnp.ndarray:
        config = self.config
        features = inputs.shape[-1] if self.out_dim is None else self.out_dim
        hidden = nn.Dense(
            config.mlp_dim,
            dtype=config.dtype,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
        )(inputs)
        hidden = nn.Dropout(rate=config.dropout_rate)(
            nn.relu(hidden), deterministic=config.deterministic
        )
        out = nn.Dense(
            features, dtype=config.dtype, kernel_init=config.kernel_init, bias_init=config.bias_init
        )(hidden)
        return nn.Dropout(rate=config.dropout_rate)(out, deterministic=config.deterministic)


def _attention(config: TransformerConfig) -> nn.MultiHeadDotProductAttention:
    return nn.MultiHeadDotProductAttention(
        num_heads=config.num_heads,
        dtype=config.dtype,
        qkv_features=config.qkv_dim,
        kernel_init=config.kernel_init,
        bias_init=config.bias_init,
        use_bias=False,
        broadcast_dropout=False,
        dropout_rate=config.attention_dropout_rate,
        deterministic=config.deterministic,
    )


class Encoder1DBlock(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jnp.ndarray, encoder_mask: jnp.ndarray | None = None):
        config = self.config
        x = _attention(config)(nn.LayerNorm(dtype=config.dtype)(inputs), mask=encoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic) + inputs
        return x + MlpBlock(config=config)(nn.LayerNorm(dtype=config.dtype)(x))


class EncoderDecoder1DBlock(nn.Module):
    """Self-attention, attention over the encoded inputs, and MLP, each pre-norm and residual."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        targets: jnp.ndarray,
        encoded: jnp.ndarray,
        decoder_mask: jnp.ndarray | None = None,
        encoder_decoder_mask: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        config = self.config
        drop = nn.Dropout(rate=config.dropout_rate)
        x = _attention(config)(nn.LayerNorm(dtype=config.dtype)(targets), mask=decoder_mask)
        x = drop(x, deterministic=config.deterministic) + targets
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = _attention(config)(y, encoded, mask=encoder_decoder_mask)
        y = drop(y, deterministic=config.deterministic) + x
        return y + MlpBlock(config=config)(nn.LayerNorm(dtype=config.dtype)(y))


class Encoder(nn.Module):
    """Embedding (shared or its own), position table, blocks and a final norm."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(
        self,
        inputs: jnp.ndarray,
        inputs_positions: jnp.ndarray | None = None,
        encoder_mask: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        config = self.config
        if self.shared_embedding is None:
            embed = nn.Embed(
                num_embeddings=config.vocab_size,
                features=config.emb_dim,
                embedding_init=nn.initializers.normal(stddev=1.0),
            )
        else:
            embed = self.shared_embedding
        x = embed(inputs.astype("int32"))
        x = AddPositionEmbs(config=config, name="posembed_input")(
            x, inputs_positions=inputs_positions
        )
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x.astype(config.dtype)
        for layer in range(config.num_layers):
            x = Encoder1DBlock(config=config, name=f"encoderblock_{layer}")(x, encoder_mask)
        return nn.LayerNorm(dtype=config.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
    """Embedding (shared or its own), position table, blocks, a final norm and the logits."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(
        self,
        encoded: jnp.ndarray,
        targets: jnp.ndarray,
        targets_positions: jnp.ndarray | None = None,
        decoder_mask: jnp.ndarray | None = None,
        encoder_decoder_mask: jnp.ndarray | None = None,
    ) -> jnp.ndarray:
        config = self.config
        if self.shared_embedding is None:
            embed = nn.Embed(
                num_embeddings=config.output_vocab_size,
                features=config.emb_dim,
                embedding_init=nn.initializers.normal(stddev=1.0),
            )
        else:
            embed = self.shared_embedding
        y = embed(shift_right(targets.astype("int32")))
        y = AddPositionEmbs(config=config, name="posembed_output")(
            y, inputs_positions=targets_positions
        )
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        for layer in range(config.num_layers):
            y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{layer}")(
                y, encoded, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask
            )
        y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)
        if config.logits_via_embedding:
            return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])
        return nn.Dense(
            config.output_vocab_size,
            dtype=config.dtype,
            kernel_init=config.kernel_init,
            bias_init=config.bias_init,
            name="logitdense",
        )(y)


class Transformer(nn.Module):
    """The encoder-decoder, with the shared embedding made in ``setup``."""

    config: TransformerConfig

    def setup(self) -> None:
        config = self.config
        if config.share_embeddings:
            assert config.output_vocab_size in (None, config.vocab_size)
            self.shared_embedding = nn.Embed(
                num_embeddings=config.vocab_size,
                features=config.emb_dim,
                embedding_init=nn.initializers.normal(stddev=1.0),
            )
        else:
            self.shared_embedding = None
        self.encoder = Encoder(config=config, shared_embedding=self.shared_embedding)
        self.decoder = Decoder(config=config, shared_embedding=self.shared_embedding)

    def encode(self, inputs: jnp.ndarray) -> jnp.ndarray:
        mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=self.config.dtype)
        return self.encoder(inputs, encoder_mask=mask)

    def decode(self, encoded: jnp.ndarray, inputs: jnp.ndarray, targets: jnp.ndarray):
        dtype = self.config.dtype
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(targets > 0, targets > 0, dtype=dtype),
            nn.make_causal_mask(targets, dtype=dtype),
        )
        encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0, dtype=dtype)
        logits = self.decoder(
            encoded,
            targets,
            decoder_mask=decoder_mask,
            encoder_decoder_mask=encoder_decoder_mask,
        )
        return logits.astype(dtype)

    def __call__(self, inputs: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
        return self.decode(self.encode(inputs), inputs, targets)
