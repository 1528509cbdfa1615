"""A small GPT-style decoder in Flax Linen, annotated once with logical names, trained sharded.

Run it with ``python examples/linen_gpt.py``: on 8 simulated CPU devices whatever the host has,
or with ``--devices accelerator`` on the host's GPUs or TPUs (its first line says which). It
builds a 2 x 2 x 2 dp x fsdp x tp mesh (on accelerators: every device on fsdp), initializes
the model and its AdamW state directly sharded, prints every parameter's spec, and trains a few
steps on a toy next-token task (count upwards modulo the vocabulary) so that the loss visibly
falls. A mesh with a ``pp`` axis (``--mesh pp:2,fsdp:2,tp:2``) runs the layer stack as a
pipeline over it instead (``--microbatches``, ``--repeats``, ``--remat``; see
``pipeline_options.py``) and prints its schedule beside the plan. A mesh with an ``sp`` axis
and ``--context-parallel`` (``--mesh fsdp:2,sp:4 --context-parallel ring --seq 64``) splits the
sequence over ``sp`` with attention exchanging keys and values by that strategy, the batch
reordered to balance the causal mask (``--balance``; see ``context_options.py``), and prints
the strategy, the balance and the bytes beside the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import backend_choice
import context_options
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pipeline_options
import toy_data
from flax.training.train_state import TrainState

import flax_escale as fe
from flax_escale import linen as fel
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
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2
    max_len: int = 32
    tie_embeddings: bool = False
    # A pipeline over the mesh's pp axis (flax_escale.linen.pipelined) when microbatches is set;
    # None scans the stack.
    microbatches: int | None = None
    repeats: int = 1
    remat: str | None = None
    # Attention by flax_escale.context.context_attention with this strategy ("all_gather",
    # "ring", "ulysses" or "auto"), the batch's positions given; None leaves it to XLA.
    context_parallel: str | None = None


@fe.sharded_module(
    {
        "(query|key|value)/kernel": ("hidden_state", "head", "attention_dim"),
        "out/kernel": ("head", "attention_dim", "hidden_state"),
    }
)
class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        c = self.config
        dense = {"features": (c.heads, c.head_dim), "use_bias": False}
        q = nn.DenseGeneral(**dense, name="query")(x)
        k = nn.DenseGeneral(**dense, name="key")(x)
        v = nn.DenseGeneral(**dense, name="value")(x)
        q = fe.constrain(q, ("batch", "sequence", "head", "attention_dim"))
        if c.context_parallel:
            # Each device holds its share of the sequence: the strategy brings it the keys and
            # values it attends to, the mask coming from the positions (any order, balanced).
            y = context_attention(q, k, v, positions=positions, strategy=c.context_parallel)
        else:
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], bool))
            y = nn.dot_product_attention(q, k, v, mask=mask)
        y = fe.constrain(y, ("batch", "sequence", "head", "attention_dim"))
        return nn.DenseGeneral(c.hidden, axis=(-2, -1), use_bias=False, name="out")(y)


@fe.sharded_module(
    {
        "wi/kernel": ("hidden_state", "mlp_intermediate"),
        "wi/bias": ("mlp_intermediate",),
        "wo/kernel": ("mlp_intermediate", "hidden_state"),
        "wo/bias": ("hidden_state",),
    }
)
class Mlp(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(self.config.mlp, name="wi")(x))
        h = fe.constrain(h, ("batch", "sequence", "mlp_intermediate"))
        return nn.Dense(self.config.hidden, name="wo")(h)


@fe.sharded_module({"(scale|bias)": ("hidden_state",)})
class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, None]:
        attention = Attention(self.config, name="attention")
        x = x + attention(nn.LayerNorm(name="ln_attention")(x), positions)
        x = x + Mlp(self.config, name="mlp")(nn.LayerNorm(name="ln_mlp")(x))
        return fe.constrain(x, ACTIVATION), None


def embed(
    c: Config, tokens: jax.Array, positions: jax.Array | None = None
) -> tuple[nn.Embed, jax.Array]:
    """The token table and the embedded ``tokens``, made in the calling module's compact scope.

    ``c`` is any configuration with ``vocab``, ``hidden`` and ``max_len``; ``positions`` (b, s)
    are the tokens' positions, for a batch in another order than the sequence's (context
    parallelism's balanced layout); ``None``: 0, 1, ... in order.
    """
    token = nn.Embed(c.vocab, c.hidden, name="token")
    position = nn.Embed(c.max_len, c.hidden, name="position")
    # As FSDP gathers any weight whole before its use, the tables are gathered over the axes
    # that split their features before the lookup: a gather cannot keep the features split,
    # and XLA would otherwise replicate what it looked up to split it again. The rows looked up
    # keep their features whole too, so that the gradient's scatter-add lands in the table's
    # vocab layout (XLA:CPU >= 0.11 would scatter with the features split, then replicate the
    # table's gradient to split its vocab).
    table = fe.constrain(token.embedding, ("vocab", None))
    x = fe.constrain(jnp.take(table, tokens, axis=0), LOOKED_UP)
    positional = fe.constrain(position.embedding, (None, None))
    if positions is None:
        x = x + positional[: tokens.shape[1]]
    else:
        x = x + fe.constrain(jnp.take(positional, positions, axis=0), LOOKED_UP)
    return token, fe.constrain(x, ACTIVATION)


def scanned(block: type[nn.Module], layers: int) -> type[nn.Module]:
    """``block`` repeated ``layers`` times by ``nn.scan``, its parameters stacked on ``layers``.

    Its argument after the activations (the positions) is the same for every layer.
    """
    return nn.scan(
        block,
        variable_axes={"params": 0},
        in_axes=nn.broadcast,
        split_rngs={"params": True},
        length=layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


@fe.sharded_module(
    {
        "token/embedding": ("vocab", "hidden_state"),
        "position/embedding": (None, "hidden_state"),
        "ln_final/(scale|bias)": ("hidden_state",),
        "head/kernel": ("hidden_state", "vocab"),
    }
)
class Gpt(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        c = self.config
        token, x = embed(c, tokens, positions)
        if c.microbatches is None:
            stack = scanned(Block, c.layers)
        else:  # the same parameters; each stage of pp runs its layers, a microbatch at a time
            stack = fel.pipelined(
                Block, c.layers, microbatches=c.microbatches, repeats=c.repeats, remat=c.remat
            )
        x, _ = stack(c, name="blocks")(x, positions)
        x = nn.LayerNorm(name="ln_final")(x)
        if c.tie_embeddings:
            logits = token.attend(x)
        else:
            logits = nn.Dense(c.vocab, use_bias=False, name="head")(x)
        return fe.constrain(logits, ("batch", "sequence", "vocab"))


def loss_fn(params, apply_fn, tokens, labels=None, positions=None):
    """The mean next-token loss of ``tokens`` (b, s + 1), or of ``tokens`` (b, s) and ``labels``.

    A context-parallel batch comes as ``(inputs, labels, positions)``, reordered to balance
    the causal mask (``context_options.next_token_batch``): its mean loss is the same.
    """
    if labels is None:
        tokens, labels = tokens[:, :-1], tokens[:, 1:]
    logits = apply_fn({"params": params}, tokens, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@jax.jit
def train_step(state: TrainState, *batch: jax.Array) -> tuple[TrainState, jax.Array]:
    """One AdamW step on ``batch``: the tokens, or a context-parallel batch (see ``loss_fn``)."""
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, *batch)
    return state.apply_gradients(grads=grads), loss


def workload(config: Config = Config(), batch: int = 16) -> Workload:
    """The model, AdamW and ``train_step`` on batches of ``batch`` sequences, for ``plan_mesh``.

    ``python -m flax_escale plan linen_gpt:workload --devices 8 --memory 4MiB`` (from
    ``examples/``) ranks the meshes of 8 devices for it. Its ``pipelined(microbatches=,
    repeats=, remat=)`` is the same workload with the layer stack run as a pipeline over a
    mesh's ``pp`` axis, for the planner's pipeline candidates; its
    ``context_parallel(strategy)`` the same workload with attention by
    :func:`flax_escale.context.context_attention` on the batch that step takes (inputs,
    labels and positions of ``max_len`` tokens), for its context candidates.
    """

    def pipelined(*, microbatches: int, repeats: int = 1, remat: str | None = None) -> Workload:
        staged = dataclasses.replace(
            config, microbatches=microbatches, repeats=repeats, remat=remat
        )
        return dataclasses.replace(
            workload(staged, batch), rules=pipeline_options.PIPELINE_RULES, pipelined=None
        )

    def context_parallel(strategy: str) -> Workload:
        split = dataclasses.replace(config, context_parallel=strategy)
        return dataclasses.replace(
            workload(split, batch),
            batch=context_options.batch_shapes(batch, config.max_len),
            pipelined=None,
        )

    return Workload(
        Gpt(config),
        jax.random.key(0),
        (jax.ShapeDtypeStruct((batch, config.max_len), jnp.int32),),
        tx=optax.adamw(3e-3),
        batch=(jax.ShapeDtypeStruct((batch, config.max_len + 1), jnp.int32),),
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
    parser.add_argument("--tie-embeddings", action="store_true")
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
    # The learned position embedding has a row per position of --seq.
    config = Config(tie_embeddings=args.tie_embeddings, max_len=args.seq)
    config, schedule = pipeline_options.configure(config, args, mesh)
    rules = pipeline_options.rules(mesh)
    config, context = context_options.configure(config, args, mesh, rules)
    model = Gpt(config)
    rng = jax.random.key(0)
    example = jnp.zeros((args.batch, config.max_len), jnp.int32)

    print(fe.plan_sharding(model, mesh, rng, example, rules=rules).describe())
    if schedule is not None:
        print(pipeline_options.describe(schedule, config.remat))
    if context is not None:
        print(context_options.describe(context))
    tx = optax.adamw(3e-3)
    state = fel.init_train_state(model, mesh, rng, example, tx=tx, rules=rules)

    losses = []
    data = toy_data.batches(config.vocab, args.batch, config.max_len)
    with fe.use_sharding(mesh, rules):
        for step in range(args.steps):
            batch = context_options.step_batch(context, next(data))
            start = time.perf_counter()
            state, loss = train_step(state, *batch)
            losses.append(float(loss))
            if step % 5 == 0 or step == args.steps - 1:
                ms = (time.perf_counter() - start) * 1e3
                print(f"step {step:3d}  loss {losses[-1]:.4f}  ({ms:.0f} ms)")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
