import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import support
from flax.linen import partitioning as nn_partitioning
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.mistakes import (
    MISTAKE,
    TX,
    T,
    X,
    _Up,
    case,
    dense,
    mesh5,
    mesh_dp_tp,
    raises_a_library_error,
)
from support.values import assert_same_values

import flax_escale as fe
from flax_escale import linen as fel

KEY = jax.random.key(42)
TOKENS = (jnp.arange(8 * 16).reshape(8, 16) * 7) % 64


@fe.sharded_module(
    {
        "embed/embedding": ("vocab", "hidden_state"),
        "wi/kernel": ("hidden_state", "mlp_intermediate"),
        "wi/bias": ("mlp_intermediate",),
        "wo/kernel": ("mlp_intermediate", "hidden_state"),
        "ln/scale": ("hidden_state",),
        "head/kernel": ("hidden_state", "vocab"),
    }
)
class TinyLm(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32, name="embed")(tokens)
        x = fe.constrain(x, ("batch", "sequence", "hidden_state"))
        h = nn.relu(nn.Dense(128, name="wi")(x))
        h = fe.constrain(h, ("batch", "sequence", "mlp_intermediate"))
        x = x + nn.Dense(32, use_bias=False, name="wo")(h)
        x = nn.LayerNorm(use_bias=False, name="ln")(x)
        return nn.Dense(64, use_bias=False, name="head")(x)


HIDDEN = ("fsdp", "sp")
EXPECTED = {
    "embed/embedding": P("tp", HIDDEN),
    "wi/kernel": P(HIDDEN, "tp"),
    "wi/bias": P("tp"),
    "wo/kernel": P("tp", HIDDEN),
    "ln/scale": P("tp"),
    "head/kernel": P(HIDDEN, "tp"),
}
MESHES = {**support.MESHES, "fsdp2_tp2_sp2": (1, 2, 1, 2, 2)}


def expected_on(mesh):
    """EXPECTED, except that without tensor parallelism the 1-D parameters fall back to fsdp."""
    if mesh.shape["tp"] > 1:
        return EXPECTED
    return {**EXPECTED, "wi/bias": P(HIDDEN), "ln/scale": P(HIDDEN)}


def flat(params):
    return {
        "/".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }


@pytest.fixture(params=sorted(MESHES), ids=str)
def mesh_dims(request):
    return MESHES[request.param]


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_every_parameter_has_its_expected_sharding(mesh_dims, axis_types):
    mesh = fe.create_mesh(mesh_dims, axis_types=axis_types)
    variables = fe.init_sharded(TinyLm(), mesh, KEY, TOKENS)
    params = flat(variables["params"])
    assert set(params) == set(EXPECTED)
    for path, spec in expected_on(mesh).items():
        leaf = params[path]
        assert isinstance(leaf, jax.Array)
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
            path,
            leaf.sharding,
        )
        shard = leaf.addressable_shards[0].data.shape
        expected = NamedSharding(mesh, spec).shard_shape(leaf.shape)
        assert shard == expected, path


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_values_match_the_unsharded_jit_init(mesh_dims, axis_types):
    mesh = fe.create_mesh(mesh_dims, axis_types=axis_types)
    sharded = fe.init_sharded(TinyLm(), mesh, KEY, TOKENS)
    init = jax.jit(lambda key, tokens: nn.unbox(TinyLm().init(key, tokens)))
    assert_same_values(sharded, init(KEY, TOKENS))


def loss_fn(params, tokens):
    logits = TinyLm().apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train_step(state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, tokens)
    return state.apply_gradients(grads=grads), loss


