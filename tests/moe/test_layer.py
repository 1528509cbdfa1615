"""``moe_mlp`` (``flax_escale/moe/_layer.py``) against a dense reference written here, unsharded
and on meshes of 8 devices.

The reference (numpy, float64) routes each token to the top-k experts of a softmax of
``x @ router``, renormalizes their weights, and sums ``weight * expert(x)`` over them, where
expert ``e`` is ``(silu(x @ wi_gate[e]) * (x @ wi_up[e])) @ wo[e]``. With a capacity, the
assignments are seated per sequence in GShard's order (every first choice in token order, then
every second choice), and those past an expert's capacity contribute nothing.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.example_modules import load

import flax_escale as fe
from flax_escale.moe import (
    EXPERT_AXES,
    STRATEGIES,
    GatedExperts,
    MoeOutput,
    expert_capacity,
    moe_mlp,
)
from flax_escale.sizing._hlo import program_costs

BATCH, SEQUENCE, HIDDEN, MLP, EXPERTS, TOP_K = 8, 16, 32, 64, 8, 2


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1 + np.exp(-z))


def _routing(x: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    # The data must not be ambiguous: the k-th and the next logit are well apart (float32's
    # rounding of x @ router is ~1e-5 here).
    ranked = np.take_along_axis(probs, order, -1)
    if top_k < probs.shape[-1]:
        kth = np.take_along_axis(logits, order[..., top_k - 1 : top_k + 1], -1)
        assert (kth[..., 0] - kth[..., 1] > 1e-3).all()
    chosen = order[..., :top_k]
    top = ranked[..., :top_k]
    return chosen, top / top.sum(-1, keepdims=True)


def _seated(chosen: np.ndarray, num_experts: int, capacity: int | None) -> np.ndarray:
    """Which assignments ``(group, token, choice)`` find a slot, in GShard's priority."""
    seated = np.ones(chosen.shape, bool)
    if capacity is None:
        return seated
    groups, tokens, top_k = chosen.shape
    for g in range(groups):
        taken = np.zeros(num_experts, int)
        for k in range(top_k):  # every first choice before any second choice
            for t in range(tokens):  # earlier tokens first
                e = chosen[g, t, k]
                if taken[e] < capacity:
                    taken[e] += 1
                else:
                    seated[g, t, k] = False
    return seated


def reference(x, router, experts, top_k, capacity=None):
    """The dense output and how many assignments were dropped."""
    x, router = np.asarray(x, np.float64), np.asarray(router, np.float64)
    wi_gate, wi_up, wo = (np.asarray(w, np.float64) for w in experts)
    chosen, weights = _routing(x, router, top_k)
    seated = _seated(chosen, wi_gate.shape[0], capacity)
    out = np.zeros_like(x)
    for b, s, k in zip(*np.nonzero(seated), strict=True):
        e = chosen[b, s, k]
        token = x[b, s]
        out[b, s] += weights[b, s, k] * ((_silu(token @ wi_gate[e]) * (token @ wi_up[e])) @ wo[e])
    return out, int((~seated).sum())


def _jitted(**options):
    """``moe_mlp`` with ``options``, jitted (eager, every small op compiles on its own)."""
    return jax.jit(lambda x, router, experts: moe_mlp(x, router, experts, **options))


def _inputs(seed=0, batch=BATCH, sequence=SEQUENCE, hidden=HIDDEN, mlp=MLP, experts=EXPERTS):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    x = normal(batch, sequence, hidden)
    router = normal(hidden, experts)
    kernels = GatedExperts(
        normal(experts, hidden, mlp, scale=0.1),
        normal(experts, hidden, mlp, scale=0.1),
        normal(experts, mlp, hidden, scale=0.1),
    )
    return x, router, kernels


@pytest.fixture(scope="module")
def inputs():
    return _inputs()


def _roomy(strategy, factor):
    """``moe_mlp``'s options for ``strategy``, with a capacity ``factor`` where it has one."""
    if strategy == "capacity":
        return {"strategy": strategy, "capacity_factor": factor}
    return {"strategy": strategy}


