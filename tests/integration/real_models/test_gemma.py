"""Flax's NNX Gemma (its own ``ShardingConfig`` of mesh-axis specs), unchanged, on Explicit axes.

The example builds its mesh with ``jax.make_mesh`` (Explicit axes) and names mesh axes directly
in ``out_sharding`` metadata and in each projection's ``out_sharding=`` argument; its
``ShardingConfig.fsdp_tp_sharding()`` defaults to the axis names ``fsdp`` and ``tp``, which
are the library's. The model is built with ``fe.init_sharded`` on Explicit versions of the
three meshes, with no rules at all: its own annotations decide. Training runs under
``fe.use_sharding`` with the batch placed by the library's data helpers.

Where the library's default batch layout meets the model's activation specs, this file shows
what happens (``test_default_batch_layout_*``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from support import MESHES
from support.real_models import gemma_model as gm
from support.real_models.harness import (
    KEY,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    SLACK,
    assert_bit_equal,
    assert_close,
    assert_ideal_share,
    compile_quick,
    place_batch,
    run_steps,
    token_batch,
)

import flax_escale as fe
from flax_escale import nnx as fen

pytestmark = [pytest.mark.slow, pytest.mark.xla]

SHD = gm.ShardingConfig.fsdp_tp_sharding()  # the example's layout; its axes are fsdp and tp
CONFIG = gm.small_config(SHD)
UNSHARDED = gm.small_config()  # ShardingConfig.no_sharding(): the same model, no layout
TOKENS = token_batch(seed=3)
TX = optax.sgd(0.5, momentum=0.9)
# Gemma's data_sharding is ('fsdp',): the batch goes where the model's activations put it.
BATCH_RULES = [("batch", SHD.fsdp_axis_name)]


def explicit_mesh(mesh_name):
    return fe.create_mesh(MESHES[mesh_name], axis_types="explicit")


def gemma_loss(model, tokens):
    """Next-token cross entropy as the example computes it (one-hot, so vocab stays sharded)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = inputs > 0
    positions = gm.build_positions_from_mask(mask)
    logits = model(inputs, positions, gm.make_causal_attn_mask(mask))
    one_hot = jax.nn.one_hot(targets, logits.shape[-1])
    per_token = -jnp.sum(one_hot * jax.nn.log_softmax(logits), axis=-1)
    weights = mask & (targets > 0)
    return jnp.sum(per_token * weights) / jnp.sum(weights)


def train_step(graphdef):
    """The example's plain-jax step (``use_nnx_transforms="no"``): split, grad, update."""

    def step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        model_def, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            return gemma_loss(nnx.merge(model_def, params, rest), tokens)

        value, grads = jax.value_and_grad(loss)(params)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), value

    return step


def train(model, optimizer, tokens):
    graphdef, state = nnx.split((model, optimizer))
    step = compile_quick(jax.jit(train_step(graphdef)), state, tokens)
    state, losses = run_steps(step, state, tokens)
    trained, _ = nnx.merge(graphdef, state)
    return trained, losses


def values(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@functools.cache
def reference():
    # The key is an argument, as init_sharded passes it: a seed made inside the jitted function
    # would be a constant, and XLA folds constants with rounding of its own.
    model = nnx.jit(lambda key: gm.Transformer(UNSHARDED, rngs=nnx.Rngs(key)))(KEY)
    initial = values(model)
    trained, losses = train(model, nnx.Optimizer(model, TX, wrt=nnx.Param), TOKENS)
    return {"initial": initial, "params": values(trained), "losses": losses}


@functools.cache
def sharded(mesh_name):
    mesh = explicit_mesh(mesh_name)
    result = {}
    if mesh_name == "fsdp8":
        # The compiled init, measured on the Auto mesh of the same shape (fe.create_mesh's
        # default), and its values.
        auto = fe.create_mesh(MESHES[mesh_name])
        compiled = fe.lower_init(gm.Transformer, auto, KEY, CONFIG).compile()
        result["memory"] = compiled.memory_analysis()
        result["auto"] = nnx.to_pure_dict(compiled(KEY))
    model = fe.init_sharded(gm.Transformer, mesh, KEY, CONFIG)
    result["initial"] = values(model)
    optimizer = fen.init_optimizer(model, TX, wrt=nnx.Param)
    result["opt_state"] = nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState))
    batch = place_batch(mesh, TOKENS, logical_axes=("batch", None), rules=BATCH_RULES)
    result["batch"] = batch
    with fe.use_sharding(mesh):
        trained, result["losses"] = train(model, optimizer, batch)
    result["params"] = values(trained)
    result["model"], result["optimizer"] = model, optimizer  # as built (training is functional)
    return result


