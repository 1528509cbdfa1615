"""``attention_work`` (``flax_escale/context/_attention.py``, counters of ``_blocks.attend``):
the blocks and pairs each device computes under a causal mask, counted by the running program
and compared with an independent count over the whole sequence: balanced layouts give every
device the same work, a contiguous split gives device i 4i + 3 blocks and the last device
about (2c - 1) / c of the mean pairs, packed documents skip more blocks."""

import numpy as np
import pytest

import flax_escale as fe
from flax_escale.context import SequenceLayout, attention_work

SEQ = 32


def documents(lengths):
    segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    return segments.astype(np.int32), positions.astype(np.int32)


def counted(positions, segments, degree):
    """Blocks and pairs each device scores, by trying every (query, key) pair of the sequence.

    ``positions`` and ``segments`` are in the layout's order; device ``i`` holds the ``i``-th
    ``1 / degree`` of it, and blocks are runs of ``SEQ / (2 * degree)`` tokens in that order
    (each device's share cut in two; keys from every device alike)."""
    block, share = SEQ // (2 * degree), SEQ // degree
    scored = (positions[:, None] >= positions[None, :]) & (segments[:, None] == segments[None, :])
    blocks, pairs = [], []
    for i in range(degree):
        rows = scored[i * share : (i + 1) * share]
        pairs.append(int(rows.sum()))
        blocks.append(
            sum(
                bool(rows[qb : qb + block, kb : kb + block].any())
                for qb in range(0, share, block)
                for kb in range(0, SEQ, block)
            )
        )
    return np.array(blocks), np.array(pairs)


# Each row: its balance and its documents' lengths (one: not packed).
ROWS = {
    2: [("dual_chunk", (SEQ,)), (None, (SEQ,)), ("striped", (SEQ,)), (None, (7, 12, 13))],
    4: [("dual_chunk", (SEQ,)), (None, (SEQ,)), ("striped", (SEQ,)), ("dual_chunk", (20, 12))],
    8: [("dual_chunk", (SEQ,)), (None, (SEQ,))],
}


def run_rows(degree, rows, strategy):
    """Each row's per-device (blocks, pairs) as counted while running, with the row alone on a
    data-parallel device (dp = 8 / degree rows a call), and the independent count."""
    per_call = 8 // degree
    mesh = fe.create_mesh((per_call, 1, 1, 1, degree))
    found = []
    for start in range(0, len(rows), per_call):
        group = rows[start : start + per_call]
        layouts = [SequenceLayout(SEQ, degree, balance) for balance, _ in group]
        segs, poss = zip(*(documents(lengths) for _, lengths in group), strict=True)
        segs = np.stack([lay.apply(s, axis=0) for lay, s in zip(layouts, segs, strict=True)])
        poss = np.stack([lay.apply(p, axis=0) for lay, p in zip(layouts, poss, strict=True)])
        q = np.ones((per_call, SEQ, 2, 4), np.float32)
        work = attention_work(
            q, q, q, positions=poss, segment_ids=segs, strategy=strategy, mesh=mesh
        )
        assert work.plan.strategy == strategy
        assert work.axis_names == mesh.axis_names
        assert work.blocks.shape == work.pairs.shape == tuple(mesh.shape.values())
        for r in range(len(group)):
            got = work.blocks[r, 0, 0, 0], work.pairs[r, 0, 0, 0]
            found.append((got, counted(poss[r], segs[r], degree)))
        blocks, pairs = work.along_context()  # the first row's
        np.testing.assert_array_equal(blocks, work.blocks[0, 0, 0, 0])
        np.testing.assert_array_equal(pairs, work.pairs[0, 0, 0, 0])
    return found


@pytest.mark.parametrize(("degree", "strategy"), [(2, "ring"), (4, "all_gather"), (8, "ring")])
def test_causal_work_per_device(degree, strategy):
    rows = ROWS[degree]
    found = run_rows(degree, rows, strategy)
    for (balance, lengths), ((blocks, pairs), (want_blocks, want_pairs)) in zip(
        rows, found, strict=True
    ):
        np.testing.assert_array_equal(blocks, want_blocks, err_msg=f"{balance} {lengths}")
        np.testing.assert_array_equal(pairs, want_pairs, err_msg=f"{balance} {lengths}")
        if len(lengths) > 1:
            continue
        if balance == "dual_chunk":  # every device the same work
            assert len(set(blocks.tolist())) == 1
            assert len(set(pairs.tolist())) == 1
            assert blocks[0] == 2 * degree + 1  # (2c)(2c + 1) / 2 blocks over c devices
        elif balance == "striped":  # within one query's row of keys
            assert pairs.max() - pairs.min() <= SEQ
        else:  # contiguous: device i's queries see 2i + 1 and 2i + 2 key blocks
            np.testing.assert_array_equal(blocks, 4 * np.arange(degree) + 3)
            ratio = pairs.max() / pairs.mean()
            assert ratio == want_pairs.max() / want_pairs.mean()
            assert ratio == pytest.approx((2 * degree - 1) / degree, rel=0.1)
            assert ratio > 1.3
    # Packed documents: the blocks between documents are skipped too.
    for (balance, lengths), ((blocks, _), _) in zip(rows, found, strict=True):
        if len(lengths) > 1:
            whole = found[rows.index((balance, (SEQ,)))][0][0]
            assert blocks.sum() < whole.sum()
