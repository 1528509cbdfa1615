"""A small Llama-style decoder in Flax NNX, annotated once with logical names, trained sharded.

Run it with ``python examples/nnx_llama.py``: on 8 simulated CPU devices whatever the host has,
or with ``--devices accelerator`` on the host's GPUs or TPUs (its first line says which). It
builds a 2 x 2 x 2 dp x fsdp x tp mesh (on accelerators: every device on fsdp), builds the
model (RMSNorm, rotary attention with grouped-query heads, SwiGLU MLP, a layer stack made with
``nnx.vmap`` and run with ``nnx.scan``) and its AdamW state directly sharded, prints the
sharding plan, and trains a few steps on a toy next-token task (count upwards modulo the
vocabulary) so the loss visibly falls. A mesh with a ``pp`` axis (``--mesh pp:2,fsdp:2,tp:2``)
runs the layer stack as a pipeline over it instead (``--microbatches``, ``--repeats``,
``--remat``; see ``pipeline_options.py``) and prints its schedule beside the plan. A mesh with
an ``sp`` axis and ``--context-parallel`` (``--mesh fsdp:2,sp:4 --context-parallel ring --seq
64``) splits the sequence over ``sp`` with attention exchanging keys and values by that
strategy, the batch reordered to balance the causal mask (``--balance``; see
``context_options.py``), and prints the strategy, the balance and the bytes beside the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import backend_choice
import context_options
import jax
import jax.numpy as jnp
import optax
import pipeline_options
import toy_data
from flax import nnx

import flax_escale as fe
from flax_escale import nnx as fen
from flax_escale.context import context_attention
from flax_escale.sizing import Workload

ACTIVATION = ("batch", "sequence", "hidden_state")
# Rows of an embedding table as looked up: the features whole (see the model's lookup).
LOOKED_UP = ("batch", "sequence", None)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    layers: int = 2
    rope_base: float = 10_000.0
    # A pipeline over the mesh's pp axis (flax_escale.nnx.pipeline_stack) when microbatches is
    # set; None scans the stack.
    microbatches: int | None = None
    repeats: int = 1
    remat: str | None = None
    # Attention by flax_escale.context.context_attention with this strategy ("all_gather",
    # "ring", "ulysses" or "auto"), the batch's positions given; None leaves it to XLA.
    context_parallel: str | None = None


def rotary(x: jax.Array, base: float, positions: jax.Array | None = None) -> jax.Array:
    """Rotates pairs of features by a position-dependent angle (RoPE); x is (b, s, h, d).

    ``positions`` (b, s) are the tokens' positions, for a batch in another order than the
    sequence's (context parallelism's balanced layout); ``None``: 0, 1, ... in order.
    """
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half) / half)
    if positions is None:
        positions = jnp.arange(x.shape[1])[None, :]
    angles = positions[..., None] * freqs
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@fe.sharded_module(
    {
        "q_proj/kernel": ("hidden_state", "head", "attention_dim"),
        "(k_proj|v_proj)/kernel": ("hidden_state", "kv_head", "attention_dim"),
        "o_proj/kernel": ("head", "attention_dim", "hidden_state"),
    }
)
class Attention(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.c = c
        self.q_proj = nnx.LinearGeneral(c.hidden, (c.heads, c.head_dim), use_bias=False, rngs=rngs)
        kv = (c.kv_heads, c.head_dim)
        self.k_proj = nnx.LinearGeneral(c.hidden, kv, use_bias=False, rngs=rngs)
        self.v_proj = nnx.LinearGeneral(c.hidden, kv, use_bias=False, rngs=rngs)
        self.o_proj = nnx.LinearGeneral(
            (c.heads, c.head_dim), c.hidden, axis=(-2, -1), use_bias=False, rngs=rngs
        )

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        c = self.c
        q = rotary(self.q_proj(x), c.rope_base, positions)
        k = rotary(self.k_proj(x), c.rope_base, positions)
        v = self.v_proj(x)
        q = fe.constrain(q, ("batch", "sequence", "head", "attention_dim"))
        k = fe.constrain(k, ("batch", "sequence", "kv_head", "attention_dim"))
        if c.context_parallel:
            # Each device holds its share of the sequence: the strategy brings it the keys and
            # values it attends to, the mask coming from the positions (any order, balanced).
            y = context_attention(q, k, v, positions=positions, strategy=c.context_parallel)
        else:
            groups = c.heads // c.kv_heads
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(c.head_dim).astype(q.dtype)
            causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
            y = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.o_proj(fe.constrain(y, ("batch", "sequence", "head", "attention_dim")))


@fe.sharded_module(
    {
        "(gate|up)/kernel": ("hidden_state", "mlp_intermediate"),
        "down/kernel": ("mlp_intermediate", "hidden_state"),
    }
)
class SwiGlu(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(c.hidden, c.mlp, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.hidden, c.mlp, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c.mlp, c.hidden, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.silu(self.gate(x)) * self.up(x)
        return self.down(fe.constrain(h, ("batch", "sequence", "mlp_intermediate")))


@fe.sharded_module({"scale": ("hidden_state",)})
class Block(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.attention = Attention(c, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.mlp = SwiGlu(c, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), positions)
        x = x + self.mlp(self.mlp_norm(x))
        return fe.constrain(x, ACTIVATION)


# The decoder's own parameters: the embedding table, the final norm, the output head.
DECODER_AXES = {
    "embed/embedding": ("vocab", "hidden_state"),
    "final_norm/scale": ("hidden_state",),
    "lm_head/kernel": ("hidden_state", "vocab"),
}


def lookup(embed: nnx.Embed, tokens: jax.Array) -> jax.Array:
    """The rows of ``embed``'s table for ``tokens``, as the activations between blocks."""
    # As FSDP gathers any weight whole before its use, the table is gathered over the axes
    # that split its features before the lookup: a gather cannot keep the features split,
    # and XLA would otherwise replicate what it looked up to split it again. The rows looked
    # up keep their features whole too, so that the gradient's scatter-add lands in the
    # table's vocab layout (XLA:CPU >= 0.11 would scatter with the features split, then
    # replicate the table's gradient to split its vocab).
    table = fe.constrain(embed.embedding[...], ("vocab", None))
    return fe.constrain(fe.constrain(jnp.take(table, tokens, axis=0), LOOKED_UP), ACTIVATION)


