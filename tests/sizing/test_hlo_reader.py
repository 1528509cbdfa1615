"""The HLO reader (``flax_escale/sizing/_hlo/_reader.py``): collective bytes and matmul flops
per run of a compiled program, loop trips included; ragged all-to-alls counted by what they send.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_escale.sizing._hlo import collective_bytes, program_costs

LAYERS, WIDTH = 4, 64


def _mesh():
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def _layer(h, w):
    return jnp.tanh(h @ jax.sharding.reshard(w, P()))  # gathers the layer's weights


def _scanned(ws, h):
    return jax.lax.scan(lambda h, w: (_layer(h, w), None), h, ws)[0].sum()


def _unrolled(ws, h):
    for i in range(LAYERS):
        h = _layer(h, ws[i])
    return h.sum()


@pytest.fixture(scope="module")
def compiled():
    mesh = _mesh()
    ws = jax.device_put(jnp.ones((LAYERS, WIDTH, WIDTH)), NamedSharding(mesh, P(None, "x")))
    h = jnp.ones((8, WIDTH))
    with jax.set_mesh(mesh):
        return {f.__name__: jax.jit(f).lower(ws, h).compile() for f in (_scanned, _unrolled)}


def test_a_scanned_stack_counts_every_trip(compiled):
    one_layer = WIDTH * WIDTH * 4  # the gathered f32 kernel
    scanned = collective_bytes(compiled["_scanned"])
    assert scanned["all-gather"] == LAYERS * one_layer
    assert "while(" in compiled["_scanned"].as_text()


def test_scan_and_unrolled_loop_move_the_same_bytes(compiled):
    assert collective_bytes(compiled["_scanned"]) == collective_bytes(compiled["_unrolled"])
    assert collective_bytes(compiled["_unrolled"]) == collective_bytes(
        compiled["_unrolled"].as_text()
    )


ASYNC = """
%fused (p: f32[8]) -> f32[8] {
  %ar = bf16[4,2]{1,0} all-reduce(%p), to_apply=%add
}
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%x), dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
}
ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %u = (s32[], f32[8]) while(%t), body=%body
  %cp = u8[5]{0} collective-permute(%a), source_target_pairs={{0,1}}
}
"""


def test_async_halves_nested_calls_and_unknown_trip_counts():
    got = collective_bytes(ASYNC)
    # all-gather: the -done result (256 B), 3 known trips + 1 unknown-trip loop counted once.
    assert got["all-gather"] == 4 * 64 * 4
    # all-reduce inside a called fusion, per trip: 8 bf16 values.
    assert got["all-reduce"] == 4 * 8 * 2
    assert got["collective-permute"] == 5
    assert set(got) == {"all-gather", "all-reduce", "collective-permute"}


def test_a_program_without_collectives_moves_nothing():
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    assert collective_bytes(compiled) == {}


# --- program_costs: group sizes, wire bytes, dot FLOPs ---------------------------------------

# Bytes each device sends per byte of result, over a group of n devices (ring algorithms).
RING = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,
}
ONE_OP = """
HloModule m, is_scheduled=true, num_partitions=8
ENTRY %main (a: f32[16]) -> f32[16] {{
  ROOT %op = f32[16]{{0}} {kind}(%a), channel_id=1, replica_groups={groups}, dimensions={{0}}
}}
"""


@pytest.mark.parametrize("kind", list(RING))
@pytest.mark.parametrize(
    ("groups", "size"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", 2),
        ("{{0,1,2,3},{4,5,6,7}}", 4),
        ("{{0,1,2,3,4,5,6,7}}", 8),
        ("[4,2]<=[8]", 2),
        ("[2,4]<=[4,2]T(1,0)", 4),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 4),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", 2),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", 8),
        ("{}", 8),  # every device of the program: num_partitions
    ],
)
def test_group_sizes_and_wire_bytes_of_every_replica_groups_form(kind, groups, size):
    costs = program_costs(ONE_OP.format(kind=kind, groups=groups))
    assert set(costs.collectives) == {kind}
    cost = costs.collectives[kind]
    assert (cost.count, cost.bytes) == (1, 64)
    assert cost.wire_bytes == pytest.approx(64 * RING[kind](size))
    assert costs.wire_bytes == cost.wire_bytes
    assert costs.collective_count == 1


def test_an_empty_group_is_every_device_replicas_included():
    text = ONE_OP.format(kind="all-reduce", groups="{}").replace(
        "num_partitions=8", "num_partitions=2, replica_count=3"
    )
    assert program_costs(text).wire_bytes == pytest.approx(64 * 2 * 5 / 6)
    one_device = ONE_OP.format(kind="all-gather", groups="{}").replace(", num_partitions=8", "")
    assert program_costs(one_device).wire_bytes == 0


def test_a_collective_permute_sends_its_result_once():
    text = """