def test_training_step_matches_the_single_device_one():
    # Auto axes only: on Explicit axes nn.Embed's gather needs an out_sharding Flax does not give.
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    tx = optax.adamw(1e-2)
    state = fel.init_train_state(TinyLm(), mesh, KEY, TOKENS, tx=tx)
    with fe.use_sharding(mesh):
        tokens = fe.constrain(TOKENS, ("batch", "sequence"))
        step = jax.jit(train_step)
        lowered = step.lower(state, tokens).as_text()
        new_state, loss = step(state, tokens)

    params = nn.unbox(jax.jit(TinyLm().init)(KEY, TOKENS))["params"]
    reference = TrainState.create(apply_fn=TinyLm().apply, params=params, tx=tx)
    ref_state, ref_loss = jax.jit(train_step)(reference, TOKENS)

    # The model's two constraints, in the forward pass and transposed in the backward pass.
    activations = '[{"fsdp", "dp"}, {"sp"}, {"tp"}]'
    assert sharding_constraints(lowered) == [
        (activations, "8x15x32xf32"),
        (activations, "8x15x128xf32"),
        (activations, "8x15x128xf32"),
        (activations, "8x15x32xf32"),
    ]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(new_state.params), jax.tree.leaves(ref_state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    for path, leaf in flat(new_state.params).items():
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, EXPECTED[path]), leaf.ndim)


def test_optimizer_state_follows_parameters_and_zero1_adds_data_axis():
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    state = fel.init_train_state(TinyLm(), mesh, KEY, TOKENS, tx=optax.adam(1e-3))
    mu = flat(state.opt_state[0].mu)
    for path, spec in EXPECTED.items():
        assert mu[path].sharding.is_equivalent_to(NamedSharding(mesh, spec), mu[path].ndim)
    assert state.opt_state[0].count.sharding.is_fully_replicated
    assert state.step == 0

    zero = fel.init_train_state(
        TinyLm(), mesh, KEY, TOKENS, tx=optax.adam(1e-3), shard_over=("dp",)
    )
    nu = flat(zero.opt_state[0].nu)
    assert nu["wi/kernel"].sharding.spec == P((*HIDDEN, "dp"), "tp")
    assert nu["wi/kernel"].addressable_shards[0].data.shape == (32 // 4, 128 // 2)
    np.testing.assert_array_equal(nu["wi/kernel"], 0)


def test_constraints_inside_call_are_in_the_compiled_program():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    variables = fe.init_sharded(TinyLm(), mesh, KEY, TOKENS)
    apply = jax.jit(TinyLm().apply)
    outside = apply.lower(variables, TOKENS).as_text()
    with fe.use_sharding(mesh):
        inside = apply.lower(variables, TOKENS).as_text()
        logits = apply(variables, TOKENS)
    assert inside.count("sharding_constraint") >= 2
    assert outside.count("sharding_constraint") == 0
    assert logits.shape == (8, 16, 64)


def test_compiled_init_needs_a_device_share_of_the_memory():
    model = TinyLm()
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    sharded = fe.lower_init(model, mesh, KEY, TOKENS).compile().memory_analysis()
    whole = jax.jit(lambda k, t: nn.unbox(model.init(k, t))).lower(KEY, TOKENS).compile()
    total = whole.memory_analysis().output_size_in_bytes
    plan = fe.plan_sharding(model, mesh, KEY, TOKENS)
    # XLA adds a small table of output pointers to the arrays themselves.
    slack = 8 * len(plan)
    assert plan.nbytes <= total <= plan.nbytes + slack
    assert plan.nbytes_per_device <= sharded.output_size_in_bytes
    assert sharded.output_size_in_bytes <= plan.nbytes_per_device + slack
    assert sharded.output_size_in_bytes <= total / 8 * 1.25


def test_rules_from_partition_axis_or_explicit_list():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    swapped = fe.PartitionAxis(tensor_parallel_axis="fsdp", fully_sharded_data_parallel_axis="tp")
    plan = fe.plan_sharding(TinyLm(), mesh, KEY, TOKENS, rules=swapped)
    assert plan["params/wi/kernel"].spec == P(("tp", "sp"), "fsdp")
    listed = [("hidden_state", "tp"), ("vocab", "fsdp")]
    with pytest.warns(fe.ShardingCorrectionWarning, match="no rule"):
        variables = fe.init_sharded(TinyLm(), mesh, KEY, TOKENS, rules=listed)
    assert variables["params"]["head"]["kernel"].sharding.spec == P("tp", "fsdp")
    assert variables["params"]["wi"]["kernel"].sharding.spec == P("tp", None)


def test_corrections_are_recorded_and_strict_raises():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))

    @fe.sharded_module({"kernel": ("mlp_intermediate", "vocab")})
    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(6, use_bias=False)(x)
            init = nn.with_partitioning(nn.initializers.zeros, ("fsdp", "tp"))
            return y @ self.param("w", init, (6, 3))

    x = jnp.ones((2, 3))
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"'params/w'.*\(6, 3\)"):
        plan = fe.plan_sharding(Odd(), mesh, KEY, x)
    # vocab takes tp first; mlp_intermediate's fallback fsdp*sp=4 does not divide 3: passed
    # over, and as no other rule is left the dimension stays whole: a correction.
    assert plan["params/Dense_0/kernel"].spec == P(None, "tp")
    [passed] = plan["params/Dense_0/kernel"].resolution.passed_over
    assert (passed.dim, passed.mesh_axes, passed.size) == (0, ("fsdp", "sp"), 3)
    assert "passed over" in plan.describe()
    assert plan["params/w"].spec == P(None, None)
    assert [(p, c.kind) for p, c in plan.corrections] == [
        ("params/Dense_0/kernel", "not_divisible"),
        ("params/w", "not_divisible"),
        ("params/w", "not_divisible"),
    ]
    with pytest.raises(fe.ShardingResolutionError, match=r"'params/Dense_0/kernel'.*\(3, 6\)"):
        fe.init_sharded(Odd(), mesh, KEY, x, strict=True)


