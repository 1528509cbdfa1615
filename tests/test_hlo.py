"""Collective bytes per run of a compiled program, loop trips included."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_escale._hlo import collective_bytes

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
