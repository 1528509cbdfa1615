"""``SequenceLayout`` (``flax_escale/context/_layout.py``): the orders, their inverses and
round trips bit for bit (numpy and JAX arrays, pytrees, any axis), the positions, the causal
pairs and imbalance against a brute-force count, the one-line description; the mistakes it
refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flax_escale.context import BALANCES, ContextError, SequenceLayout


def held(layout):
    """The original indices of the tokens each device holds, device by device, written out."""
    n, c = layout.length, layout.degree
    share = n // c
    if layout.balance is None:
        return [list(range(i * share, (i + 1) * share)) for i in range(c)]
    if layout.balance == "striped":
        return [[t for t in range(n) if t % c == i] for i in range(c)]
    half = n // (2 * c)
    chunk = lambda j: list(range(j * half, (j + 1) * half))  # noqa: E731
    return [chunk(i) + chunk(2 * c - 1 - i) for i in range(c)]


def brute_pairs(layout, causal=True):
    """(query, key) pairs each device scores: every pair of the whole sequence tried."""
    n = layout.length
    return tuple(
        sum(1 for q in tokens for k in range(n) if k <= q or not causal) for tokens in held(layout)
    )


CASES = [(8, 2, "dual_chunk"), (8, 2, None), (12, 3, "striped"), (32, 4, "dual_chunk")]
CASES += [(32, 8, None), (32, 8, "striped"), (64, 8, "dual_chunk"), (6, 1, None)]


@pytest.mark.parametrize(("length", "degree", "balance"), CASES)
def test_order_pairs_and_imbalance(length, degree, balance):
    layout = SequenceLayout(length, degree, balance)
    order = layout.permutation
    np.testing.assert_array_equal(order, np.concatenate(held(layout)))
    np.testing.assert_array_equal(order[layout.inverse], np.arange(length))
    np.testing.assert_array_equal(layout.positions(), order)
    assert layout.positions().dtype == np.int32
    assert layout.positions(3).shape == (3, length)
    np.testing.assert_array_equal(layout.positions(3), np.stack([order] * 3))
    assert layout.pairs() == brute_pairs(layout)
    assert layout.pairs(causal=False) == brute_pairs(layout, causal=False)
    pairs = brute_pairs(layout)
    assert layout.imbalance() == pytest.approx(max(pairs) * degree / sum(pairs))
    assert layout.imbalance(causal=False) == 1.0


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_balance_evens_causal_work(degree):
    n = 16 * degree
    assert len(set(SequenceLayout(n, degree, "dual_chunk").pairs())) == 1
    striped = SequenceLayout(n, degree, "striped").pairs()
    assert max(striped) - min(striped) < n  # within one query's row of keys
    contiguous = SequenceLayout(n, degree, None)
    # The last device's share of a contiguous split: about (2c - 1) / c of the mean.
    assert contiguous.imbalance() == pytest.approx((2 * degree - 1) / degree, rel=0.05)
    assert contiguous.imbalance() > SequenceLayout(n, degree, "striped").imbalance() > 1.0


@pytest.mark.parametrize("balance", [*BALANCES, None])
def test_apply_and_restore_round_trip(balance):
    layout = SequenceLayout(16, 4, balance)
    rng = np.random.default_rng(0)
    tree = {
        "tokens": rng.integers(0, 1000, (2, 16)),
        "hidden": jnp.asarray(rng.normal(size=(2, 16, 3)).astype(np.float32)),
        "labels": [rng.integers(0, 9, (2, 16)).astype(np.int8)],
    }
    moved = layout.apply(tree)
    assert isinstance(moved["tokens"], np.ndarray)
    assert isinstance(moved["hidden"], jax.Array)
    assert moved["labels"][0].dtype == np.int8
    np.testing.assert_array_equal(moved["tokens"], tree["tokens"][:, layout.permutation])
    np.testing.assert_array_equal(
        np.asarray(moved["hidden"]), np.asarray(tree["hidden"])[:, layout.permutation]
    )
    back = layout.restore(moved)
    jax.tree.map(np.testing.assert_array_equal, back, tree)
    # Another axis: the sequence first (one sequence), or last.
    x = rng.normal(size=(16, 5))
    np.testing.assert_array_equal(layout.apply(x, axis=0), x[layout.permutation])
    np.testing.assert_array_equal(layout.restore(layout.apply(x, axis=0), axis=0), x)
    y = jnp.asarray(rng.normal(size=(3, 16)))
    np.testing.assert_array_equal(
        np.asarray(layout.apply(y, axis=-1)), np.asarray(y)[:, layout.permutation]
    )


@settings(max_examples=25, deadline=None)
@given(
    degree=st.integers(1, 8),
    per_device=st.integers(1, 4),
    balance=st.sampled_from([*BALANCES, None]),
)
def test_layout_properties(degree, per_device, balance):
    length = 2 * degree * per_device
    layout = SequenceLayout(length, degree, balance)
    order = layout.permutation
    assert sorted(order.tolist()) == list(range(length))
    x = np.arange(length) * 10 + 1
    np.testing.assert_array_equal(layout.restore(layout.apply(x, axis=0), axis=0), x)
    np.testing.assert_array_equal(layout.apply(x, axis=0), x[order])
    assert layout.pairs() == brute_pairs(layout)
    assert sum(layout.pairs()) == length * (length + 1) // 2
    if balance == "dual_chunk":
        assert len(set(layout.pairs())) == 1


def test_describe():
    assert SequenceLayout(8, 2, "dual_chunk").describe() == (
        "8 tokens over 2 devices, device i holds chunks i and 3-i of 4; causal work: busiest "
        "device 1.00x the mean"
    )
    assert SequenceLayout(8, 2, None).describe() == (
        "8 tokens over 2 devices, contiguous, not balanced; causal work: busiest device 1.44x "
        "the mean"
    )
    # Striped: device 2 holds tokens 2, 5, 8, 11 (30 causal pairs) of the mean 26.
    assert SequenceLayout(12, 3, "striped").describe() == (
        "12 tokens over 3 devices, token t on device t mod 3; causal work: busiest device 1.15x "
        "the mean"
    )
    assert SequenceLayout(8, 1).describe() == "8 tokens on one device"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (12, 4, "dual_chunk"),
            r"12 tokens does not split into 2 x 4 chunks .* multiple of 8 \(e\.g\. 16\)",
        ),
        ((10, 4, None), r"10 tokens does not split into 4 devices: .* multiple of 4 \(e\.g\. 12\)"),
        ((10, 4, "striped"), r"10 tokens does not split into 4 devices"),
        (
            (8, 2, "zigzag"),
            r"balance must be one of \('dual_chunk', 'striped'\) or None, got 'zigzag'",
        ),
    ],
    ids=["dual_chunk", "contiguous", "striped", "balance"],
)
def test_refuses(args, message):
    with pytest.raises(ContextError, match=message):
        SequenceLayout(*args)


def test_apply_refuses_wrong_length():
    layout = SequenceLayout(16, 4)
    with pytest.raises(
        ContextError, match=r"shape \(2, 12\) has 12 entries along axis 1, not the layout's 16"
    ):
        layout.apply({"tokens": np.zeros((2, 12))})
    with pytest.raises(ContextError, match=r"SequenceLayout\.restore: .* along axis 0"):
        layout.restore(jnp.zeros((2, 16)), axis=0)
    # One sequence without a batch axis, or a scalar among the arrays: axis 1 is not there.
    with pytest.raises(ContextError, match=r"shape \(16,\) has no axis 1, not the layout's 16"):
        layout.apply(np.zeros(16))
    with pytest.raises(ContextError, match=r"shape \(\) has no axis 1"):
        layout.apply({"tokens": np.zeros((2, 16)), "step": 3})
