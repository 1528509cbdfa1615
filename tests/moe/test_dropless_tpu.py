"""The dropless exchange (``flax_escale/moe/_dropless.py``) with ``ragged_all_to_all``, compiled
by the TPU compiler, and its bytes.

XLA:CPU cannot compile a ``ragged-all-to-all``; the TPU compiler (``libtpu``, which the test
environment installs) compiles it for a slice described by ``jax.experimental.topologies``, and
nothing runs. Its buffers are sized for the worst case (every row to one peer), so the HLO
reader counts the smaller of what each one sends and receives: the rows a device holds (that
rule on handwritten HLO: ``tests/sizing/test_hlo_reader.py``).
"""

import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import flax_escale as fe
from flax_escale.moe import EXPERT_AXES, GatedExperts, moe_mlp
from flax_escale.sizing._hlo import array_bytes, collective_bytes, program_costs

EP, BATCH, SEQUENCE, MLP, EXPERTS, TOP_K = 8, 8, 16, 256, 8, 2
# The TPU compiler lays each exchanged row out in tiles of 128 lanes of 32 bits: a float32 row
# as f32[1, 128] per tile, a bfloat16 row as bf16[2, 128] (two values per lane), so a row
# moves a whole number of 512-byte tiles; a float32 hidden size that is a multiple of 128, or
# a bfloat16 one that is a multiple of 256, moves exactly its bytes.
TILE_BYTES = 128 * 4


def _moved_row_bytes(hidden: int, itemsize: int) -> int:
    return -(-hidden * itemsize // TILE_BYTES) * TILE_BYTES


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='the TPU compiler is not installed: pip install "flax-escale[tpu]"',
)
@pytest.mark.parametrize(
    ("dtype", "hidden", "moved"),
    [
        # A row fills whole tiles: what moves is the analytic count.
        (jnp.float32, 128, 65536),
        (jnp.bfloat16, 256, 65536),
        # 128 bfloat16 values fill half a tile, which the compiler pads (bf16[rows, 2, 128]).
        (jnp.bfloat16, 128, 65536),
    ],
)
def test_ragged_exchange_moves_each_devices_rows_forward_and_backward(dtype, hidden, moved):
    from flax_escale.mesh import Target

    target = Target.named("v5p-16")
    mesh = target.mesh((1, 1, EP, 1, 1))
    rules = fe.PartitionAxis(ep_as_fsdp=True)

    def loss(x, router, experts):
        out = moe_mlp(
            x,
            router,
            experts,
            top_k=TOP_K,
            strategy="dropless",
            exchange="ragged_all_to_all",
            rules=rules,
        )
        return jnp.sum(out.output.astype(jnp.float32) ** 2) + out.aux_loss

    def abstract(shape, axes):
        spec = fe.resolve_logical_axes(axes, rules, shape=shape, mesh=mesh, strict=True).spec
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    args = (
        abstract((BATCH, SEQUENCE, hidden), ("batch", "sequence", "hidden_state")),
        abstract((hidden, EXPERTS), ("hidden_state", "expert")),
        GatedExperts(
            abstract((EXPERTS, hidden, MLP), EXPERT_AXES["wi_gate"]),
            abstract((EXPERTS, hidden, MLP), EXPERT_AXES["wi_up"]),
            abstract((EXPERTS, MLP, hidden), EXPERT_AXES["wo"]),
        ),
    )
    # The tokens are split over ep with the rest of the batch's axes (ep_as_fsdp).
    assert "ep" in args[0].sharding.spec[0]
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile(target.compiler_options)
        )
    text = compiled.as_text()
    ragged = [line for line in text.splitlines() if re.search(r"= \S+ ragged-all-to-all\(", line)]
    # Tokens out to the experts and back, forward; the two transposes, backward.
    assert len(ragged) == 4, ragged
    rows = BATCH * SEQUENCE // EP * TOP_K  # assignments per device: tokens x top_k
    itemsize = jnp.dtype(dtype).itemsize
    cost = program_costs(compiled).collectives["ragged-all-to-all"]
    assert cost.count == 4
    # Each way, forward and backward: the device's rows, no more.
    assert cost.bytes == 4 * rows * _moved_row_bytes(hidden, itemsize) == moved
    if hidden * itemsize % TILE_BYTES == 0:
        assert cost.bytes == 4 * rows * hidden * itemsize
    else:
        assert cost.bytes == 2 * (4 * rows * hidden * itemsize)
    # The receiving buffers are the worst case (rows from every peer): counting results would
    # say more.
    results = sum(
        array_bytes(line.split("=", 1)[1].split(" ragged-all-to-all")[0]) for line in ragged
    )
    assert results > cost.bytes
    # The exchange is ragged only: the padded all-to-all of the tokens is not there (what
    # all-to-alls remain move the int32 counts and offsets).
    assert collective_bytes(compiled).get("all-to-all", 0) < rows * hidden * itemsize
