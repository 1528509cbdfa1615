"""``flax_escale.context.context_attention`` in a Linen model: a grouped-query rotary attention
whose variables ``fe.init_sharded`` creates on a mesh whose sequence is split over ``sp`` has the
loss and gradients of the same module with plain softmax attention on one device, on an Auto
mesh (ring, balanced, packed documents) and an Explicit one (Ulysses with tp on the heads)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
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
from support.pipelines import QUICK_COMPILE, RULES, assert_close, at_use, mesh_of

import flax_escale as fe
from flax_escale.context import SequenceLayout, context_attention

INIT = nn.initializers.lecun_normal()


@fe.sharded_module(
    {
        "q": ("hidden_state", "head", "attention_dim"),
        "k|v": ("hidden_state", "kv_head", "attention_dim"),
        "o": ("head", "attention_dim", "hidden_state"),
    }
)
class Attention(nn.Module):
    """Rotary grouped-query attention; ``strategy=None`` is the plain one, else context."""

    strategy: str | None = None

    @nn.compact
    def __call__(self, x, positions, segment_ids=None):
        def project(name, heads):
            kernel = at_use(self.param(name, INIT, (HIDDEN, heads, DIM)))
            return jnp.einsum("bsh,hnd->bsnd", x, kernel)

        q, k = rotary(project("q", HEADS), positions), rotary(project("k", KV_HEADS), positions)
        v = project("v", KV_HEADS)
        if self.strategy is None:
            y = plain_attention(q, k, v, positions, segment_ids)
        else:
            y = context_attention(
                q, k, v, positions=positions, segment_ids=segment_ids, strategy=self.strategy
            )
        out = at_use(self.param("o", INIT, (HEADS, DIM, HIDDEN)))
        return jnp.einsum("bsnd,ndh->bsh", heads_whole(y), out)


@functools.partial(jax.jit, static_argnums=(0,), compiler_options=QUICK_COMPILE)
def loss_and_grads(strategy, params, x, positions, labels, segment_ids):
    def loss_fn(params):
        out = Attention(strategy).apply({"params": params}, x, positions, segment_ids)
        return mse(out, labels)

    return jax.value_and_grad(loss_fn)(params)


CASES = {
    # mesh, axis types, strategy, balance, packed documents
    "fsdp2_sp4-ring-dual_chunk-packed-auto": ("fsdp:2,sp:4", None, "ring", "dual_chunk", True),
    "fsdp2_tp2_sp2-ulysses-explicit": ("fsdp:2,tp:2,sp:2", "explicit", "ulysses", None, False),
}


@pytest.mark.parametrize(
    ("mesh_text", "axis_types", "strategy", "balance", "segments"), CASES.values(), ids=CASES
)
def test_context_attention_equals_plain_attention(
    mesh_text, axis_types, strategy, balance, segments
):
    mesh = mesh_of(mesh_text, axis_types)
    x, labels, positions, segment_ids = batch(segments)
    params = fe.init_sharded(Attention(strategy), mesh, 0, x, positions, segment_ids, rules=RULES)[
        "params"
    ]
    # The heads split over tp where the mesh has it, as the module's names say.
    assert params["q"].sharding.spec[1] == ("tp" if "tp" in mesh_text else None)
    # The reference: plain attention on one device, the batch in its own order.
    want = loss_and_grads(None, jax.device_get(params), x, positions, labels, segment_ids)
    # The same batch reordered once for balance; the mean loss does not see the order.
    layout = SequenceLayout(SEQ, mesh.shape["sp"], balance)
    x, labels, positions, segment_ids = layout.apply((x, labels, positions, segment_ids))
    with jax.set_mesh(mesh):
        got = loss_and_grads(strategy, params, x, positions, labels, segment_ids)
    assert_close(got, want)