# --- one device ---------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_both_strategies_equal_the_dense_reference(inputs, strategy, top_k):
    x, router, experts = inputs
    # A factor of E / k gives every expert room for every token of a sequence.
    got = _jitted(top_k=top_k, **_roomy(strategy, EXPERTS / top_k))(x, router, experts)
    assert isinstance(got, MoeOutput)
    want, dropped = reference(x, router, experts, top_k)
    assert dropped == 0
    assert got.output.shape == x.shape
    assert got.dropped.dtype == jnp.int32
    assert int(got.dropped) == 0
    np.testing.assert_allclose(np.asarray(got.output), want, atol=1e-5, rtol=1e-5)
    assert got.aux_loss.shape == ()
    assert 1.0 <= float(got.aux_loss) <= EXPERTS


def test_the_strategies_agree_under_jit(inputs):
    x, router, experts = inputs

    @jax.jit
    def both(x, router, experts):
        return [moe_mlp(x, router, experts, top_k=2, **_roomy(s, 8.0)) for s in STRATEGIES]

    capacity, dropless = both(x, router, experts)
    np.testing.assert_allclose(capacity.output, dropless.output, atol=1e-5, rtol=1e-5)
    assert float(capacity.aux_loss) == float(dropless.aux_loss)


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 1.25])
def test_capacity_drops_and_counts_what_overflows(inputs, factor):
    x, router, experts = inputs
    capacity = expert_capacity(SEQUENCE, EXPERTS, TOP_K, factor)
    want, dropped = reference(x, router, experts, TOP_K, capacity=capacity)
    assert dropped > 0  # these factors overflow some expert of this data
    got = _jitted(top_k=TOP_K, capacity_factor=factor)(x, router, experts)
    assert int(got.dropped) == dropped
    # What is dropped contributes nothing; everything else is as the reference's.
    np.testing.assert_allclose(np.asarray(got.output), want, atol=1e-5, rtol=1e-5)


def test_first_choices_are_seated_before_second_choices():
    # Three tokens, three experts, one slot each (capacity = ceil(0.5 * 3 * 2 / 3) = 1). Token t
    # prefers expert t, then expert t + 1: by token order token 0's second choice (expert 1)
    # would take token 1's first choice's slot; GShard's priority seats all three first choices.
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 2.0]])
    x = jnp.asarray(np.concatenate([logits, np.ones((3, 1))], axis=1)[None], jnp.float32)
    router = jnp.asarray(np.eye(4)[:, :3], jnp.float32)
    _, _, experts = _inputs(hidden=4, mlp=8, experts=3)
    assert expert_capacity(3, 3, 2, 0.5) == 1
    got = _jitted(top_k=2, capacity_factor=0.5)(x, router, experts)
    assert int(got.dropped) == 3
    want, dropped = reference(x, router, experts, 2, capacity=1)
    assert dropped == 3
    np.testing.assert_allclose(np.asarray(got.output), want, atol=1e-6, rtol=1e-6)
    # Each token got only its first expert, at its first weight e / (e + e^(1)) = e / (e + 1).
    first = np.e / (np.e + 1)
    tokens, out = np.asarray(x, np.float64)[0], np.asarray(got.output)[0]
    wi_gate, wi_up, wo = (np.asarray(w, np.float64) for w in experts)
    for t in range(3):
        expert = (_silu(tokens[t] @ wi_gate[t]) * (tokens[t] @ wi_up[t])) @ wo[t]
        np.testing.assert_allclose(out[t], first * expert, atol=1e-6)


def test_dropless_never_drops(inputs):
    x, router, experts = inputs
    # Every token to experts 0 and 1 (a constant feature with a large router weight): a
    # capacity of an even share would drop three quarters of the assignments.
    x = x.at[..., 0].set(5.0)
    router = (router * 0.1).at[0, :2].set(2.0)
    chosen, _ = _routing(np.asarray(x, np.float64), np.asarray(router, np.float64), 2)
    assert set(np.unique(chosen)) == {0, 1}
    dropless = _jitted(top_k=2, strategy="dropless")(x, router, experts)
    capacity = _jitted(top_k=2, capacity_factor=1.0)(x, router, experts)
    want, _ = reference(x, router, experts, 2)
    assert int(dropless.dropped) == 0
    # Capacity 4 of each expert per sequence of 16: 12 of each expert's 16 dropped.
    assert int(capacity.dropped) == BATCH * 2 * (SEQUENCE - 4)
    np.testing.assert_allclose(np.asarray(dropless.output), want, atol=1e-5, rtol=1e-5)


