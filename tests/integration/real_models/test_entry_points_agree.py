"""Every entry point gives the same spec for every annotated parameter (one pipeline).

For the example models, the real-model tests' models and GPT-2-XL widths, on three meshes,
``plan_sharding``, ``lower_init`` (its lowered output shardings), ``init_sharded`` (the arrays
it makes; not for GPT-2-XL, compiled only) and Flax's idiom
``logical_to_mesh_sharding(jax.eval_shape(init), mesh)`` agree leaf for leaf.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from support import MESHES, example_modules
from support.real_models import gemma_model, lm1b_model, wmt_model
from support.real_models.wmt_annotated import AnnotatedTransformer

import flax_escale as fe

pytestmark = pytest.mark.slow

# Every entry point, one spec.


def _linen_gpt(config):
    gpt = example_modules.load("linen_gpt")
    return gpt.Gpt(config(gpt)), jax.random.key(0), jnp.zeros((2, 16), jnp.int32)


def _lm1b(scan):
    config = lm1b_model.small_config(scan_layers=scan)
    return lm1b_model.TransformerLM(config), jax.random.key(0), jnp.zeros((2, 16), jnp.int32)


def _wmt():
    # The example as written carries no annotation: its test's sharded_module subclass does.
    tokens = jnp.zeros((2, 16), jnp.int32)
    return AnnotatedTransformer(wmt_model.small_config()), jax.random.key(0), tokens, tokens


def _nnx_llama():
    llama = example_modules.load("nnx_llama")
    return functools.partial(llama.Llama, llama.Config()), 0


def _gemma():
    # The example's own layout (mesh axes in out_sharding metadata); its default has none.
    config = gemma_model.small_config(gemma_model.ShardingConfig.fsdp_tp_sharding())
    return functools.partial(gemma_model.Transformer, config), 0


T5X = fe.PartitionAxis().with_aliases("t5x")
GPT2_XL = {"vocab": 50257, "hidden": 1600, "heads": 25, "head_dim": 64, "mlp": 6400}
MODELS = {
    "linen_gpt": (lambda: _linen_gpt(lambda gpt: gpt.Config()), None, True),
    "gpt2_xl": (
        lambda: _linen_gpt(lambda gpt: gpt.Config(**GPT2_XL, layers=2, max_len=1024)),
        None,
        False,
    ),
    "lm1b": (lambda: _lm1b(False), T5X, True),
    "lm1b_scanned": (lambda: _lm1b(True), T5X, True),
    "wmt": (_wmt, T5X, True),
    "nnx_llama": (_nnx_llama, None, True),
    "gemma": (_gemma, None, True),
}


def _abstract(model, rng, *args):
    if isinstance(model, nn.Module):
        return jax.eval_shape(model.init, rng, *args)
    # No mesh to create variables on: out_sharding metadata is read, not applied.
    with nnx.use_eager_sharding(False):
        return nnx.state(nnx.eval_shape(lambda: model(*args, rngs=nnx.Rngs(rng))))


def _specs(tree):
    # NamedShardings, or the lowered program's outputs (ShapeDtypeStructs carrying one).
    return [getattr(leaf, "sharding", leaf).spec for leaf in jax.tree.leaves(tree)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("model_name", MODELS)
def test_every_entry_point_gives_the_same_spec(model_name, mesh_name):
    make, rules, materialize = MODELS[model_name]
    model, *args = make()
    mesh = fe.create_mesh(MESHES[mesh_name])
    with warnings.catch_warnings():
        # 25 heads and a 50,257-token vocabulary do not divide every mesh: corrections warn.
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        plan = fe.plan_sharding(model, mesh, *args, rules=rules)
        lowered = fe.lower_init(model, mesh, *args, rules=rules)
        flax_idiom = fe.logical_to_mesh_sharding(_abstract(model, *args), mesh, rules)
        made = fe.init_sharded(model, mesh, *args, rules=rules) if materialize else None
    planned = [entry.spec for entry in plan]
    assert any(entry.annotation is not None for entry in plan)
    assert _specs(lowered.out_info) == planned
    assert _specs(flax_idiom) == planned
    if made is not None:
        arrays = made if isinstance(model, nn.Module) else nnx.state(made)
        assert [x.sharding.spec for x in jax.tree.leaves(arrays)] == planned
