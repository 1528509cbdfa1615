"""``flax_escale.context.context_attention`` in an NNX model: a grouped-query rotary attention
built with ``fe.init_sharded`` on a mesh whose sequence is split over ``sp`` has the loss and
gradients of the same model with plain softmax attention on one device, for each strategy,
balanced or not, with packed documents, on Auto and Explicit meshes, with tp on the heads; in a
layer stack run by ``nnx.scan`` under ``nnx.remat``; and in a stack pipelined over ``pp``."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from support.contexts import (
    DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    SEQ,
    batch,
    heads_whole,
    mse,
    plain_attention,
    rotary,
)
from support.pipelines import QUICK_COMPILE, RULES, assert_close, at_use, layers_whole, mesh_of

import flax_escale as fe
from flax_escale import nnx as fen
from flax_escale.context import SequenceLayout, context_attention


@fe.sharded_module(
    {
        "q/kernel": ("hidden_state", "head", "attention_dim"),
        "(k|v)/kernel": ("hidden_state", "kv_head", "attention_dim"),
        "o/kernel": ("head", "attention_dim", "hidden_state"),
    }
)
class Attention(nnx.Module):
    """Rotary grouped-query attention; ``strategy=None`` is the plain one, else context."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.q = nnx.LinearGeneral(HIDDEN, (HEADS, DIM), use_bias=False, rngs=rngs)
        self.k = nnx.LinearGeneral(HIDDEN, (KV_HEADS, DIM), use_bias=False, rngs=rngs)
        self.v = nnx.LinearGeneral(HIDDEN, (KV_HEADS, DIM), use_bias=False, rngs=rngs)
        self.o = nnx.LinearGeneral((HEADS, DIM), HIDDEN, axis=(-2, -1), use_bias=False, rngs=rngs)

    def __call__(self, x, positions, segment_ids=None, strategy=None):
        def project(linear):
            return jnp.einsum("bsh,hnd->bsnd", x, at_use(linear.kernel[...]))

        q, k = rotary(project(self.q), positions), rotary(project(self.k), positions)
        v = project(self.v)
        if strategy is None:
            y = plain_attention(q, k, v, positions, segment_ids)
        else:
            y = context_attention(
                q, k, v, positions=positions, segment_ids=segment_ids, strategy=strategy
            )
        return jnp.einsum("bsnd,ndh->bsh", heads_whole(y), at_use(self.o.kernel[...]))


@functools.partial(jax.jit, static_argnums=(0, 5), compiler_options=QUICK_COMPILE)
def loss_and_grads(graphdef, state, x, positions, labels, strategy, segment_ids):
    def loss_fn(model):
        return mse(model(x, positions, segment_ids, strategy), labels)

    loss, grads = nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state))
    return loss, nnx.to_pure_dict(grads)


CASES = {
    # mesh, axis types, strategy, balance, packed documents
    "fsdp2_sp4-ring-dual_chunk-packed-auto": ("fsdp:2,sp:4", None, "ring", "dual_chunk", True),
    "fsdp2_tp2_sp2-all_gather-explicit": (
        "fsdp:2,tp:2,sp:2",
        "explicit",
        "all_gather",
        None,
        False,
    ),
    "fsdp2_sp4-ulysses-striped-explicit": ("fsdp:2,sp:4", "explicit", "ulysses", "striped", False),
}


@pytest.mark.parametrize(
    ("mesh_text", "axis_types", "strategy", "balance", "segments"), CASES.values(), ids=CASES
)
def test_context_attention_equals_plain_attention(
    mesh_text, axis_types, strategy, balance, segments
):
    mesh = mesh_of(mesh_text, axis_types)
    model = fe.init_sharded(Attention, mesh, 0, rules=RULES)
    graphdef, state = nnx.split(model)
    x, labels, positions, segment_ids = batch(segments)
    # The reference: plain attention on one device, the batch in its own order.
    want = loss_and_grads(graphdef, jax.device_get(state), x, positions, labels, None, segment_ids)
    # The same batch reordered once for balance; the mean loss does not see the order.
    layout = SequenceLayout(SEQ, mesh.shape["sp"], balance)
    x, labels, positions, segment_ids = layout.apply((x, labels, positions, segment_ids))
    with jax.set_mesh(mesh):
        got = loss_and_grads(graphdef, state, x, positions, labels, strategy, segment_ids)
    assert_close(got, want)