# --- on meshes of 8 devices ---------------------------------------------------------------------

MESH_DIMS = {
    "ep8": (1, 1, 8, 1, 1),
    "fsdp2_ep4": (1, 2, 4, 1, 1),
    "fsdp2_ep2_tp2": (1, 2, 2, 2, 1),
    "dp2_ep4": (2, 1, 4, 1, 1),
}
RULES = {"ep_as_fsdp": fe.PartitionAxis(ep_as_fsdp=True), "default": fe.PartitionAxis()}
# Sharded, the capacity strategy runs with a factor that drops some assignments, so that the
# count and the dropped tokens' missing share are compared as well; the dropless one its
# exchange.
SHARDED_OPTIONS = {"capacity": {"capacity_factor": 1.0}, "dropless": {"exchange": "all_to_all"}}


def _step(strategy, rules=None):
    """The output, aux loss, dropped count and gradients of a scalar loss, as one program."""
    cotangent = np.random.default_rng(7).standard_normal((BATCH, SEQUENCE, HIDDEN))
    cotangent = jnp.asarray(cotangent, jnp.float32)

    def loss(x, router, experts):
        out = moe_mlp(
            x,
            router,
            experts,
            top_k=TOP_K,
            strategy=strategy,
            rules=rules,
            **SHARDED_OPTIONS[strategy],
        )
        return jnp.sum(out.output * cotangent) + 0.1 * out.aux_loss, out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.fixture(scope="module")
def unsharded(inputs):
    return {strategy: _step(strategy)(*inputs) for strategy in STRATEGIES}


def test_unsharded_steps_match_the_reference(inputs, unsharded):
    x, router, experts = inputs
    (_, dropless), _ = unsharded["dropless"]
    (_, capacity), _ = unsharded["capacity"]
    want, _ = reference(x, router, experts, TOP_K)
    np.testing.assert_allclose(np.asarray(dropless.output), want, atol=1e-5, rtol=1e-5)
    want, dropped = reference(x, router, experts, TOP_K, capacity=expert_capacity(16, 8, 2, 1.0))
    assert int(capacity.dropped) == dropped > 0
    np.testing.assert_allclose(np.asarray(capacity.output), want, atol=1e-5, rtol=1e-5)


def _assert_trees_close(got, want):
    for path, g, w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0],
        jax.tree.leaves(got),
        jax.tree.leaves(want),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5, err_msg=str(path[0])
        )


@pytest.mark.parametrize("rules_name", RULES)
@pytest.mark.parametrize("mesh_name", MESH_DIMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_outputs_and_gradients_match_the_unsharded_ones(
    inputs, unsharded, strategy, mesh_name, rules_name
):
    mesh = fe.create_mesh(MESH_DIMS[mesh_name])
    step = _step(strategy, RULES[rules_name])
    with jax.set_mesh(mesh):
        compiled = step.lower(*inputs).compile()
        (loss, out), grads = compiled(*inputs)
    (want_loss, want_out), want_grads = unsharded[strategy]
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.output), want_out.output, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(out.aux_loss), float(want_out.aux_loss), rtol=1e-6)
    assert int(out.dropped) == int(want_out.dropped)
    assert [g.shape for g in jax.tree.leaves(grads)] == [
        g.shape for g in jax.tree.leaves(want_grads)
    ]
    _assert_trees_close(grads, want_grads)
    # The output leaves in the activations' layout: its batch over ep only with ep_as_fsdp.
    batch = out.output.sharding.spec[0] if out.output.sharding.spec else None
    batch_axes = (batch,) if isinstance(batch, str) else tuple(batch or ())
    assert ("ep" in batch_axes) == RULES[rules_name].ep_as_fsdp
    if strategy == "dropless":
        assert "all-to-all" in compiled.as_text()


