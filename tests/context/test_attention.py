"""``context_attention`` (``flax_escale/context/_attention.py``): outputs and gradients equal a
single-device softmax attention for every strategy, context degree, balance and mask, on Auto
and Explicit meshes, with heads on tp and the batch on fsdp; the mistakes it refuses.

Each compiled program carries several cases in its batch rows: the mask comes from each row's
own positions and segment ids, so one row can hold a balanced order, another the sequence in
order, another packed documents, and one compile checks them all (forward and gradients)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.context import (
    ContextError,
    SequenceLayout,
    context_attention,
    plan_attention,
)

QUICK_COMPILE = {"xla_backend_optimization_level": 0}
SEQ = 32


def reference(q, k, v, mask):
    """Softmax attention on one device, in the sequence's original order; ``mask`` is
    ``(batch, queries, keys)``, grouped K/V heads repeated for their query heads."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def value_and_grads(attention, q, k, v, weights):
    """The output and the gradients (q, k, v) of the weighted sum of the output."""

    def loss(q, k, v):
        out = attention(q, k, v)
        return jnp.sum(out * weights), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


@functools.partial(jax.jit, static_argnums=(5,), compiler_options=QUICK_COMPILE)
def _reference_value_and_grads(q, k, v, mask, weights, _):
    return value_and_grads(lambda q, k, v: reference(q, k, v, mask), q, k, v, weights)


def documents(lengths):
    """Segment ids and positions (restarting at each document) of documents packed in a row."""
    segments = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    return segments.astype(np.int32), positions.astype(np.int32)


# Each row: the balance its tokens are reordered by, and its documents' lengths (one document:
# not packed).
ROWS = (
    ("dual_chunk", (SEQ,)),
    (None, (SEQ,)),
    ("striped", (5, 11, 3, 13)),
    ("dual_chunk", (16, 9, 7)),
)


