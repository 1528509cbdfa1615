"""``flax_escale.linen.pipelined``: a small GPT-like model's train step, its ``nn.scan`` stack
run as a pipeline, has the loss and gradients of the scanned step with the same parameters,
GPipe and circular, Auto and Explicit; its stack is born on its stages; uneven cases and
per-layer outputs are refused with the numbers and the fix."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
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
from flax_escale import linen as fel
from flax_escale.errors import EscaleTypeError
from flax_escale.pipeline import PipelineError

VOCAB, HIDDEN, HEADS, MLP, SEQ, BATCH = 32, 16, 2, 32, 8, 16
ACTIVATION = ("batch", "sequence", "hidden_state")
INIT = nn.initializers.lecun_normal()


class Dense(nn.Module):
    """A kernel gathered at use on an Explicit mesh (``nn.Dense`` would use it fsdp-split)."""

    features: int

    @nn.compact
    def __call__(self, x):
        return x @ at_use(self.param("kernel", INIT, (x.shape[-1], self.features)))


class LayerNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = at_use(self.param("scale", nn.initializers.ones, (x.shape[-1],)))
        centred = x - x.mean(-1, keepdims=True)
        return centred * jax.lax.rsqrt((centred**2).mean(-1, keepdims=True) + 1e-6) * scale


@fe.sharded_module(
    {
        "(query|key|value)/kernel": ("hidden_state", "head"),
        "out/kernel": ("head", "hidden_state"),
        "wi/kernel": ("hidden_state", "mlp_intermediate"),
        "wo/kernel": ("mlp_intermediate", "hidden_state"),
        "scale": ("hidden_state",),
    }
)
class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = LayerNorm(name="ln_attention")(x)
        q, k, v = (
            Dense(HIDDEN, name=n)(h).reshape(*h.shape[:2], HEADS, -1)
            for n in ("query", "key", "value")
        )
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], bool))
        y = nn.dot_product_attention(q, k, v, mask=mask).reshape(x.shape)
        x = fe.constrain(x + Dense(HIDDEN, name="out")(y), ACTIVATION)
        h = nn.gelu(Dense(MLP, name="wi")(LayerNorm(name="ln_mlp")(x)))
        h = fe.constrain(h, ("batch", "sequence", "mlp_intermediate"))
        return fe.constrain(x + Dense(HIDDEN, name="wo")(h), ACTIVATION), None


@fe.sharded_module(
    {"embedding": ("vocab", "hidden_state"), "head/kernel": ("hidden_state", "vocab")}
)
class Gpt(nn.Module):
    layers: int
    schedule: tuple = ()  # pipelined()'s options as items; () scans the stack

    @nn.compact
    def __call__(self, tokens):
        table = at_use(self.param("embedding", INIT, (VOCAB, HIDDEN)))
        # A one-hot product rather than a gather: on Explicit axes it needs no out_sharding.
        x = fe.constrain(jax.nn.one_hot(tokens, VOCAB) @ table, ACTIVATION)
        if self.schedule:
            stack = fel.pipelined(Block, self.layers, **dict(self.schedule))
        else:
            stack = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
        x, _ = stack(name="blocks")(x, None)
        return Dense(VOCAB, name="head")(LayerNorm(name="ln_final")(x))


def loss_fn(params, model, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


TOKENS = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, VOCAB)

# Each schedule and axis type once; tests/nnx/test_pipeline.py runs every mesh of the issue.
CASES = {
    # mesh (pp first), axis types, layers, pipelined()'s options
    "pp4_tp2-circular-explicit": ("pp:4,tp:2", "explicit", 8, {"microbatches": 4, "repeats": 2}),
    "pp2_fsdp4-gpipe-auto": ("pp:2,fsdp:4", None, 4, {"microbatches": 4, "remat": "layer"}),
}


@pytest.mark.parametrize(
    ("mesh_text", "axis_types", "layers", "schedule"), CASES.values(), ids=CASES
)
def test_pipelined_step_equals_scanned_step(mesh_text, axis_types, layers, schedule):
    mesh = mesh_of(mesh_text, axis_types)
    params = fe.init_sharded(Gpt(layers), mesh, 0, TOKENS[:, :-1], rules=RULES)["params"]
    # A scan on an Explicit mesh takes a stack whose layers are whole.
    whole = params
    if axis_types == "explicit":
        whole = {**params, "blocks": layers_whole(params["blocks"], mesh)}
    pipelined, scanned = Gpt(layers, tuple(schedule.items())), Gpt(layers)

    @functools.partial(jax.jit, compiler_options=QUICK_COMPILE)
    def both_steps(params, whole, tokens):
        with nn.logical_axis_rules(RULES.logical_axis_rules()):
            return (
                jax.value_and_grad(loss_fn)(params, pipelined, tokens),
                jax.value_and_grad(loss_fn)(whole, scanned, tokens),
            )

    with jax.set_mesh(mesh):
        got, want = both_steps(params, whole, TOKENS)
    assert_close(got, want)
    assert_born_on_stages(jax.tree.leaves(params["blocks"]), mesh, layers)


class Routed(nn.Module):
    """A block with a per-layer output (a mixture of experts' auxiliary loss, say)."""

    @nn.compact
    def __call__(self, x, _):
        y = nn.Dense(x.shape[-1])(x)
        return y, jnp.mean(y**2)


def test_mistakes():
    mesh = mesh_of("pp:2,fsdp:4")
    x = jnp.ones((8, HIDDEN))
    variables = nn.scan(
        Routed, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
    )().init(jax.random.key(0), x, None)
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            PipelineError,
            match=r"Routed returns a per-layer output besides the activations \(.*\); a pipeline "
            r"carries the activations only: return \(x, None\), or run this stack with nn\.scan",
        ),
    ):
        fel.pipelined(Routed, 4, microbatches=2)().apply(variables, x, None)
    # The uneven cases, as a Linen model meets them.
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            PipelineError, match=r"a batch of 8 rows cannot be cut into 16 equal microbatches"
        ),
    ):
        fel.pipelined(Routed, 4, microbatches=16)().apply(variables, x, None)
    with (
        jax.set_mesh(mesh),
        pytest.raises(PipelineError, match=r"the stack has 4 layers, which 2 stages x 4 repeats"),
    ):
        fel.pipelined(Routed, 4, microbatches=2, repeats=4)().apply(variables, x, None)
    with pytest.raises(EscaleTypeError, match=r"pass the class \(Block\), not an instance"):
        fel.pipelined(Routed(), 4, microbatches=2)
