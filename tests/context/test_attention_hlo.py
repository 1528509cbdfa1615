"""What :func:`flax_escale.context.context_attention` moves, read from its compiled program.

The forward attention of packed sequences (segment ids given) over ``sp=8`` is compiled for
each strategy by XLA:CPU (8 simulated devices, float32: XLA:CPU widens bfloat16 collectives to
float32, which would double its bytes) and by the TPU compiler (a v5e 2x4 slice described by
``jax.experimental.topologies``, bfloat16; nothing runs), and its collectives are read with
the library's HLO reader (:func:`~flax_escale.sizing._hlo.program_costs`).

The oracle is :meth:`ContextPlan.bytes_received` (what one device receives of Q, K, V and the
output), plus the int32 positions and segment ids that travel with the keys, counted here:

- the reader gives each collective's *result* bytes on one device and, beside them, the bytes
  one device receives by the ring algorithms (``wire_bytes``): ``(c - 1) / c`` of an
  all-gather's or all-to-all's result, all of a collective-permute's. ``bytes_received`` is in
  the second convention, so the floating-point bytes are compared as received;
- all_gather gathers K, V, positions and segment ids whole: ``B * S * 4`` bytes of each int32
  array gathered (result), ``(c - 1) / c`` of them received;
- ring passes each device's K, V, positions and segment ids ``c - 1`` hops: ``(c - 1) * B *
  S / c * 4`` bytes of each int32 array;
- ulysses trades Q, K, V and the output with all-to-alls and gathers positions and segment
  ids whole, as all_gather does.

The TPU compiler writes the small int32 gathers as one all-reduce (of the gathered arrays,
each device's share in place; a ring all-reduce receives twice what a gather does), so the
int32 arrays are compared by their result bytes, whatever the kind, and the total received by
every collective within 1.1x of the analytic total.
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_escale.context import context_attention, plan_attention
from flax_escale.mesh import Target
from flax_escale.sizing._hlo import program_costs

pytestmark = pytest.mark.xla

BATCH, LENGTH, HEADS, HEAD_DIM, DEGREE = 1, 512, 8, 32, 8
# The collective that moves Q, K, V and the output, by strategy.
KIND = {"all_gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}
FLOATS = ("f32", "bf16")
INT32 = 4
TOKEN_ARRAYS = 2  # positions and segment ids


def _target(compiler: str) -> Target:
    if compiler == "cpu":
        return Target.named("cpu", devices=8)
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip('the TPU compiler is not installed: pip install "flax-escale[tpu]"')
    return Target.named("v5e-8")


@pytest.fixture(
    scope="module",
    params=[(c, s) for c in ("cpu", "tpu") for s in KIND],
    ids=lambda p: "-".join(p),
)
def compiled(request):
    """The forward program of one strategy on one compiler, with its plan."""
    compiler, strategy = request.param
    target = _target(compiler)
    mesh = target.mesh((1, 1, 1, 1, DEGREE))  # sp=8
    dtype = jnp.float32 if compiler == "cpu" else jnp.bfloat16

    def array(shape, dtype):
        sharding = NamedSharding(mesh, P(None, "sp"))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    q = array((BATCH, LENGTH, HEADS, HEAD_DIM), dtype)
    segments = array((BATCH, LENGTH), jnp.int32)

    def attention(q, k, v, segments):
        return context_attention(q, k, v, segment_ids=segments, strategy=strategy, mesh=mesh)

    program = jax.jit(attention).lower(q, q, q, segments).compile(target.compiler_options)
    plan = plan_attention(q, q, strategy=strategy, mesh=mesh)
    return program_costs(program), plan, strategy


def _tokens(strategy: str) -> tuple[int, int]:
    """The int32 positions and segment ids exchanged: (result bytes, bytes received)."""
    c = DEGREE
    if strategy == "ring":  # c - 1 hops of one device's share
        moved = (c - 1) * BATCH * LENGTH // c * INT32 * TOKEN_ARRAYS
        return moved, moved
    gathered = BATCH * LENGTH * INT32 * TOKEN_ARRAYS  # gathered whole (ulysses too)
    return gathered, gathered * (c - 1) // c


def test_the_plan_is_the_strategy_asked_over_sp(compiled):
    _, plan, strategy = compiled
    assert (plan.strategy, plan.axes, plan.degree) == (strategy, ("sp",), DEGREE)


def test_query_key_value_bytes_received_equal_the_plans(compiled):
    costs, plan, strategy = compiled
    floats = {
        kind: sum(b for t, b in types.items() if t in FLOATS)
        for kind, types in costs.collective_dtypes.items()
    }
    assert {k for k, b in floats.items() if b} == {KIND[strategy]}  # nothing else moves floats
    cost = costs.collectives[KIND[strategy]]
    received = floats[KIND[strategy]] * cost.wire_bytes / cost.bytes  # the floats' share
    ratio = received / plan.bytes_received()
    assert 1 / 1.1 <= ratio <= 1.1, (received, plan.bytes_received())
    assert costs.unknown_trip_loops == 0  # the ring's scan is counted by its trips


def test_positions_and_segment_ids_move_as_counted(compiled):
    costs, _, strategy = compiled
    ints = sum(types.get("s32", 0) for types in costs.collective_dtypes.values())
    assert ints == _tokens(strategy)[0]


def test_every_byte_received_is_accounted_for(compiled):
    costs, plan, strategy = compiled
    analytic = plan.bytes_received() + _tokens(strategy)[1]
    ratio = costs.wire_bytes / analytic
    assert 1 / 1.1 <= ratio <= 1.1, (costs.wire_bytes, analytic)