def test_linen_init_of_a_kernel_no_rule_divides(devices):
    fsdp8 = fe.create_mesh(MESHES["fsdp8"])
    # (6, 12) on fsdp=8: hidden_state's fallback (fsdp, sp) divides neither 6 nor 12, and tp=1.
    model = nn.Dense(
        12,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        ),
    )
    x = jnp.ones((2, 6))
    with pytest.raises(
        fe.ShardingResolutionError,
        match=r"parameter 'params/kernel': logical axes \('hidden_state', 'mlp_intermediate'\) "
        r"with shape \(6, 12\) on mesh \{'dp': 1, 'fsdp': 8, 'ep': 1, 'tp': 1, 'sp': 1\}",
    ):
        fe.init_sharded(model, fsdp8, jax.random.key(0), x, strict=True)
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"size 6 is not divisible"):
        variables = fe.init_sharded(model, fsdp8, jax.random.key(0), x)
    assert variables["params"]["kernel"].sharding.spec == P(None, None)


def test_errors_for_wrong_models():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(fe.EscaleTypeError, match=r"flax\.linen\.Module instance"):
        fe.init_sharded(TinyLm, mesh, KEY, TOKENS)
    with pytest.raises(fe.EscaleTypeError, match=r"flax\.linen\.Module instance"):
        fe.init_sharded(object(), mesh, KEY, TOKENS)

    class WithStats(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(x)

    with pytest.raises(fe.EscaleError, match=r"\['batch_stats'\] besides 'params'"):
        fel.init_train_state(WithStats(), mesh, KEY, jnp.ones((8, 4)), tx=optax.sgd(0.1))


def test_top_level_init_sharded_dispatches_to_linen():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    variables = fe.init_sharded(TinyLm(), mesh, KEY, TOKENS)
    kernel = variables["params"]["wi"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(HIDDEN, "tp")), 2)
    bias = variables["params"]["wi"]["bias"]  # tp=1 splits nothing: the fsdp fallback applies
    assert bias.sharding.is_equivalent_to(NamedSharding(mesh, P(HIDDEN)), 1)


def test_plan_describes_every_parameter():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    text = fe.plan_sharding(TinyLm(), mesh, KEY, TOKENS).describe()
    for path in EXPECTED:
        assert f"params/{path}" in text
    assert "6 arrays on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)" in text
    assert "0 corrections, 0 unannotated" in text