LAYERS, STACK_BATCH = 2, 4


@fe.sharded_module({})
class Block(nnx.Module):
    """A residual attention layer that sees only its activations, as a pipeline calls it: its
    tokens' positions are those of the balanced layout the batch was put in (or in order)."""

    def __init__(self, strategy, layout, *, rngs: nnx.Rngs):
        self.strategy, self.layout = strategy, layout
        self.attention = Attention(rngs=rngs)

    def __call__(self, x):
        positions = jnp.asarray(self.layout.positions(x.shape[0]))
        return x + self.attention(x, positions, None, self.strategy)


class Stack(nnx.Module):
    def __init__(self, strategy, layout, *, rngs: nnx.Rngs):
        self.blocks = fen.stack_layers(
            lambda rngs: Block(strategy, layout, rngs=rngs), LAYERS, rngs
        )

    def __call__(self, x, schedule):
        if schedule is None:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=fen.stacked())
            @nnx.remat
            def run(x, block):
                return block(x)

            return run(x, self.blocks)
        return fen.pipeline_stack(self.blocks, x, **dict(schedule))


@functools.partial(jax.jit, static_argnums=(0, 4), compiler_options=QUICK_COMPILE)
def stack_loss_and_grads(graphdef, state, x, labels, schedule):
    def loss_fn(model):
        return mse(model(x, schedule), labels)

    loss, grads = nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state))
    return loss, nnx.to_pure_dict(grads)


STACKS = {
    # mesh, axis types, strategy, schedule (None: nnx.scan under nnx.remat)
    "fsdp2_sp4-scan-remat-ulysses-auto": ("fsdp:2,sp:4", None, "ulysses", None),
    "pp2_fsdp2_sp2-pipeline-ring-auto": ("pp:2,fsdp:2,sp:2", None, "ring", {"microbatches": 2}),
    "pp2_tp2_sp2-pipeline-all_gather-explicit": (
        "pp:2,tp:2,sp:2",
        "explicit",
        "all_gather",
        {"microbatches": 2, "remat": "layer"},
    ),
}


@pytest.mark.parametrize(
    ("mesh_text", "axis_types", "strategy", "schedule"), STACKS.values(), ids=STACKS
)
def test_context_attention_in_a_layer_stack(mesh_text, axis_types, strategy, schedule):
    mesh = mesh_of(mesh_text, axis_types)
    layout = SequenceLayout(SEQ, mesh.shape["sp"], "dual_chunk")
    model = fe.init_sharded(Stack, mesh, 0, strategy, layout, rules=RULES)
    graphdef, state = nnx.split(model)
    x, labels = jax.random.normal(jax.random.key(1), (2, STACK_BATCH, SEQ, HIDDEN))
    # The reference: the same weights scanned with plain attention on one device, in order.
    plain = nnx.graphdef(
        nnx.eval_shape(lambda: Stack(None, SequenceLayout(SEQ, 1, None), rngs=nnx.Rngs(0)))
    )
    want = stack_loss_and_grads(plain, jax.device_get(state), x, labels, None)
    x, labels = layout.apply((x, labels))
    if axis_types == "explicit":
        # On Explicit axes the activations are split over sp from the start, as the layer's
        # output is (a pipeline's stages return what they receive).
        x = jax.device_put(
            x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sp"))
        )
        if schedule is None:
            state = nnx.State({"blocks": layers_whole(state["blocks"], mesh)})
    with jax.set_mesh(mesh):
        got = stack_loss_and_grads(graphdef, state, x, labels, schedule and tuple(schedule.items()))
    assert_close(got, want)
