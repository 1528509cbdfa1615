"""``choose_strategy`` and its figures (``flax_escale/context/_strategy.py``): the bytes and
FLOPs of one device's share against hand computations, the seconds of each strategy, which one
``"auto"`` takes for long and short sequences, Ulysses left out where the heads do not split,
and the descriptions."""

import pytest

from flax_escale.context import (
    CONTEXT_STRATEGIES,
    AttentionShape,
    Choice,
    Cost,
    Link,
    choose_strategy,
)

# 2 sequences of 1024 tokens over 4 devices, 8 query heads reading 2 key/value heads of 64.
GQA = AttentionShape(batch=2, sequence=1024, degree=4, q_heads=8, kv_heads=2, head_dim=64)
SLOW = Link(flops_per_second=1e12, bytes_per_second=1e9, latency_seconds=1e-5)


def test_figures_by_hand():
    # K and V of the whole sequence for 2 kv heads: 2 x 2 x 1024 x 2 x 64 elements of 2 bytes.
    assert GQA.kv_bytes() == 1_048_576
    # The gather and the ring receive the other 3 devices' quarters.
    assert GQA.bytes_received("all_gather") == GQA.bytes_received("ring") == 786_432
    # Ulysses: 3/4 of a device's Q, K, V and output (2 x 256 tokens x 64 x 2 bytes a head,
    # 2 x 8 + 2 x 2 heads).
    assert GQA.bytes_received("ulysses") == 3 * (2 * 256 * 64 * 2) * 20 // 4 == 983_040
    # Q K^T and P V: 2 x 2 x 256 x 1024 x 8 x 64 FLOPs each, half of them under a causal mask.
    assert GQA.flops() == 536_870_912
    assert AttentionShape(2, 1024, 4, 8, 2, 64, causal=False).flops() == 2 * 536_870_912
    float32 = AttentionShape(2, 1024, 4, 8, 2, 64, itemsize=4)
    assert float32.bytes_received("ring") == 2 * 786_432
    one = AttentionShape(2, 1024, 1, 8, 2, 64)
    assert [one.bytes_received(s) for s in CONTEXT_STRATEGIES] == [0, 0, 0]


def test_link_alpha():
    assert Link().alpha == pytest.approx(1970.0)
    assert SLOW.alpha == 1000.0


def test_costs_by_hand():
    choice = choose_strategy(GQA, SLOW)
    compute = 536_870_912 / 1e12
    chunk, hop = compute / 4, 262_144 / 1e9  # a quarter of the work; one device's K and V
    assert chunk < hop
    seconds = {
        "all_gather": compute + 786_432 / 1e9 + 1e-5,
        "ring": chunk + 3 * (hop + 1e-5),
        "ulysses": compute + 983_040 / 1e9 + 4 * 1e-5,
    }
    assert [c.strategy for c in choice.costs] == list(CONTEXT_STRATEGIES)
    for cost in choice.costs:
        assert cost.seconds == pytest.approx(seconds[cost.strategy], rel=1e-12)
        assert cost.flops == 536_870_912
    assert [c.collectives for c in choice.costs] == [1, 3, 4]
    # 2 key/value heads do not split 4 ways: Ulysses cannot run, whatever its estimate.
    assert choice.cost("ulysses").misfit == (
        "ulysses splits the heads of each device 4 ways, but there are 8 query and 2 key/value "
        "heads on each device"
    )
    assert choice.strategy == "ring"
    assert choice.cost() is choice.cost("ring")
    assert "a ring hop does not hide" in choice.reason


def best(choice):
    return min((c for c in choice.costs if c.misfit is None), key=lambda c: c.seconds).strategy


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(32, 32), (32, 8)])
def test_long_sequences_take_the_ring(q_heads, kv_heads):
    # Llama-7B-like heads at 32k tokens over 8 devices: 4096 tokens a device, above
    # alpha x H_kv / H_q (x 2 bytes an element under a causal mask): the hops hide.
    shape = AttentionShape(1, 32768, 8, q_heads, kv_heads, 128)
    choice = choose_strategy(shape)
    assert choice.strategy == best(choice) == "ring"
    assert "S/c = 4096 tokens a device, alpha = 1970 FLOP/byte: a ring hop hides" in choice.reason
    # Hidden hops: the ring costs the attention and its latencies alone.
    compute = shape.flops() / Link().flops_per_second
    assert choice.cost("ring").seconds == pytest.approx(compute + 7 * 10e-6)


def test_reason_follows_the_costs():
    # 2048 tokens a device with H_q = H_kv: above alpha = 1970 but below the 3940 at which a
    # causal chunk's attention outlasts its hop of 2-byte elements, so the hop is exposed.
    shape = AttentionShape(1, 16384, 8, 8, 8, 128)
    choice = choose_strategy(shape)
    compute = shape.flops() / Link().flops_per_second
    assert choice.cost("ring").seconds > compute + 7 * 10e-6
    assert "a ring hop does not hide" in choice.reason
    # Without the causal mask the chunk's attention doubles and hides the hop.
    assert (
        "a ring hop hides"
        in choose_strategy(AttentionShape(1, 16384, 8, 8, 8, 128, causal=False)).reason
    )


def test_short_sequences():
    # 128 tokens a device: nothing hides a hop, and Ulysses moves 4 / 8 of the gather's bytes.
    short = choose_strategy(AttentionShape(1, 1024, 8, 32, 32, 128))
    assert short.strategy == best(short) == "ulysses"
    assert short.cost("ulysses").bytes * 4 == short.cost("all_gather").bytes
    # Tiny shares: the latencies decide, one gather against 7 hops or 4 all-to-alls.
    tiny = choose_strategy(AttentionShape(1, 64, 8, 8, 8, 8))
    assert tiny.strategy == best(tiny) == "all_gather"


def test_ulysses_misfit_is_never_taken():
    # Ulysses would be the fastest (no latency, 128 tokens a device), but 4 heads do not split
    # 8 ways.
    shape = AttentionShape(1, 1024, 8, 4, 4, 128)
    choice = choose_strategy(shape, Link(latency_seconds=0.0))
    fastest = min(choice.costs, key=lambda c: c.seconds)
    assert fastest.strategy == "ulysses"
    assert fastest.misfit is not None
    assert choice.strategy == best(choice) == "ring"
    assert "ulysses: cannot run (ulysses splits the heads of each device 8 ways" in (
        choice.describe()
    )


def test_degree_one():
    choice = choose_strategy(AttentionShape(2, 1024, 1, 8, 2, 64))
    assert choice.strategy == "all_gather"
    assert choice.reason == "the sequence is not split: nothing to exchange"
    assert [c.bytes for c in choice.costs] == [0, 0, 0]


def test_describe():
    cost = Cost("ring", 1.0, 3 * 2**20, 0.00125, 3)
    assert cost.describe() == "ring: 3.00 MiB received, 3 collectives, ~1.25 ms"
    misfit = Cost("ulysses", 1.0, 0, 0.0, 4, misfit="6 heads")
    assert misfit.describe() == "ulysses: cannot run (6 heads)"
    choice = Choice("ring", "why", (cost, misfit))
    assert choice.describe() == (
        "ring (why); ring: 3.00 MiB received, 3 collectives, ~1.25 ms; ulysses: cannot run "
        "(6 heads)"
    )
    assert choice.cost("ulysses") is misfit