class FlaxAnnotated(nn.Module):
    """Annotated with Flax's own tools only: no sharded_module."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        logical = nn.with_logical_partitioning(init, ("hidden_state", "mlp_intermediate"))
        x = nn.Dense(32, kernel_init=logical, use_bias=False, name="logical")(x)
        x = nn.with_logical_constraint(x, ("batch", "mlp_intermediate"))
        meshed = nn.with_partitioning(init, ("tp", "fsdp"))
        x = nn.Dense(16, kernel_init=meshed, use_bias=False, name="meshed")(x)
        w = nn_partitioning.param_with_axes("w", init, (16, 8), axes=("mlp_intermediate", None))
        return x @ w


@pytest.mark.parametrize("mesh_dims", [(1, 4, 1, 2, 1), (2, 2, 1, 2, 1)])
def test_flax_annotated_models_work_unchanged(mesh_dims):
    mesh = fe.create_mesh(mesh_dims)
    x = jnp.ones((8, 16))
    variables = fe.init_sharded(FlaxAnnotated(), mesh, KEY, x)
    params = variables["params"]
    assert params["logical"]["kernel"].sharding.spec == P(HIDDEN, "tp")
    assert params["meshed"]["kernel"].sharding.spec == P("tp", "fsdp")
    assert params["w"].sharding.spec == P("tp", None)
    reference = nn.unbox(jax.jit(FlaxAnnotated().init)(KEY, x))
    assert_same_values(variables, reference)
    with fe.use_sharding(mesh):
        y = jax.jit(FlaxAnnotated().apply)(variables, x)
    np.testing.assert_allclose(y, FlaxAnnotated().apply(reference, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_values_are_bit_equal_on_auto_and_explicit_meshes(axis_types):
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    init = nn.with_logical_partitioning(
        nn.initializers.normal(0.02), ("hidden_state", "mlp_intermediate")
    )
    model = nn.Dense(128, use_bias=False, kernel_init=init)
    x = jnp.ones((2, 64))
    got = fe.init_sharded(model, mesh, jax.random.key(3), x)["params"]["kernel"]
    expected = nn.unbox(jax.jit(model.init)(jax.random.key(3), x))["params"]["kernel"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert got.sharding.mesh == mesh


@pytest.mark.parametrize("seed", [0, np.int64(0), {"params": 0}], ids=["int", "numpy", "dict"])
def test_an_int_seed_is_the_key_it_names_as_for_nnx(seed):
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    x = jnp.ones((2, 8))
    from_seed = fe.init_sharded(nn.Dense(4), mesh, seed, x)
    from_key = fe.init_sharded(nn.Dense(4), mesh, jax.random.key(0), x)
    for got, want in zip(jax.tree.leaves(from_seed), jax.tree.leaves(from_key), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# Mistakes users make with init_train_state and the Linen front end's checks of a model call.
# What a case asserts, and the rest of the table: support/mistakes.py.
CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fel.init_train_state(
            dense(), mesh_dp_tp(), jax.random.key(0), X, tx=TX, shard_over="dp"
        ),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="linen-init_train_state-shard_over",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fel.init_train_state(dense(), mesh5(), jax.random.key(0), X, tx=None),
        T,
        "tx",
        "None",
        r"optax\.adam\(1e-3\)",
        id="linen-init_train_state-tx-none",
    ),
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fel.init_train_state(_Up, mesh5(), jax.random.key(0), X, tx=optax.sgd(0.1)),
        T,
        "model",
        "_Up",
        r"flax_escale\.nnx\.init_optimizer",
        id="linen-init_train_state-nnx-class",
    ),
    # --- inputs the model cannot be initialized with ----------------------------------------
    case(
        lambda: fel.init_train_state(dense(), mesh5(), jax.random.key(0), tx=TX),
        T,
        "model",
        "Dense.__call__(inputs)",
        r"missing a required argument: 'inputs'.*pass the example inputs after rng",
        id="linen-init_train_state-no-inputs",
    ),
    case(
        lambda: fe.lower_init(dense(), mesh5(), jax.random.key(0), "x"),
        T,
        "inputs[0]",
        "str 'x'",
        r"pass arrays \(or jax\.ShapeDtypeStruct\) as inputs",
        id="linen-lower_init-string-input",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