@pytest.mark.parametrize("mesh_name", ["ep8", "fsdp2_ep2_tp2", "dp2_ep4"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_explicit_mesh_axes_give_the_unsharded_results(inputs, unsharded, strategy, mesh_name):
    # On Explicit axes every layout change is a reshard the code asks for: the combine's
    # operands must agree on the groups' sharding, and shard_map's specs on the inputs' types
    # (which leave size-1 axes out).
    mesh = fe.create_mesh(MESH_DIMS[mesh_name], axis_types="explicit")
    with jax.set_mesh(mesh):
        (loss, out), grads = _step(strategy, RULES["ep_as_fsdp"])(*inputs)
    (want_loss, want_out), want_grads = unsharded[strategy]
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out.output), want_out.output, atol=1e-5, rtol=1e-5)
    assert int(out.dropped) == int(want_out.dropped)
    _assert_trees_close(grads, want_grads)


# --- what the dropless exchange moves -----------------------------------------------------------


def _int32_all_to_alls(text: str) -> int:
    """How many all-to-all ops of the program move int32 (s32) arrays only."""
    ops = [line for line in text.splitlines() if re.search(r"= .*\ball-to-all\(", line)]
    return sum(1 for op in ops if "s32[" in op.split("all-to-all(")[0] and "f32[" not in op)


@pytest.mark.parametrize("with_gradients", [False, True])
def test_dropless_all_to_all_bytes_are_the_analytic_count(inputs, with_gradients):
    # ep=8 with ep_as_fsdp: each device holds batch * sequence / 8 tokens and one expert.
    ep = 8
    rules = fe.PartitionAxis(ep_as_fsdp=True)
    mesh = fe.create_mesh(MESH_DIMS["ep8"])
    if with_gradients:
        program = _step("dropless", rules)
    else:
        program = jax.jit(
            lambda x, r, e: moe_mlp(x, r, e, top_k=TOP_K, strategy="dropless", rules=rules)
        )
    with jax.set_mesh(mesh):
        compiled = program.lower(*inputs).compile()
    local_tokens = BATCH * SEQUENCE // ep
    rows = local_tokens * TOP_K
    itemsize = jnp.dtype(jnp.float32).itemsize
    # Tokens out to the experts and back, each a padded (ep, rows, hidden) buffer; the same
    # two again backward (their transposes).
    token_ops = 4 if with_gradients else 2
    # The per-expert counts, (ep, experts per device) int32, exchanged once: the backward
    # pass reuses the forward's.
    assert _int32_all_to_alls(compiled.as_text()) == 1
    counts = EXPERTS * jnp.dtype(jnp.int32).itemsize
    cost = program_costs(compiled).collectives["all-to-all"]
    assert cost.count == token_ops + 1
    assert cost.bytes == token_ops * ep * rows * HIDDEN * itemsize + counts
    assert cost.bytes == (131104 if with_gradients else 65568)


# --- mistakes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"strategy": "sparse"},
            fe.EscaleError,
            r"moe_mlp: strategy must be one of \('capacity', 'dropless'\), got 'sparse'\.",
        ),
        (
            {"strategy": "dropless", "exchange": "ppermute"},
            fe.EscaleError,
            r"moe_mlp: exchange must be one of \('all_to_all', 'ragged_all_to_all'\), got "
            r"'ppermute'\.",
        ),
        (
            {"capacity_factor": 0},
            fe.EscaleError,
            r"moe_mlp: capacity_factor must be a finite number above 0, got 0",
        ),
        (
            {"capacity_factor": -1.5},
            fe.EscaleError,
            r"moe_mlp: capacity_factor must be a finite number above 0, got -1\.5",
        ),
        ({"capacity_factor": "2"}, fe.EscaleTypeError, r"moe_mlp: capacity_factor"),
        ({"top_k": 9}, fe.EscaleError, r"top_k must be an int from 1 to the number of experts"),
    ],
)
def test_bad_options_are_refused(inputs, change, error, match):
    x, router, experts = inputs
    with pytest.raises(error, match=match):
        moe_mlp(x, router, experts, **{"top_k": 2, **change})


def test_experts_must_be_gated_experts(inputs):
    x, router, experts = inputs
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"(?s)experts must be a GatedExperts, got tuple.*GatedExperts\(wi_gate, wi_up, wo\)",
    ):
        moe_mlp(x, router, tuple(experts), top_k=2)
    with pytest.raises(
        fe.EscaleTypeError, match=r"experts must be a GatedExperts instance, got the class"
    ):
        moe_mlp(x, router, GatedExperts, top_k=2)


