"""Truth tests: a TPU plan's figures are those of the programs its user compiles.

``plan_mesh`` lowers a workload's init and training step its own way (``lower_programs``: the
state laid out from the sharding plan, the step wrapped in one ``jax.jit`` with the state's
shardings in and out, its buffers donated) and reads the compiled programs' figures. Here the
same examples are compiled the way their users write them, for the same slice of TPU chips on
each compiled candidate's mesh (nothing runs on a TPU: ``libtpu`` compiles from the CPU), and
every figure must agree: init and step peaks (``will_it_fit``), the collectives of a step and,
for NNX, the train state's bytes on the device that holds the most.
"""

import importlib.util

import jax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from support.example_modules import load
from support.train_states import abstract_train_state

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale.mesh import Target
from flax_escale.sizing import plan_mesh
from flax_escale.sizing._hlo import program_costs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler is not installed: pip install "flax-escale[tpu]"',
)


def _figures(init, step):
    """What the planner records of a compiled init and step, read from the user's programs."""
    return {
        "init_peak_bytes": fe.will_it_fit(init).peak_bytes,
        "step_peak_bytes": fe.will_it_fit(step).peak_bytes,
        "collectives": {
            kind: [c.count, c.bytes, c.wire_bytes]
            for kind, c in program_costs(step).collectives.items()
        },
    }


def _planned(candidate):
    f = candidate.figures
    return {
        "init_peak_bytes": f.init_peak_bytes,
        "step_peak_bytes": f.step_peak_bytes,
        "collectives": f.collectives,
    }


def _compiled(plan):
    return [c for c in plan.candidates if c.figures.status == "compiled"]


def _on(mesh, x):
    """``x``'s shape, dtype and spec, on ``mesh``: an array the user has, laid out on the slice."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec))


def _held_bytes(tree):
    """Bytes of the arrays of ``tree`` on the device that holds the most, counted shard by shard."""
    held = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


# --- NNX: the Llama example on a v5e-8 ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_plan(tmp_path_factory):
    llama = load("nnx_llama")
    cache = tmp_path_factory.mktemp("nnx_truth") / "plan"
    plan = plan_mesh(
        llama.workload, target="v5e-8", axes=("dp", "fsdp"), exhaustive=True, cache=cache
    )
    return llama, plan


def _llama_made_on_cpu(llama, workload, dims):
    """The model and optimizer the example's own calls make, for real, on 8 CPU devices.

    ``init_sharded`` and ``init_optimizer`` run (a mesh of the candidate's shape on the
    simulated CPU devices): their arrays carry the shardings the user's state has on the slice,
    made by the user's calls rather than by the planner's abstract layout.
    """
    model = fe.init_sharded(workload.model, fe.create_mesh(dims), workload.rng, *workload.args)
    optimizer = fen.init_optimizer(model, workload.tx)
    return model, optimizer


def _abstract_on(mesh, module):
    """``module`` with every array replaced by its shape, dtype and spec on ``mesh``."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda x: _on(mesh, x), state))


@pytest.mark.slow
def test_an_nnx_plan_has_the_figures_of_the_programs_compiled_the_users_way(llama_plan):
    llama, plan = llama_plan
    assert plan.devices == 8
    assert "TPU compiler" in plan.backend
    compiled = _compiled(plan)
    every = sorted((8 // f, f, 1, 1, 1) for f in (1, 2, 4, 8))  # dp x fsdp of 8
    assert sorted(c.dims for c in compiled) == every, plan.candidates
    target = Target.named("v5e-8")
    workload = llama.workload()
    (tokens,) = workload.batch
    # The user's step: the example's own function, jitted as Flax recommends for a training
    # step (nnx.jit, the model and optimizer donated; nothing pins the outputs' shardings, so
    # the compiler lays out the new state itself, where the planner pins it to the old one's).
    # The plan's figures are those of a donated step. The example's train_step as written
    # (@nnx.jit, nothing donated) is another program: its peak is higher by the state it cannot
    # reuse on dp x fsdp meshes, but lower on dp=2 fsdp=2 tp=2, where the donated program needs
    # more temporaries; no rule relates the two, so it is not compared here.
    donated_step = nnx.jit(llama.train_step.fun, donate_argnames=("model", "optimizer"))
    for candidate in compiled:
        mesh = target.mesh(candidate.dims)
        model, optimizer = _llama_made_on_cpu(llama, workload, candidate.dims)
        assert candidate.figures.state_bytes == _held_bytes(nnx.state((model, optimizer)))
        model, optimizer = _abstract_on(mesh, model), _abstract_on(mesh, optimizer)
        # The init is fe.lower_init, the planner's own: it agrees by construction.
        init = fe.lower_init(workload.model, mesh, workload.rng, *workload.args).compile()
        sharding = fe.batch_sharding(mesh, tokens.shape)
        batch = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=sharding)
        with fe.use_sharding(mesh, None):
            # nnx.jit's stages wrap JAX's: .compiled is the jax.stages.Compiled that
            # program_costs reads (will_it_fit unwraps it itself).
            step = donated_step.lower(model, optimizer, batch).compile().compiled
        assert _planned(candidate) == _figures(init, step), candidate.label


# --- Linen: the GPT example on 64 chips of a v5p-128 -------------------------------------------


def wide_batch_gpt():
    """The Linen GPT example at its own widths, on 64 sequences (its default 16 divides no mesh
    of 64 chips over dp x fsdp, so every candidate would be pruned). Module-level: the TPU
    candidates compile in a child process, which builds the workload from this reference."""
    return load("linen_gpt").workload(batch=64)


def _users_train_state(workload, mesh, init):
    """The TrainState a user's init gives on ``mesh``, abstract: the compiled init's outputs
    (the shardings its arrays would carry), AdamW state following them, a replicated step."""
    variables = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        init.out_info,
        init.output_shardings,
    )
    return abstract_train_state(workload, mesh, variables["params"])


@pytest.mark.slow
@pytest.mark.pod
def test_a_64_chip_plan_has_the_figures_of_the_programs_compiled_the_users_way(tmp_path):
    gpt = load("linen_gpt")
    plan = plan_mesh(
        wide_batch_gpt,
        target="v5p-128",
        axes=("dp", "fsdp"),
        exhaustive=True,
        cache=tmp_path / "plan",
    )
    assert plan.devices == 64
    assert "v5p:4x4x4" in plan.backend
    compiled = _compiled(plan)
    every = sorted((64 // f, f, 1, 1, 1) for f in (1, 2, 4, 8, 16, 32, 64))  # dp x fsdp of 64
    assert sorted(c.dims for c in compiled) == every, plan.candidates
    # The Linen user's step is jit_train_step, which pins the state's shardings in and out and
    # donates it just as lower_programs does, and fe.lower_init is the planner's own init: the
    # programs agree by construction once the state agrees. What can differ is the state (here
    # the layout of the user's init outputs, the planner's from its plan) and the figures' way
    # back from the child process that compiled 64 chips' programs.
    target = Target.named("v5p-128")
    workload = wide_batch_gpt()
    (tokens,) = workload.batch
    for candidate in compiled:
        mesh = target.mesh(candidate.dims)
        init = fe.lower_init(workload.model, mesh, workload.rng, *workload.args).compile()
        state = _users_train_state(workload, mesh, init)
        sharding = fe.batch_sharding(mesh, tokens.shape)
        batch = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=sharding)
        jitted = fel.jit_train_step(gpt.train_step, state, batch_sharding=sharding, has_aux=True)
        with fe.use_sharding(mesh, None):
            step = jitted.lower(state, batch).compile()
        assert _planned(candidate) == _figures(init, step), candidate.label