HloModule m, num_partitions=8
ENTRY %main (a: f32[16]) -> f32[16] {
  %cp = f32[16]{0} collective-permute(%a), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
}
"""
    cost = program_costs(text).collectives["collective-permute"]
    assert (cost.count, cost.bytes, cost.wire_bytes) == (1, 64, 64)


def test_the_group_sizes_of_a_compiled_program():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    block = P("a", "b")

    def collectives(x):
        total = jax.lax.psum(x, "b")  # groups of 4
        gathered = jax.lax.all_gather(x, "a", tiled=True)  # groups of 2
        scattered = jax.lax.psum_scatter(x, "b", scatter_dimension=1, tiled=True)
        shifted = jax.lax.ppermute(x, "b", perm=[(i, (i + 1) % 4) for i in range(4)])
        return total, gathered, scattered, shifted

    mapped = jax.shard_map(
        collectives, mesh=mesh, in_specs=block, out_specs=(block,) * 4, check_vma=False
    )
    x = jax.device_put(jnp.ones((2, 64)), NamedSharding(mesh, block))  # f32[1,16] per device
    costs = program_costs(jax.jit(mapped).lower(x).compile())
    assert costs.collectives["all-reduce"].wire_bytes == pytest.approx(64 * 2 * 3 / 4)
    assert costs.collectives["all-gather"].bytes == 128
    assert costs.collectives["all-gather"].wire_bytes == pytest.approx(128 * 1 / 2)
    assert costs.collectives["reduce-scatter"].bytes == 16
    assert costs.collectives["reduce-scatter"].wire_bytes == pytest.approx(16 * 3)
    assert costs.collectives["collective-permute"].wire_bytes == 64

    # A reduction the partitioner writes itself, over one axis of the mesh and over all.
    y = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, block))
    over_a = program_costs(jax.jit(lambda y: y.sum(0)).lower(y).compile())
    assert over_a.collectives["all-reduce"].bytes == 64  # f32[16] per device
    assert over_a.collectives["all-reduce"].wire_bytes == pytest.approx(64 * 2 * 1 / 2)
    flat = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P(("a", "b"))))
    over_all = program_costs(jax.jit(lambda y: y.sum()).lower(flat).compile())
    assert over_all.collectives["all-reduce"].count == 1
    assert over_all.collectives["all-reduce"].wire_bytes == pytest.approx(4 * 2 * 7 / 8)


ONE_LAYER_FLOPS = 2 * 8 * WIDTH * WIDTH  # (8, WIDTH) @ (WIDTH, WIDTH), on every device


def test_dot_flops_count_every_trip_of_a_scanned_stack(compiled):
    scanned = program_costs(compiled["_scanned"])
    unrolled = program_costs(compiled["_unrolled"])
    assert scanned.dot_flops == unrolled.dot_flops == LAYERS * ONE_LAYER_FLOPS
    assert scanned.dot_flops_once == ONE_LAYER_FLOPS  # the loop body, once
    assert unrolled.dot_flops_once == unrolled.dot_flops
    # XLA's own count sees the loop body once, as dot_flops_once does.
    analysis = compiled["_scanned"].cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    assert ONE_LAYER_FLOPS <= analysis["flops"] < 2 * ONE_LAYER_FLOPS


def test_dot_flops_of_a_gradient_match_scanned_or_unrolled():
    mesh = _mesh()
    ws = jax.device_put(jnp.ones((LAYERS, WIDTH, WIDTH)), NamedSharding(mesh, P(None, "x")))
    h = jnp.ones((8, WIDTH))
    with jax.set_mesh(mesh):
        scanned, unrolled = (
            program_costs(jax.jit(jax.grad(f)).lower(ws, h).compile())
            for f in (_scanned, _unrolled)
        )
    # Forward, and two products per layer backward; unrolled, XLA drops the gradient of the
    # first layer's input, which nothing uses.
    assert scanned.dot_flops == 3 * LAYERS * ONE_LAYER_FLOPS
    assert scanned.dot_flops - unrolled.dot_flops in (0, ONE_LAYER_FLOPS)
    assert scanned.dot_flops_once == 3 * ONE_LAYER_FLOPS


# --- ragged-all-to-all: the smaller of operand and result, on handwritten HLO --------------------

RAGGED = """
HloModule m, num_partitions=4
ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %buffer = f32[32,16]{1,0} broadcast(%zero), dimensions={}
  %sent = f32[32,16]{1,0} ragged-all-to-all(%a, %buffer, %o, %s, %ro, %rs), channel_id=1, replica_groups={{0,1,2,3}}
  %back = f32[8,16]{1,0} ragged-all-to-all(%sent, %a, %o, %s, %ro, %rs), channel_id=2, replica_groups={{0,1,2,3}}
  %elsewhere = bf16[8,8]{1,0} ragged-all-to-all(%absent, %buffer, %o, %s, %ro, %rs), channel_id=3, replica_groups={{0,1,2,3}}
  %plain = f32[4,16]{1,0} all-to-all(%small), channel_id=4, replica_groups={{0,1,2,3}}, dimensions={0}
  %small = f32[2,16]{1,0} parameter(1)
}"""  # noqa: E501


def test_a_ragged_all_to_all_counts_the_smaller_of_its_operand_and_result():
    counted = collective_bytes(RAGGED)
    # %sent: sends its 8 x 16 operand into a 32 x 16 buffer: 512 bytes, not 2048.
    # %back: sends 32 x 16 back into 8 x 16: 512 bytes, not 2048.
    # %elsewhere: its operand is not in the computation, so its result counts: 8 x 8 bf16.
    assert counted["ragged-all-to-all"] == 512 + 512 + 128
    # Other collectives still count their results.
    assert counted["all-to-all"] == 4 * 16 * 4
    cost = program_costs(RAGGED).collectives["ragged-all-to-all"]
    assert cost.count == 3
    # Over 4 devices an all-to-all's bytes cross the wire (n - 1) / n of the time.
    assert cost.wire_bytes == pytest.approx(1152 * 3 / 4)