def test_an_x_that_is_not_three_dimensional_is_named(inputs):
    _, router, experts = inputs
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"moe_mlp: x must be (batch, sequence, hidden) and experts.wi_gate (experts, hidden, "
            f"mlp), got shapes ({BATCH}, {SEQUENCE}) and {tuple(experts.wi_gate.shape)}."
        ),
    ):
        moe_mlp(jnp.zeros((BATCH, SEQUENCE)), router, experts, top_k=2)


@pytest.mark.parametrize(
    ("argument", "shape", "named", "want"),
    [
        ("router", (HIDDEN + 1, EXPERTS), "router_kernel", (HIDDEN, EXPERTS)),
        ("router", (HIDDEN, EXPERTS - 1), "router_kernel", (HIDDEN, EXPERTS)),
        ("wi_up", (EXPERTS, HIDDEN, MLP + 2), "experts.wi_up", (EXPERTS, HIDDEN, MLP)),
        ("wo", (EXPERTS, HIDDEN, MLP), "experts.wo", (EXPERTS, MLP, HIDDEN)),
        ("wo", (EXPERTS - 1, MLP, HIDDEN), "experts.wo", (EXPERTS, MLP, HIDDEN)),
        # wi_gate's hidden size disagrees with x's: wi_gate itself is named, as (E, H, F).
        ("wi_gate", (EXPERTS, HIDDEN + 8, MLP), "experts.wi_gate", (EXPERTS, HIDDEN, MLP)),
        # A 3-d x of another hidden size names the first kernel that disagrees.
        ("x", (BATCH, SEQUENCE, HIDDEN // 2), "router_kernel", (HIDDEN // 2, EXPERTS)),
    ],
)
def test_mismatched_shapes_are_named(inputs, argument, shape, named, want):
    x, router, experts = inputs
    args = {"x": x, "router": router, **experts._asdict()}
    args[argument] = jnp.zeros(shape)
    got = {"x": args["x"], "router_kernel": args["router"]}
    got.update({f"experts.{k}": v for k, v in args.items() if k not in ("x", "router")})
    wanted = ", ".join(repr(w) if isinstance(w, str) else str(w) for w in want)
    message = (
        f"moe_mlp: {named} has shape {tuple(got[named].shape)}; with x {tuple(args['x'].shape)} "
        f"and experts.wi_gate {tuple(args['wi_gate'].shape)} (experts, hidden, mlp) it must be "
        f"({wanted})."
    )
    with pytest.raises(fe.EscaleError, match=re.escape(message)):
        moe_mlp(
            args["x"],
            args["router"],
            GatedExperts(args["wi_gate"], args["wi_up"], args["wo"]),
            top_k=2,
        )


def test_dropless_refuses_experts_and_tokens_that_share_only_some_axes(inputs):
    # Experts over (ep, fsdp), tokens over (fsdp, dp) and sp: fsdp in both, ep in only one.
    rules = fe.PartitionAxis(expert_axis=("ep", "fsdp"))
    mesh = fe.create_mesh(MESH_DIMS["fsdp2_ep4"])
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            fe.EscaleError,
            match=r"dropless dispatch: the experts are split over \('ep', 'fsdp'\) and the "
            r"tokens over \('fsdp', 'dp', 'sp'\), which share some of those mesh axes but not "
            r"all; map 'batch' to all of the expert axes \(PartitionAxis\(ep_as_fsdp=True\)\)",
        ),
    ):
        moe_mlp(*inputs, top_k=2, strategy="dropless", rules=rules)


def test_dropless_needs_a_batch_that_the_expert_group_can_share():
    # Without ep_as_fsdp each of the 8 expert devices takes 1/8 of the batch: 4 does not divide.
    x, router, experts = _inputs(batch=4)
    mesh = fe.create_mesh(MESH_DIMS["ep8"])
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            fe.EscaleError,
            match=r"dropless dispatch: the batch of x \(4, 16, 32\) is split over "
            r"\('fsdp', 'dp'\), and each device of the expert axes \('ep',\) takes an equal "
            r"share of it, which needs a batch that divides by their product.*"
            r"PartitionAxis\(ep_as_fsdp=True\)",
        ),
    ):
        moe_mlp(x, router, experts, top_k=2, strategy="dropless", rules=fe.PartitionAxis())


