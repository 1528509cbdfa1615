"""The real models and a Llama-shaped decoder as planner workloads: model, optimizer, step.

What ``support.reshardings.step_reshardings`` compiles on every candidate mesh (each factory is
called in a fresh process). The real models train as their tests train them (SGD with
momentum, the next-token loss; lm1b and wmt with the t5x aliases of the library's vocabulary,
Gemma with its own fsdp and tp layout and its batch over ``fsdp``); ``llama`` is the NNX
example at Llama's vocabulary (32,000) and a width that keeps a compile short.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import flax_escale as fe
from flax_escale.sizing import Workload
from support.example_modules import load
from support.real_models import gemma_model as gm
from support.real_models import lm1b_model as lm
from support.real_models import wmt_model
from support.real_models.harness import lm_loss

BATCH, LENGTH = 8, 16
TX = optax.sgd(0.5, momentum=0.9)
T5X_RULES = fe.PartitionAxis().with_aliases("t5x")
TOKENS = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)


def lm1b() -> Workload:
    """Flax's lm1b decoder, its layers scanned; it shifts the inputs itself: they are the labels."""
    model = lm.TransformerLM(lm.small_config(scan_layers=True))
    return Workload(model, jax.random.key(0), (TOKENS,), tx=TX, loss=lm_loss, rules=T5X_RULES)


def wmt() -> Workload:
    """Flax's wmt encoder-decoder, embeddings shared and logits tied, as the example has them."""
    model = wmt_model.Transformer(wmt_model.small_config(num_layers=1))
    return Workload(
        model,
        jax.random.key(0),
        (TOKENS, TOKENS),
        tx=TX,
        loss=lambda logits, inputs, targets: lm_loss(logits, targets),
        rules=T5X_RULES,
    )


def _gemma_loss(model: gm.Transformer, tokens: jax.Array) -> jax.Array:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = inputs > 0
    logits = model(inputs, gm.build_positions_from_mask(mask), gm.make_causal_attn_mask(mask))
    return lm_loss(logits, targets)


def _gemma_step(model: gm.Transformer, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(_gemma_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss


def gemma() -> Workload:
    """Gemma 3's structure at small widths, laid out by the example's own fsdp and tp config."""
    shd = gm.ShardingConfig.fsdp_tp_sharding()
    return Workload(
        gm.Transformer,
        0,
        (gm.small_config(shd),),
        tx=TX,
        batch=(jax.ShapeDtypeStruct((BATCH, LENGTH + 1), jnp.int32),),
        step=_gemma_step,
        rules=[("batch", shd.fsdp_axis_name)],
    )


LLAMA_LENGTH = 65


def llama() -> Workload:
    """The NNX example at Llama's vocabulary, 4 layers of width 512 (8 heads), 64 tokens.

    The layout, not the length, is what the surveys check: 64 tokens (65 read, the labels
    shifted) keep the odd length that ``sp`` does not divide, at half the TPU compiler's time
    of 256.
    """
    example = load("nnx_llama")
    return example.workload(_llama_config(example), batch=16, length=LLAMA_LENGTH)


def _llama_config(example: ModuleType) -> Any:
    return example.Config(
        vocab=32_000, hidden=512, heads=8, kv_heads=8, head_dim=64, mlp=1_376, layers=4
    )


def lm1b_gathered() -> Workload:
    """:func:`lm1b` with each parameter gathered where the model reads it (``gather_at_use``)."""
    return dataclasses.replace(lm1b(), gather_at_use=True)


def llama_64() -> Workload:
    """:func:`llama` with a batch of 64 sequences, which splits over 64 devices."""
    example = load("nnx_llama")
    return example.workload(_llama_config(example), batch=64, length=LLAMA_LENGTH)
