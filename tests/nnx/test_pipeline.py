"""``flax_escale.nnx.pipeline_stack``: a small Llama-like model's train step, pipelined, has the
loss and gradients of the same model's scanned step, on meshes that pair ``pp`` with fsdp, tp,
dp and ep (a mixture of experts), GPipe and circular, Auto and Explicit; its stack is born on
its stages."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support.pipelines import (
    QUICK_COMPILE,
    RULES,
    assert_born_on_stages,
    assert_close,
    at_use,
    layers_whole,
    mesh_of,
)

import flax_escale as fe
from flax_escale import moe
from flax_escale import nnx as fen
from flax_escale.errors import EscaleTypeError
from flax_escale.pipeline import PipelineError

VOCAB, HIDDEN, HEADS, MLP, SEQ, BATCH, EXPERTS = 32, 16, 2, 32, 8, 16, 4
# In the mixture of experts, ep splits the batch and the weights outside the experts.
MOE_RULES = fe.PartitionAxis(pipeline_parallel_axis="pp", ep_as_fsdp=True)
ACTIVATION = ("batch", "sequence", "hidden_state")


def dense(x: jax.Array, linear: nnx.Linear) -> jax.Array:
    return x @ at_use(linear.kernel[...])


def rms_norm(x: jax.Array, norm: nnx.RMSNorm) -> jax.Array:
    scale = at_use(norm.scale[...])
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


@fe.sharded_module(
    {
        "(q|k|v)/kernel": ("hidden_state", "head"),
        "o/kernel": ("head", "hidden_state"),
        "scale": ("hidden_state",),
    }
)
class Block(nnx.Module):
    """Causal attention, then an MLP or a mixture of experts."""

    def __init__(self, experts: int, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.q, self.k, self.v, self.o = (
            nnx.Linear(HIDDEN, HIDDEN, use_bias=False, rngs=rngs) for _ in range(4)
        )
        self.mlp_norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.mlp = Moe(rngs=rngs) if experts else Mlp(rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = rms_norm(x, self.norm)
        q, k, v = (dense(h, f).reshape(*h.shape[:2], HEADS, -1) for f in (self.q, self.k, self.v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HIDDEN // HEADS)
        causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(h.shape)
        x = fe.constrain(x + dense(mixed, self.o), ACTIVATION)
        return fe.constrain(x + self.mlp(rms_norm(x, self.mlp_norm)), ACTIVATION)


@fe.sharded_module(
    {
        "up/kernel": ("hidden_state", "mlp_intermediate"),
        "down/kernel": ("mlp_intermediate", "hidden_state"),
    }
)
class Mlp(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(HIDDEN, MLP, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(MLP, HIDDEN, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        up = jax.nn.gelu(dense(x, self.up))
        up = fe.constrain(up, ("batch", "sequence", "mlp_intermediate"))
        return dense(up, self.down)


@fe.sharded_module({"router": ("hidden_state", "expert_gate"), **moe.EXPERT_AXES})
class Moe(nnx.Module):
    """Routed experts whose load-balancing loss is off: a pipeline carries activations only."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=0)
        self.router = nnx.Param(init(rngs.params(), (1, HIDDEN, EXPERTS))[0])
        self.wi_gate = nnx.Param(init(rngs.params(), (EXPERTS, HIDDEN, MLP)))
        self.wi_up = nnx.Param(init(rngs.params(), (EXPERTS, HIDDEN, MLP)))
        self.wo = nnx.Param(init(rngs.params(), (EXPERTS, MLP, HIDDEN)))

    def __call__(self, x: jax.Array) -> jax.Array:
        experts = moe.GatedExperts(self.wi_gate[...], self.wi_up[...], self.wo[...])
        # Capacity is per sequence, so cutting the batch into microbatches drops the same.
        return moe.moe_mlp(x, self.router[...], experts, top_k=2, capacity_factor=2.0).output


@fe.sharded_module(
    {"embedding": ("vocab", "hidden_state"), "head/kernel": ("hidden_state", "vocab")}
)
class Llama(nnx.Module):
    def __init__(self, layers: int, experts: int = 0, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.blocks = fen.stack_layers(lambda rngs: Block(experts, rngs=rngs), layers, rngs)
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, schedule: dict | None) -> jax.Array:
        # A one-hot product rather than a gather: on Explicit axes it needs no out_sharding.
        table = at_use(self.embed.embedding[...])
        x = fe.constrain(jax.nn.one_hot(tokens, VOCAB) @ table, ACTIVATION)
        if schedule is None:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=fen.stacked())
            def run(x, block):
                return block(x)

            x = run(x, self.blocks)
        else:
            x = fen.pipeline_stack(self.blocks, x, **schedule)
        return dense(rms_norm(x, self.norm), self.head)