class Case:
    """Random q, k, v and weights in the original order, the mask of each row, and the same
    arrays reordered row by row as each row's layout says."""

    def __init__(self, degree, q_heads, kv_heads, head_dim=4, rows=ROWS, causal=True, seed=0):
        keys = jax.random.split(jax.random.key(seed), 4)
        b = len(rows)
        self.q = jax.random.normal(keys[0], (b, SEQ, q_heads, head_dim))
        self.k = jax.random.normal(keys[1], (b, SEQ, kv_heads, head_dim))
        self.v = jax.random.normal(keys[2], (b, SEQ, kv_heads, head_dim))
        self.weights = jax.random.normal(keys[3], self.q.shape)
        self.layouts = [SequenceLayout(SEQ, degree, balance) for balance, _ in rows]
        segments, positions = zip(*(documents(lengths) for _, lengths in rows), strict=True)
        segments, positions = np.stack(segments), np.stack(positions)
        index = np.arange(SEQ)
        mask = segments[:, :, None] == segments[:, None, :]
        if causal:
            mask &= index[:, None] >= index[None, :]
        self.mask = mask
        self.positions = self.permuted(positions)
        self.segment_ids = self.permuted(segments)

    def permuted(self, x):
        return np.stack([lay.apply(row, axis=0) for lay, row in zip(self.layouts, x, strict=True)])

    def restored(self, x):
        x = np.asarray(x)
        return np.stack(
            [lay.restore(row, axis=0) for lay, row in zip(self.layouts, x, strict=True)]
        )

    def inputs(self):
        return tuple(self.permuted(np.asarray(x)) for x in (self.q, self.k, self.v, self.weights))

    def want(self):
        return _reference_value_and_grads(self.q, self.k, self.v, self.mask, self.weights, None)

    def check(self, got):
        out, grads = got
        want_out, want_grads = self.want()
        for name, g, w in zip(
            ("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want_grads), strict=True
        ):
            w = np.asarray(w)
            np.testing.assert_allclose(
                self.restored(g), w, rtol=1e-5, atol=1e-6 * np.abs(w).max(), err_msg=name
            )


def run(case, mesh, packed=True, **kwargs):
    """Forward and gradients of ``context_attention`` over ``case``'s reordered rows, in one
    compiled program; without ``packed``, no segment ids are passed (one document a row)."""

    @functools.partial(jax.jit, compiler_options=QUICK_COMPILE)
    def both(q, k, v, weights, positions, segment_ids):
        attention = functools.partial(
            context_attention, positions=positions, segment_ids=segment_ids, mesh=mesh, **kwargs
        )
        return value_and_grads(attention, q, k, v, weights)

    with jax.set_mesh(mesh):
        return both(*case.inputs(), case.positions, case.segment_ids if packed else None)


# Rows of one document each: the attention runs without segment ids.
UNPACKED = (("dual_chunk", (SEQ,)), (None, (SEQ,)), ("striped", (SEQ,)), ("dual_chunk", (SEQ,)))


class Setup(NamedTuple):
    """One compiled program: a strategy, a mesh (dp, fsdp, ep, tp, sp), the heads, the mask."""

    strategy: str
    mesh: tuple[int, ...]
    axis_types: str | None = None
    heads: tuple[int, int] = (16, 8)
    causal: bool = True
    rows: tuple = ROWS

    @property
    def degree(self):
        return self.mesh[-1]


# Every strategy at every context degree, on Auto and on Explicit axes; the batch on fsdp or
# dp; query heads on tp (fsdp2 x tp2 x sp2), and key/value heads kept whole where tp does not
# divide them (tp4 x sp2: 2 of them for 8 query heads); no causal mask; no segment ids.
GRID = {
    "all_gather-sp2-fsdp4": Setup("all_gather", (1, 4, 1, 1, 2)),
    "all_gather-sp4-fsdp2-explicit": Setup("all_gather", (1, 2, 1, 1, 4), "explicit"),
    "all_gather-sp8": Setup("all_gather", (1, 1, 1, 1, 8)),
    "ring-sp2-tp4-kv_whole-not_causal": Setup("ring", (1, 1, 1, 4, 2), heads=(8, 2), causal=False),
    "ring-sp4-dp2": Setup("ring", (2, 1, 1, 1, 4)),
    "ring-sp8-explicit": Setup("ring", (1, 1, 1, 1, 8), "explicit"),
    "ulysses-sp2-fsdp2-tp2-unpacked": Setup(
        "ulysses", (1, 2, 1, 2, 2), heads=(16, 4), rows=UNPACKED
    ),
    "ulysses-sp4-fsdp2-explicit": Setup("ulysses", (1, 2, 1, 1, 4), "explicit"),
    "ulysses-sp8": Setup("ulysses", (1, 1, 1, 1, 8)),
}


def check_setup(setup, strategy):
    mesh = fe.create_mesh(setup.mesh, axis_types=setup.axis_types)
    case = Case(setup.degree, *setup.heads, rows=setup.rows, causal=setup.causal)
    packed = any(len(lengths) > 1 for _, lengths in setup.rows)
    got = run(case, mesh, packed=packed, causal=setup.causal, strategy=strategy)
    case.check(got)


@pytest.mark.parametrize("setup", GRID.values(), ids=GRID.keys())
def test_equals_one_device(setup):
    check_setup(setup, setup.strategy)


def test_auto_equals_one_device():
    # Tiny shares: the collectives' latencies decide, and one gather is the cheapest.
    setup = GRID["all_gather-sp8"]
    q = jax.ShapeDtypeStruct((len(ROWS), SEQ, *setup.heads[:1], 4), jnp.float32)
    plan = plan_attention(q, q, mesh=fe.create_mesh(setup.mesh))
    assert plan.strategy == plan.choice.strategy == "all_gather"
    check_setup(setup, "auto")


def test_plan_of_heads_on_tp():
    # fsdp2 x tp2 x sp2: each device holds 8 of the 16 query heads and 2 of the 4 key/value
    # heads (groups of 4); Ulysses splits them again over sp.
    q, k = spec(4, SEQ, 16, 4), spec(4, SEQ, 4, 4)
    plan = plan_attention(q, k, strategy="ulysses", mesh=fe.create_mesh((1, 2, 1, 2, 2)))
    assert (plan.axes, plan.head_axes, plan.kv_whole, plan.group) == (("sp",), ("tp",), False, 4)
    assert (plan.shape.batch, plan.shape.q_heads, plan.shape.kv_heads) == (2, 8, 2)
    assert plan.query_spec == P(("fsdp", "dp"), "sp", "tp", None)
    assert plan.kv_spec == P(("fsdp", "dp"), "sp", "tp", None)
    # tp4 x sp2 with 2 key/value heads: tp does not divide them, each device keeps the one its
    # 2 query heads read.
    q, k = spec(4, SEQ, 8, 4), spec(4, SEQ, 2, 4)
    plan = plan_attention(q, k, strategy="ring", mesh=fe.create_mesh((1, 1, 1, 4, 2)))
    assert plan.kv_whole
    assert (plan.shape.q_heads, plan.shape.kv_heads) == (2, 1)
    assert plan.kv_spec == P(("fsdp", "dp"), "sp", None, None)


def spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.mark.parametrize(
    ("query", "key", "kwargs", "message"),
    [
        (
            spec(2, 30, 4, 8),
            spec(2, 30, 2, 8),
            {},
            r"a sequence of 30 tokens does not split over the context axes sp=4 .* \(e\.g\. 32\)",
        ),
        (spec(2, 32, 4, 8), spec(2, 32, 2, 8), {"strategy": "tree"}, "got 'tree'"),
        (
            spec(2, 32, 6, 8),
            spec(2, 32, 2, 8),
            {"strategy": "ulysses"},
            "splits the heads of each device 4 ways, but there are 6 query and 2 key/value",
        ),
        (spec(2, 32, 4, 8), spec(2, 16, 2, 8), {}, r"query \(2, 32, 4, 8\) and key \(2, 16, 2"),
        (spec(2, 32, 4, 8), spec(2, 32, 3, 8), {}, "a multiple of the key/value heads"),
        (spec(2, 32, 4, 8), spec(2, 32, 2, 4), {}, "the same batch, sequence and head_dim"),
        (spec(32, 4, 8), spec(2, 32, 2, 8), {}, r"query must be .* got shape \(32, 4, 8\)"),
    ],
    ids=["sequence", "strategy", "ulysses-heads", "sequences", "heads", "head-dim", "rank"],
)
def test_plan_refuses(query, key, kwargs, message):
    mesh = fe.create_mesh((1, 2, 1, 1, 4))
    with pytest.raises(ContextError, match=message):
        plan_attention(query, key, mesh=mesh, **kwargs)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"value": (2, 32, 2, 4)}, r"value \(2, 32, 2, 4\) must have the shape of key"),
        ({"positions": (2, 16)}, r"positions must be \(batch, sequence\) = \(2, 32\) .* \(2, 16\)"),
        ({"segment_ids": (32,)}, r"segment_ids must be .* got \(32,\)"),
    ],
    ids=["value", "positions", "segment_ids"],
)
def test_attention_refuses(shapes, message):
    # Refused before anything is traced or compiled.
    mesh = fe.create_mesh((1, 2, 1, 1, 4))
    arrays = {"value": (2, 32, 2, 8), "positions": None, "segment_ids": None} | shapes
    q, k = jnp.zeros((2, 32, 4, 8)), jnp.zeros((2, 32, 2, 8))
    value = jnp.zeros(arrays.pop("value"))
    tokens = {n: None if s is None else jnp.zeros(s, jnp.int32) for n, s in arrays.items()}
    with pytest.raises(ContextError, match=message):
        context_attention(q, k, value, mesh=mesh, **tokens)


def test_ulysses_heads_named_with_tp():
    # 8 query heads over tp2 leave 4 a device; sp8 cannot split them.
    mesh = fe.create_mesh((1, 1, 1, 2, 4))
    with pytest.raises(ContextError, match=r"of 8 and 2 in all, split over tp=2"):
        plan_attention(spec(2, 32, 8, 8), spec(2, 32, 2, 8), strategy="ulysses", mesh=mesh)