@fe.sharded_module(DECODER_AXES)
class Llama(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.c = c
        self.embed = nnx.Embed(c.vocab, c.hidden, rngs=rngs)

        # One layer at a time (nnx.scan): the same values as an nnx.vmap stack, with the init's
        # CPU temporaries one layer's instead of the whole stack's.
        self.blocks = fen.stack_layers(lambda rngs: Block(c, rngs=rngs), c.layers, rngs)
        self.final_norm = nnx.RMSNorm(c.hidden, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden, c.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        c = self.c
        x = lookup(self.embed, tokens)
        if c.microbatches is None:
            x = scan(x, self.blocks, positions)
        else:  # each stage of the mesh's pp axis runs its layers, a microbatch at a time
            x = fen.pipeline_stack(
                self.blocks, x, microbatches=c.microbatches, repeats=c.repeats, remat=c.remat
            )
        logits = self.lm_head(self.final_norm(x))
        return fe.constrain(logits, ("batch", "sequence", "vocab"))


@nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry, transform_metadata=fen.stacked())
def scan(x: jax.Array, block: Block, positions: jax.Array | None) -> jax.Array:
    """The stacked ``block`` applied layer after layer (every layer at the same positions)."""
    return block(x, positions)


def loss_fn(
    model: Llama,
    tokens: jax.Array,
    labels: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """The mean next-token loss of ``tokens`` (b, s + 1), or of ``tokens`` (b, s) and ``labels``.

    A context-parallel batch comes as ``(inputs, labels, positions)``, reordered to balance
    the causal mask (``context_options.next_token_batch``): its mean loss is the same.
    """
    if labels is None:
        tokens, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(tokens, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@nnx.jit
def train_step(model: Llama, optimizer: nnx.Optimizer, *batch: jax.Array) -> jax.Array:
    """One AdamW step on ``batch``: the tokens, or a context-parallel batch (see ``loss_fn``)."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
    optimizer.update(model, grads)
    return loss


def workload(config: Config = Config(), batch: int = 16, length: int = 33) -> Workload:
    """The model, AdamW and ``train_step`` on ``batch`` sequences of ``length`` tokens.

    What :func:`flax_escale.sizing.plan_mesh` compiles on every candidate mesh;
    ``python -m flax_escale plan nnx_llama:workload --devices 8 --memory 4MiB`` (from
    ``examples/``) prints its plan. Its ``pipelined(microbatches=, repeats=, remat=)`` is the
    same workload with the layer stack run as a pipeline over a mesh's ``pp`` axis, for the
    planner's pipeline candidates; its ``context_parallel(strategy)`` the same workload with
    attention by :func:`flax_escale.context.context_attention` on the batch that step takes
    (inputs, labels and positions of ``length - 1`` tokens), for its context candidates.
    """

    def pipelined(*, microbatches: int, repeats: int = 1, remat: str | None = None) -> Workload:
        staged = dataclasses.replace(
            config, microbatches=microbatches, repeats=repeats, remat=remat
        )
        return dataclasses.replace(
            workload(staged, batch, length), rules=pipeline_options.PIPELINE_RULES, pipelined=None
        )

    def context_parallel(strategy: str) -> Workload:
        split = dataclasses.replace(config, context_parallel=strategy)
        return dataclasses.replace(
            workload(split, batch, length),
            batch=context_options.batch_shapes(batch, length - 1),
            pipelined=None,
        )

    return Workload(
        Llama,
        0,
        (config,),
        tx=optax.adamw(3e-3),
        batch=(jax.ShapeDtypeStruct((batch, length), jnp.int32),),
        step=train_step,
        layers=config.layers,
        pipelined=pipelined if config.microbatches is None else None,
        context_parallel=context_parallel if config.context_parallel is None else None,
    )


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend_choice.add_devices_argument(parser)
    parser.add_argument(
        "--mesh",
        default=None,
        help="sizes of dp,fsdp,ep,tp,sp (default 2,2,1,2,1 on cpu, 1,-1,1,1,1 on accelerators), "
        "or named sizes, e.g. pp:2,fsdp:2,tp:2 (axes left out: 1; pp: a pipeline)",
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    pipeline_options.add_arguments(parser)
    context_options.add_arguments(parser)
    parser.add_argument("--zero1", action="store_true", help="also shard AdamW state over dp")
    args = parser.parse_args(argv)
    devices = backend_choice.select_devices(args.devices)  # before any backend starts
    print(backend_choice.describe(devices))
    with jax.default_device(devices[0]):
        return _train(args, devices)


def _train(args: argparse.Namespace, devices: list[jax.Device]) -> list[float]:
    mesh_text = args.mesh or ("2,2,1,2,1" if args.devices == "cpu" else "1,-1,1,1,1")
    mesh = fe.parse_mesh_from_string(
        mesh_text, fe.mesh.DEFAULT_AXIS_NAMES, partial=True, devices=devices
    )
    config, schedule = pipeline_options.configure(Config(), args, mesh)
    rules = pipeline_options.rules(mesh)
    config, context = context_options.configure(config, args, mesh, rules)
    print(fe.plan_sharding(Llama, mesh, 0, config, rules=rules).describe())
    if schedule is not None:
        print(pipeline_options.describe(schedule, config.remat))
    if context is not None:
        print(context_options.describe(context))
    model = fe.init_sharded(Llama, mesh, 0, config, rules=rules)
    optimizer = fen.init_optimizer(
        model, optax.adamw(3e-3), shard_over=("dp",) if args.zero1 else ()
    )

    losses = []
    data = toy_data.batches(config.vocab, args.batch, args.seq)
    with fe.use_sharding(mesh, rules):
        for step in range(args.steps):
            batch = context_options.step_batch(context, next(data))
            start = time.perf_counter()
            losses.append(float(train_step(model, optimizer, *batch)))
            if step % 5 == 0 or step == args.steps - 1:
                ms = (time.perf_counter() - start) * 1e3
                print(f"step {step:3d}  loss {losses[-1]:.4f}  ({ms:.0f} ms)")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