def test_expert_axes_are_the_documented_names():
    assert EXPERT_AXES == {
        "wi_gate": ("expert", "hidden_state", "mlp_intermediate"),
        "wi_up": ("expert", "hidden_state", "mlp_intermediate"),
        "wo": ("expert", "mlp_intermediate", "hidden_state"),
    }
    assert STRATEGIES == ("capacity", "dropless")


# --- an empty batch -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, SEQUENCE, HIDDEN), (BATCH, 0, HIDDEN)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_empty_batch_has_a_zero_aux_loss_and_finite_gradients(inputs, strategy, shape):
    # The load-balancing loss of no tokens was 0 / 0, a NaN that poisoned the loss it joins.
    _, router, experts = inputs
    x = jnp.zeros(shape, jnp.float32)

    def loss(x, router, experts):
        out = moe_mlp(x, router, experts, top_k=TOP_K, strategy=strategy)
        return jnp.sum(out.output**2) + 0.1 * out.aux_loss, out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, router, experts
    )
    assert out.output.shape == shape
    assert float(out.aux_loss) == 0.0
    assert int(out.dropped) == 0
    assert float(value) == 0.0
    for grad in jax.tree.leaves(grads):
        assert (np.asarray(grad) == 0).all()  # finite: nothing to learn from no tokens


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_empty_batch_on_a_mesh_has_a_zero_aux_loss(inputs, strategy):
    _, router, experts = inputs
    x = jnp.zeros((0, SEQUENCE, HIDDEN), jnp.float32)
    with jax.set_mesh(fe.create_mesh(MESH_DIMS["fsdp2_ep4"])):
        out = _jitted(top_k=TOP_K, strategy=strategy, rules=RULES["ep_as_fsdp"])(x, router, experts)
    assert out.output.shape == x.shape
    assert float(out.aux_loss) == 0.0


# --- experts that the rules cannot split --------------------------------------------------------

SIX_EXPERTS = (
    r"parameter 'experts\.wi_gate': logical axes \('expert', 'hidden_state', "
    r"'mlp_intermediate'\) with shape \(6, 32, 64\) on mesh \{'dp': 2, 'fsdp': 1, 'ep': 4, "
    r"'tp': 1, 'sp': 1\} .*dimension 0 \(expert\): size 6 is not divisible by the mesh axes of "
    r"any of its rules \(\('ep',\) of size 4\); dropped \('ep',\)\. Make the size a multiple"
)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_experts_that_do_not_divide_ep_warn_once_for_both_strategies(strategy):
    # Six experts on ep=4: every device computes all six. The dropless strategy said nothing,
    # the capacity one warned three times about its dispatched arrays.
    x, router, experts = _inputs(experts=6)
    options = {"top_k": TOP_K, **_roomy(strategy, 3.0)}
    with jax.set_mesh(fe.create_mesh(MESH_DIMS["dp2_ep4"])):
        with pytest.warns(fe.ShardingCorrectionWarning, match=rf"(?s){SIX_EXPERTS}") as caught:
            got = _jitted(**options)(x, router, experts)
        with pytest.raises(fe.ShardingResolutionError, match=rf"(?s){SIX_EXPERTS}"):
            _jitted(strict=True, **options)(x, router, experts)
    assert len(caught) == 1
    want, dropped = reference(x, router, experts, TOP_K)
    assert dropped == int(got.dropped) == 0
    np.testing.assert_allclose(np.asarray(got.output), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_experts_replicated_on_purpose_do_not_warn(strategy):
    x, router, experts = _inputs(experts=6)
    on_purpose = (("expert", None), *fe.resolve.as_logical_rules(fe.PartitionAxis()))
    with jax.set_mesh(fe.create_mesh(MESH_DIMS["dp2_ep4"])):
        got = _jitted(top_k=TOP_K, strict=True, rules=on_purpose, **_roomy(strategy, 3.0))(
            x, router, experts
        )
    np.testing.assert_allclose(
        np.asarray(got.output), reference(x, router, experts, TOP_K)[0], atol=1e-5, rtol=1e-5
    )


# --- options of the other strategy --------------------------------------------------------------


@pytest.mark.parametrize("exchange", ["all_to_all", "ragged_all_to_all"])
def test_an_exchange_with_the_capacity_strategy_is_refused(inputs, exchange):
    with pytest.raises(
        fe.EscaleError,
        match=rf"moe_mlp: exchange='{exchange}' is an option of strategy='dropless', and the "
        r"capacity strategy has no exchange to choose .*; drop exchange=, or pass "
        r"strategy='dropless'\.",
    ):
        moe_mlp(*inputs, top_k=2, exchange=exchange)


@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_a_capacity_factor_with_the_dropless_strategy_is_refused(inputs, factor):
    with pytest.raises(
        fe.EscaleError,
        match=rf"moe_mlp: capacity_factor={factor} is an option of strategy='capacity', and "
        r"the dropless strategy has no capacity \(it drops no token\); drop capacity_factor=, "
        r"or pass strategy='capacity'\.",
    ):
        moe_mlp(*inputs, top_k=2, strategy="dropless", capacity_factor=factor)


def test_none_is_each_strategys_default(inputs):
    # A configuration can pass both options as None, whatever its strategy.
    defaults = {"capacity": {"capacity_factor": 1.25}, "dropless": {"exchange": "all_to_all"}}
    for strategy, given in defaults.items():
        want = _jitted(top_k=2, strategy=strategy, **given)(*inputs)
        got = _jitted(top_k=2, strategy=strategy, capacity_factor=None, exchange=None)(*inputs)
        np.testing.assert_array_equal(np.asarray(got.output), np.asarray(want.output))
        assert int(got.dropped) == int(want.dropped)


# --- the activation -----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_activation_by_name_is_refused_with_the_function_to_pass(inputs, strategy):
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"moe_mlp: activation must be a function, got the string 'silu'; pass the "
        r"function itself, e.g\. jax\.nn\.silu, not its name\.",
    ):
        moe_mlp(*inputs, top_k=2, strategy=strategy, activation="silu")