def test_the_models_own_annotations_decide_on_every_mesh():
    for mesh_name in MESHES:
        plan = fe.plan_sharding(gm.Transformer, explicit_mesh(mesh_name), KEY, CONFIG)
        assert plan.corrections == ()
        # Only qk-norm scales carry no out_sharding in the example (they stay replicated).
        assert all(
            path.endswith(("_query_norm/scale", "_key_norm/scale")) for path in plan.unannotated
        )
        assert len(plan.unannotated) == 4
        block = "layers/0"
        assert plan["embedder/embedding"].spec == SHD.emb_vd
        assert plan[f"{block}/attn/q_einsum/kernel"].spec == SHD.q_weight_ndh
        assert plan[f"{block}/attn/kv_einsum/kernel"].spec == SHD.kv_weight_cndh
        assert plan[f"{block}/attn/attn_vec_einsum/kernel"].spec == SHD.o_weight_nhd
        assert plan[f"{block}/mlp/gate_proj/kernel"].spec == SHD.ffw_weight_df
        assert plan[f"{block}/mlp/down_proj/kernel"].spec == SHD.ffw_weight_fd
        assert plan[f"{block}/pre_ffw_norm/scale"].spec == SHD.rms_norm_weight
        # The same plan on the Auto mesh of the same shape.
        auto = fe.plan_sharding(gm.Transformer, fe.create_mesh(MESHES[mesh_name]), KEY, CONFIG)
        assert [e.spec for e in auto] == [e.spec for e in plan]


def test_the_fused_qkv_path_is_annotated_too():
    config = gm.small_config(SHD, num_kv_heads=4)
    plan = fe.plan_sharding(gm.Transformer, explicit_mesh("fsdp4_tp2"), KEY, config)
    assert plan["layers/1/attn/qkv_einsum/kernel"].spec == SHD.qkv_weight_cndh
    assert plan["layers/1/attn/qkv_einsum/kernel"].shape == (3, 4, 64, 16)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_init_is_bit_equal_to_unsharded(mesh_name):
    result = sharded(mesh_name)
    assert assert_bit_equal(result["initial"], reference()["initial"]) == 26
    kernel = result["initial"]["layers"][0]["attn"]["q_einsum"]["kernel"]
    assert kernel.sharding.spec == SHD.q_weight_ndh
    assert kernel.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 5


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_three_steps_match_unsharded(mesh_name):
    result, expected = sharded(mesh_name), reference()
    assert result["batch"].sharding.spec == P(SHD.act_btd[0], None)  # the model's batch axis
    np.testing.assert_allclose(result["losses"], expected["losses"], **LOSS_TOLERANCE)
    assert result["losses"][-1] < result["losses"][0] - 0.1
    assert_close(result["params"], expected["params"], **PARAM_TOLERANCE)
    pairs = zip(jax.tree.leaves(result["initial"]), jax.tree.leaves(result["params"]), strict=True)
    assert not [a.shape for a, b in pairs if a.ndim > 1 and np.array_equal(a, b)]


def test_each_device_holds_about_an_eighth_on_fsdp8():
    result = sharded("fsdp8")
    largest, total = assert_ideal_share(result["initial"])
    # The RMSNorm scales are split over tp only (size 1 here): replicated, a few hundred bytes.
    assert largest > total // 8
    assert_ideal_share(result["opt_state"])
    output = result["memory"].output_size_in_bytes
    assert total / 8 <= output <= SLACK * total / 8, (output, total)
    # On Auto axes the compiled init is bit-equal to the unsharded one.
    assert assert_bit_equal(result["auto"], reference()["initial"]) == 26


def test_default_batch_layout_clashes_with_the_models_activations_on_dp2():
    """With dp=2 the library's default batch layout, over (fsdp, dp), is not the model's.

    Gemma's activations are split over fsdp only (``act_btd = P('fsdp', None, 'tp')``); on
    Explicit axes JAX refuses to combine the two layouts while tracing, and says which. The
    library cannot see the model's activation specs, so the fix is the user's: send ``batch``
    where the model puts it (``BATCH_RULES``, as the example's ``data_sharding``), as the
    training tests above do.
    """
    mesh = explicit_mesh("dp2_fsdp2_tp2")
    batch = place_batch(mesh, TOKENS)
    assert batch.sharding.spec[0] == ("fsdp", "dp") != SHD.act_btd[0]
    built = sharded("dp2_fsdp2_tp2")
    graphdef, state = nnx.split((built["model"], built["optimizer"]))
    with fe.use_sharding(mesh), pytest.raises(Exception, match=CLASH):
        jax.jit(train_step(graphdef)).trace(state, batch)


# What JAX says: the sequence axis carries 'sp' (size 1, but part of the type), or the batch
# axis carries ('fsdp', 'dp') where the model's activations carry 'fsdp'.
CLASH = r"unsharded over the axis being reduced|incompatible shardings"


def test_default_batch_layout_agrees_when_dp_and_sp_have_size_1():
    # On Explicit axes batch_sharding leaves size-1 axes (dp, sp) out of the spec: JAX would
    # type them as splits, and the sequence's cumulative sum would be refused.
    mesh = explicit_mesh("fsdp4_tp2")
    batch = place_batch(mesh, TOKENS)
    assert batch.sharding.spec == P("fsdp", None)
    built = sharded("fsdp4_tp2")
    graphdef, state = nnx.split((built["model"], built["optimizer"]))
    with fe.use_sharding(mesh):
        jax.jit(train_step(graphdef)).trace(state, batch)