def loss_fn(model, tokens, schedule):
    logits = model(tokens[:, :-1], schedule)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@functools.partial(jax.jit, static_argnums=(3, 4, 5), compiler_options=QUICK_COMPILE)
def both_steps(state, scanned_state, tokens, graphdef, schedule, rules):
    """The pipelined step's loss and gradients, and the scanned step's."""
    with nn.logical_axis_rules(rules.logical_axis_rules()):
        return (
            nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state), tokens, dict(schedule)),
            nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, scanned_state), tokens, None),
        )


CASES = {
    # mesh (pp first), axis types, layers, experts, schedule
    "pp2_fsdp4-gpipe-explicit": ("pp:2,fsdp:4", "explicit", 4, 0, {"microbatches": 4}),
    "pp4_tp2-circular-auto": ("pp:4,tp:2", None, 8, 0, {"microbatches": 4, "repeats": 2}),
    "pp2_dp2_tp2-circular-auto": (
        "pp:2,dp:2,tp:2",
        None,
        4,
        0,
        {"microbatches": 2, "repeats": 2, "remat": "iteration"},
    ),
    "pp2_ep4-moe-gpipe-auto": ("pp:2,ep:4", None, 2, EXPERTS, {"microbatches": 2}),
}


@pytest.mark.parametrize(
    ("mesh_text", "axis_types", "layers", "experts", "schedule"), CASES.values(), ids=CASES
)
def test_pipelined_step_equals_scanned_step(mesh_text, axis_types, layers, experts, schedule):
    rules = MOE_RULES if experts else RULES
    mesh = mesh_of(mesh_text, axis_types)
    model = fe.init_sharded(Llama, mesh, 0, layers, experts, rules=rules)
    # A scan on an Explicit mesh takes a stack whose layers are whole.
    graphdef, state = nnx.split(model)
    scanned_state = state
    if axis_types == "explicit":
        scanned_state = nnx.State({**state, "blocks": layers_whole(state["blocks"], mesh)})
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)
    with jax.set_mesh(mesh):
        (loss, grads), (want_loss, want_grads) = both_steps(
            state, scanned_state, tokens, graphdef, tuple(schedule.items()), rules
        )
    assert_close((loss, nnx.to_pure_dict(grads)), (want_loss, nnx.to_pure_dict(want_grads)))

    stack = jax.tree.leaves(nnx.state(model.blocks))
    assert_born_on_stages(stack, mesh, layers)
    # The stacked dimension keeps its logical name, which nnx.scan(transform_metadata=stacked())
    # looks for, though it is on pp.
    assert model.blocks.q.kernel.get_metadata("out_sharding")[0] == "layers"
    # The stack's gradients stay on their stages (their other dimensions are XLA's choice).
    for grad in jax.tree.leaves(grads["blocks"]):
        assert grad.sharding.spec[0] == "pp", grad.sharding


def test_mistakes():
    mesh = mesh_of("pp:2,fsdp:4")
    stack = fen.stack_layers(lambda rngs: nnx.Linear(4, 4, rngs=rngs), 4, nnx.Rngs(0))
    x = jnp.ones((8, 4))
    with pytest.raises(
        EscaleTypeError,
        match=r"(?s)stack must be a stacked nnx\.Module \(stack_layers, nnx\.vmap\), got dict "
        r".*; a pytree of stacked arrays runs with flax_escale\.pipeline\.pipeline\(",
    ):
        fen.pipeline_stack({"kernel": jnp.ones((4, 4, 4))}, x, microbatches=2, mesh=mesh)
    # The uneven cases, as an NNX model meets them: the numbers and the fix.
    with pytest.raises(
        PipelineError,
        match=r"the stack has 4 layers, which 2 stages x 4 repeats \(8 chunks of equal size\) "
        r"cannot split evenly: use stages dividing 4 / 4 = 1 \(1\)",
    ):
        fen.pipeline_stack(stack, x, microbatches=2, repeats=4, mesh=mesh)
    with pytest.raises(
        PipelineError, match=r"microbatches=3 is not a multiple of the 2 stages.*microbatches=2"
    ):
        fen.pipeline_stack(stack, x, microbatches=3, mesh=mesh)
    with pytest.raises(
        PipelineError, match=r"a batch of 8 rows cannot be cut into 16 equal microbatches"
    ):
        fen.pipeline_stack(stack, x, microbatches=16, mesh=mesh)