@pytest.mark.parametrize(
    ("activation", "error", "match"),
    [
        ("gelu", fe.EscaleTypeError, r"got the string 'gelu'; pass the function itself, e\.g\. "),
        ("swiglu", fe.EscaleTypeError, r"got the string 'swiglu'; pass a function of one array"),
        (None, fe.EscaleTypeError, r"got None; pass a function of one array, e\.g\. jax\.nn\.silu"),
        (
            lambda a, b: a,
            fe.EscaleTypeError,
            r"moe_mlp: activation: <lambda>\(a, b\) cannot be called as activation\(x\)",
        ),
    ],
)
def test_an_activation_that_is_not_a_function_of_one_array_is_refused(
    inputs, activation, error, match
):
    with pytest.raises(error, match=match):
        moe_mlp(*inputs, top_k=2, activation=activation)


def test_another_activation_is_used_by_both_strategies(inputs):
    x, router, experts = inputs
    got = {
        s: _jitted(top_k=2, activation=jax.nn.gelu, **_roomy(s, 4.0))(x, router, experts)
        for s in STRATEGIES
    }
    silu = _jitted(top_k=2, strategy="dropless")(x, router, experts)
    np.testing.assert_allclose(got["capacity"].output, got["dropless"].output, atol=1e-5)
    assert not np.allclose(got["dropless"].output, silu.output, atol=1e-3)


def test_the_experts_methods_check_their_activation(inputs):
    _, _, experts = inputs
    with pytest.raises(fe.EscaleTypeError, match=r"GatedExperts\.grouped: activation must be"):
        experts.grouped(jnp.zeros((4, HIDDEN)), jnp.array([4] + [0] * 7), "silu")
    with pytest.raises(fe.EscaleTypeError, match=r"GatedExperts\.dense: activation must be"):
        experts.dense(jnp.zeros((EXPERTS, 1, 2, HIDDEN)), "silu")


# --- the ragged exchange on CPU -----------------------------------------------------------------

RAGGED_ON_CPU = (
    r"dropless dispatch: exchange='ragged_all_to_all' would cross the experts' mesh axes "
    r"\('ep',\) on CPU devices, and XLA:CPU cannot run a ragged-all-to-all; on CPU pass "
    r"exchange='all_to_all' \(the padded exchange, the same results\), or compile for a TPU or "
    r"GPU mesh"
)


