"""The MoE examples, both APIs and both strategies, on the meshes expert parallelism uses.

Each is initialized and trained for three steps on 8 simulated devices and on one device: the
sharded init has the same values, every expert kernel is split over ``ep`` and 8 ways in all
(within 1.1x of its ideal share), the steps give the same losses,
dropped counts and parameters, the dropless step's all-to-alls move exactly what the
analytic count says, and XLA replicates nothing to repartition it.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from support import ROOT
from support.example_modules import load
from support.reshardings import step_reshardings

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import nnx as fen
from flax_escale.sizing._hlo import program_costs

pytestmark = [pytest.mark.slow, pytest.mark.xla]

MESHES = {
    "ep8": (1, 1, 8, 1, 1),
    "ep4_fsdp2": (1, 2, 4, 1, 1),
    "ep2_fsdp2_tp2": (1, 2, 2, 2, 1),
    "dp2_ep4": (2, 1, 4, 1, 1),
}
STRATEGIES = ("capacity", "dropless")
APIS = ("linen", "nnx")
BATCH = 8
STEPS = 3
EXPERT_KERNELS = ("wi_gate", "wi_up", "wo")


@dataclasses.dataclass
class Run:
    initial: dict
    final: dict
    losses: list[float]
    dropped: list[int]
    step: object  # the jitted step, lowered with `lower`
    args: tuple


def _train(api: str, strategy: str, mesh) -> Run:
    config = dataclasses.replace(load("moe_config").SMALL, strategy=strategy)
    rules = load("moe_config").RULES
    example = load(f"{api}_moe")
    data = load("toy_data").batches(config.vocab, BATCH, config.max_len)
    losses, dropped = [], []
    if api == "linen":
        model = example.MoeDecoder(config)
        tokens = jnp.zeros((BATCH, config.max_len), jnp.int32)
        state = fel.init_train_state(
            model, mesh, jax.random.key(0), tokens, tx=optax.adamw(3e-3), rules=rules
        )
        initial = state.params
        with fe.use_sharding(mesh, rules):
            for _ in range(STEPS):
                batch = fe.constrain(next(data), ("batch", "sequence"))
                args = (state, batch, config.aux_loss_weight)
                state, (loss, lost) = example.train_step(*args)
                losses.append(float(loss))
                dropped.append(int(lost))
        return Run(initial, state.params, losses, dropped, example.train_step, args)
    model = fe.init_sharded(example.MoeDecoder, mesh, 0, config, rules=rules)
    initial = _nnx_params(model)
    optimizer = fen.init_optimizer(model, optax.adamw(3e-3))
    with fe.use_sharding(mesh, rules):
        for _ in range(STEPS):
            batch = fe.constrain(next(data), ("batch", "sequence"))
            args = (model, optimizer, batch)
            loss, lost = example.train_step(*args)
            losses.append(float(loss))
            dropped.append(int(lost))
    return Run(initial, _nnx_params(model), losses, dropped, example.train_step, args)


def _nnx_params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _at(tree, path):
    for key in path:
        tree = tree[getattr(key, "key", getattr(key, "name", None))]
    return tree


@pytest.fixture(scope="module")
def one_device():
    mesh = fe.create_mesh((1, 1, 1, 1, 1), devices=jax.devices()[:1])
    return {(api, s): _train(api, s, mesh) for api in APIS for s in STRATEGIES}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("api", APIS)
def test_sharded_training_matches_one_device(api, strategy, mesh_name, one_device):
    mesh = fe.create_mesh(MESHES[mesh_name])
    run = _train(api, strategy, mesh)
    reference = one_device[api, strategy]

    flat = jax.tree_util.tree_leaves_with_path(run.initial)
    jax.tree.map(np.testing.assert_array_equal, run.initial, reference.initial)
    experts = [(jax.tree_util.keystr(p), leaf) for p, leaf in flat]
    experts = [(n, leaf) for n, leaf in experts if any(k in n for k in EXPERT_KERNELS)]
    assert len(experts) == 3
    for name, leaf in experts:
        # Split over ep, and over every other axis by their other names: the ideal share.
        expert_dim = leaf.sharding.spec[1]  # after the stacked layers
        assert "ep" in (expert_dim if isinstance(expert_dim, tuple) else (expert_dim,)), (
            name,
            leaf.sharding.spec,
        )
        per_device = leaf.addressable_shards[0].data.nbytes
        # dp replicates weights (data parallelism): their share is over the other axes.
        share = mesh.size // mesh.shape["dp"]
        assert per_device * share <= 1.1 * leaf.nbytes, (name, leaf.sharding.spec)

    np.testing.assert_allclose(run.losses, reference.losses, rtol=2e-5)
    assert run.dropped == reference.dropped
    if strategy == "capacity":
        assert all(d > 0 for d in run.dropped)  # 1.25 slots per even share: some overflow
    else:
        assert run.dropped == [0] * STEPS
    # AdamW divides each update by the root of its squared gradients, so a parameter whose
    # gradient is near zero can move differently on rounding alone: the updates are compared
    # as a whole, leaf by leaf.
    for path, final in jax.tree_util.tree_leaves_with_path(run.final):
        ref_final = _at(reference.final, path)
        update = np.asarray(final) - np.asarray(_at(run.initial, path))
        ref_update = np.asarray(ref_final) - np.asarray(_at(reference.initial, path))
        gap = np.linalg.norm(update - ref_update) / np.linalg.norm(ref_update)
        assert gap < 1e-3, (jax.tree_util.keystr(path), gap)


@pytest.mark.parametrize("api", APIS)
def test_dropless_all_to_all_bytes_are_the_analytic_count(api):
    # ep=8: each device's 32 tokens x top-2 = 64 rows go out in an (8, 64, hidden) buffer
    # padded for the worst case (all rows to one device), and come back the same way; the
    # backward pass sends the cotangents both ways again: 4 such buffers per layer, in the
    # scanned layer's forward and backward loop bodies (the HLO text holds each once).
    config = load("moe_config").SMALL
    mesh = fe.create_mesh(MESHES["ep8"])
    run = _train(api, "dropless", mesh)
    with fe.use_sharding(mesh, load("moe_config").RULES):
        compiled = run.step.lower(*run.args).compile()
    rows = BATCH * config.max_len // mesh.size * config.top_k
    ep = mesh.shape["ep"]
    buffer = ep * rows * config.hidden * 4
    tokens = [b for b in _all_to_all_bytes(compiled.as_text()) if b[1] == (rows, config.hidden)]
    assert [b for b, _ in tokens] == [buffer] * 4
    # Everything else they send is routing bookkeeping (per-expert counts, the load-balancing
    # statistics): under 2% of the bytes.
    total = program_costs(compiled).collectives["all-to-all"].bytes
    assert config.layers * 4 * buffer <= total < 1.02 * config.layers * 4 * buffer


def _all_to_all_bytes(text: str) -> list[tuple[int, tuple[int, ...]]]:
    """(bytes, minor two dimensions) of each all-to-all written in an HLO text."""
    found = []
    for line in text.splitlines():
        if " all-to-all(" not in line:
            continue
        shapes = re.findall(r"([fsu]\d+)\[([\d,]+)\]", line.split(" all-to-all(")[0])
        dims = [tuple(int(d) for d in s.split(",")) for _, s in shapes]
        size = sum(math.prod(d) * int(t[1:]) // 8 for (t, _), d in zip(shapes, dims, strict=True))
        found.append((size, dims[0][-2:]))
    return found


@pytest.mark.parametrize(
    "factory", ["linen_capacity", "linen_dropless", "nnx_capacity", "nnx_dropless"]
)
def test_no_mesh_replicates_an_array_to_repartition_it(factory):
    found = step_reshardings(
        str(ROOT / "tests" / "support" / "moe_workloads.py"), factory, list(MESHES.values())
    )
    assert found == {shape: [] for shape in MESHES.values()}