@pytest.mark.parametrize("jitted", [False, True])
@pytest.mark.parametrize("given", ["context", "argument"])
def test_the_ragged_exchange_is_refused_where_cpu_devices_would_run_it(inputs, given, jitted):
    # XLA:CPU failed at run time with UNIMPLEMENTED: HLO opcode `ragged-all-to-all`.
    mesh = fe.create_mesh(MESH_DIMS["ep8"])
    options = {"top_k": 2, "strategy": "dropless", "exchange": "ragged_all_to_all"}
    if given == "argument":
        options["mesh"] = mesh
    run = _jitted(**options) if jitted else functools.partial(moe_mlp, **options)
    with jax.set_mesh(mesh), pytest.raises(fe.EscaleError, match=RAGGED_ON_CPU):
        run(*inputs)


def test_the_ragged_exchange_runs_where_nothing_is_exchanged(inputs):
    # One device (no mesh), or a mesh whose experts are not split: no ragged-all-to-all runs.
    options = {"top_k": 2, "strategy": "dropless"}
    want = _jitted(**options)(*inputs)
    got = _jitted(exchange="ragged_all_to_all", **options)(*inputs)
    np.testing.assert_array_equal(np.asarray(got.output), np.asarray(want.output))
    with jax.set_mesh(fe.create_mesh((1, 8, 1, 1, 1))):
        on_fsdp = _jitted(exchange="ragged_all_to_all", **options)(*inputs)
    np.testing.assert_allclose(np.asarray(on_fsdp.output), want.output, atol=1e-5, rtol=1e-5)


# --- arguments of the wrong kind ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argument", "value", "error", "match"),
    [
        ("x", None, fe.EscaleTypeError, r"moe_mlp: x must be an array, got None; pass a jax"),
        ("x", [[[1.0]]], fe.EscaleTypeError, r"moe_mlp: x must be an array, got list"),
        ("router_kernel", "router", fe.EscaleTypeError, r"moe_mlp: router_kernel must be an"),
        ("wo", None, fe.EscaleTypeError, r"moe_mlp: experts\.wo must be an array, got None"),
        ("mesh", "ep:8", fe.EscaleTypeError, r"moe_mlp: mesh must be a jax\.sharding\.Mesh"),
        ("strict", "yes", fe.EscaleTypeError, r"moe_mlp: strict must be True or False"),
        ("rules", "ep", fe.EscaleTypeError, r"rules must be a sequence of \(logical name, mesh"),
        ("top_k", None, fe.EscaleTypeError, r"top_k must be an int from 1 to the number of"),
        ("top_k", 0, fe.EscaleError, r"top_k must be an int from 1 to the number of experts"),
    ],
)
def test_arguments_of_the_wrong_kind_are_named(inputs, argument, value, error, match):
    x, router, experts = inputs
    args = {"x": x, "router_kernel": router, "experts": experts, "top_k": 2}
    if argument in GatedExperts._fields:
        args["experts"] = experts._replace(**{argument: value})
    else:
        args[argument] = value
    with pytest.raises(error, match=match):
        moe_mlp(**args)


def test_num_experts_of_experts_without_kernels_is_named():
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"GatedExperts\.wi_gate must be an \(expert, hidden_state, mlp_intermediate\) "
        r"array, got None",
    ):
        _ = GatedExperts(None, None, None).num_experts


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["--strategy", "capacity", "--exchange", "ragged_all_to_all"], "--exchange"),
        (["--strategy", "dropless", "--capacity-factor", "2.0"], "--capacity-factor"),
    ],
    ids=["capacity-exchange", "dropless-capacity-factor"],
)
def test_the_examples_command_line_refuses_the_other_strategys_option(capsys, argv, refused):
    command_line = load("moe_config").command_line
    with pytest.raises(SystemExit) as exited:
        command_line("an MoE example", argv)
    assert exited.value.code == 2
    assert f"{refused} is not an option of --strategy" in capsys.readouterr().err


def test_the_examples_command_line_passes_each_strategy_its_option():
    command_line = load("moe_config").command_line
    _, capacity = command_line("x", ["--strategy", "capacity", "--capacity-factor", "2.0"])
    _, dropless = command_line("x", ["--strategy", "dropless", "--exchange", "ragged_all_to_all"])
    assert capacity.dispatch() == {"strategy": "capacity", "capacity_factor": 2.0}
    assert dropless.dispatch() == {"strategy": "dropless", "exchange": "ragged_all_to_all"}
