import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import support
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.mistakes import MISTAKE, TX, T, _Up, case, mesh5, raises_a_library_error
from support.values import assert_same_value, assert_same_values

import flax_escale as fe
from flax_escale import nnx as fen

TOKENS = (jnp.arange(8 * 16).reshape(8, 16) * 7) % 64
HIDDEN = ("fsdp", "sp")
AXES = {
    "embed/embedding": ("vocab", "hidden_state"),
    "wi/kernel": ("hidden_state", "mlp_intermediate"),
    "wi/bias": ("mlp_intermediate",),
    "wo/kernel": ("mlp_intermediate", "hidden_state"),
    "norm/scale": ("hidden_state",),
    "head/kernel": ("hidden_state", "vocab"),
}
EXPECTED = {
    "embed/embedding": P("tp", HIDDEN),
    "wi/kernel": P(HIDDEN, "tp"),
    "wi/bias": P("tp"),
    "wo/kernel": P("tp", HIDDEN),
    "norm/scale": P("tp"),
    "head/kernel": P(HIDDEN, "tp"),
}
MESHES = {**support.MESHES, "fsdp2_tp2_sp2": (1, 2, 1, 2, 2)}


@fe.sharded_module(AXES)
class TinyLm(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.wi = nnx.Linear(32, 128, rngs=rngs)
        self.wo = nnx.Linear(128, 32, use_bias=False, rngs=rngs)
        self.norm = nnx.LayerNorm(32, use_bias=False, rngs=rngs)
        self.head = nnx.Linear(32, 64, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = fe.constrain(self.embed(tokens), ("batch", "sequence", "hidden_state"))
        h = fe.constrain(nnx.relu(self.wi(x)), ("batch", "sequence", "mlp_intermediate"))
        return self.head(self.norm(x + self.wo(h)))


def expected_on(mesh):
    """EXPECTED, except that without tensor parallelism the 1-D variables fall back to fsdp."""
    if mesh.shape["tp"] > 1:
        return EXPECTED
    return {**EXPECTED, "wi/bias": P(HIDDEN), "norm/scale": P(HIDDEN)}


def flat_values(module):
    return {
        "/".join(str(p) for p in path): node.get_value()
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Variable)
    }


@pytest.fixture(params=sorted(MESHES), ids=str)
def mesh_dims(request):
    return MESHES[request.param]


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_every_variable_has_its_expected_sharding(mesh_dims, axis_types):
    mesh = fe.create_mesh(mesh_dims, axis_types=axis_types)
    model = fe.init_sharded(TinyLm, mesh, 0)
    values = flat_values(model)
    assert set(values) == set(EXPECTED)
    for path, spec in expected_on(mesh).items():
        leaf = values[path]
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), path
        assert leaf.addressable_shards[0].data.shape == NamedSharding(mesh, spec).shard_shape(
            leaf.shape
        )
    specs = nnx.get_partition_spec(nnx.state(model))
    kernel_spec = specs["wi"]["kernel"].get_value()
    assert NamedSharding(mesh, kernel_spec).is_equivalent_to(
        NamedSharding(mesh, P(HIDDEN, "tp")), 2
    )
    assert model.wi.kernel.get_metadata("logical_axes") == AXES["wi/kernel"]


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_values_match_the_jitted_unsharded_constructor(mesh_dims, axis_types):
    mesh = fe.create_mesh(mesh_dims, axis_types=axis_types)
    model = fe.init_sharded(TinyLm, mesh, 0)
    construct = jax.jit(lambda key: nnx.state(TinyLm(nnx.Rngs(key))))
    reference = construct(jax.random.key(0))
    assert assert_same_values(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(reference))


def test_same_logical_axes_give_the_same_spec_as_linen():
    class LinenTwin(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 32, name="embed")(tokens)
            x = x + nn.Dense(32, use_bias=False, name="wo")(nn.Dense(128, name="wi")(x))
            return nn.Dense(64, use_bias=False, name="head")(
                nn.LayerNorm(use_bias=False, name="norm")(x)
            )

    linen_twin = fe.sharded_module(AXES)(LinenTwin)
    for dims in MESHES.values():
        mesh = fe.create_mesh(dims)
        nnx_plan = fe.plan_sharding(TinyLm, mesh, 0)
        linen_plan = fe.plan_sharding(linen_twin(), mesh, jax.random.key(0), TOKENS)
        for path in EXPECTED:
            assert nnx_plan[path].spec == linen_plan[f"params/{path}"].spec, (dims, path)


def test_nnx_own_rule_lookup_would_differ_and_is_not_used():
    # NNX's lookup is dict(rules): the last rule for a name wins (the fallback), no conflicts.
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    rules = fe.PartitionAxis().logical_axis_rules()
    assert dict(rules)["hidden_state"] == HIDDEN

    class Native(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(
                nnx.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
            )
            self.wi = nnx.Linear(32, 128, kernel_init=init, use_bias=False, rngs=rngs)
            meshed = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("tp", None))
            self.wo = nnx.Linear(128, 32, kernel_init=meshed, use_bias=False, rngs=rngs)

    model = fe.init_sharded(Native, mesh, 0)
    assert model.wi.kernel.get_value().sharding.spec == P(HIDDEN, "tp")
    assert model.wo.kernel.get_value().sharding.spec == P("tp", None)


def test_optimizer_state_follows_variables_and_zero1():
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    model = fe.init_sharded(TinyLm, mesh, 0)
    optimizer = fen.init_optimizer(model, optax.adam(1e-3))
    mu = optimizer.opt_state[0].mu
    for path, spec in EXPECTED.items():
        first, second = path.split("/")
        leaf = mu[first][second].get_value()
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), path
        np.testing.assert_array_equal(leaf, 0)
    assert optimizer.step.get_value().sharding.is_fully_replicated

    zero = fen.init_optimizer(model, optax.adam(1e-3), shard_over=("dp",))
    nu = zero.opt_state[0].nu["wi"]["kernel"].get_value()
    assert nu.sharding.spec == P((*HIDDEN, "dp"), "tp")
    assert nu.addressable_shards[0].data.shape == (32 // 4, 128 // 2)


def test_adafactor_factored_state_follows_the_kept_dimensions():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    model = fe.init_sharded(TinyLm, mesh, 0)
    optimizer = fen.init_optimizer(model, optax.adafactor(1e-3, min_dim_size_to_factor=4))
    state = optimizer.opt_state[0]
    # wi/kernel (32, 128) on (('fsdp', 'sp'), 'tp'): the row statistic (32,) keeps dimension 0,
    # the column statistic (128,) keeps dimension 1.
    v_row = state.v_row["wi"]["kernel"].get_value()
    v_col = state.v_col["wi"]["kernel"].get_value()
    assert (v_row.shape, v_col.shape) == ((32,), (128,))
    assert v_row.sharding.is_equivalent_to(NamedSharding(mesh, P(HIDDEN)), 1)
    assert v_col.sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), 1)
    assert state.v["wi"]["kernel"].get_value().sharding.is_fully_replicated
    reference = optax.adafactor(1e-3, min_dim_size_to_factor=4).init(
        jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    )
    np.testing.assert_array_equal(v_row, reference[0].v_row["wi"]["kernel"])


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


@pytest.mark.slow
@pytest.mark.xla
def test_training_step_matches_the_single_device_one():
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    tx = optax.adamw(1e-2)
    model = fe.init_sharded(TinyLm, mesh, 0)
    optimizer = fen.init_optimizer(model, tx)
    with fe.use_sharding(mesh):
        tokens = fe.constrain(TOKENS, ("batch", "sequence"))
        loss = train_step(model, optimizer, tokens)

    reference = TinyLm(nnx.Rngs(0))
    ref_optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)
    ref_loss = train_step(reference, ref_optimizer, TOKENS)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    got, want = flat_values(model), flat_values(reference)
    for path in EXPECTED:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-4, atol=1e-6)
        assert got[path].sharding.is_equivalent_to(
            NamedSharding(mesh, EXPECTED[path]), got[path].ndim
        )


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_constraints_in_call_resolve_in_and_out_of_jit(axis_types):
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)

    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Up(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(32, 64, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return fe.constrain(self.wi(x), ("batch", "mlp_intermediate"))

    model = fe.init_sharded(Up, mesh, 0)
    x = jnp.ones((8, 32))
    graphdef, state = nnx.split(model)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    with fe.use_sharding(mesh):
        eager = model(x)
        jitted = jax.jit(apply)(state, x)
        text = jax.jit(apply).lower(state, x).as_text()
    for y in (eager, jitted):
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tp")), 2)
    # Explicit axes add one of their own, the matmul's type [{}, {"tp"}]: look for this one,
    # without the size-1 Explicit axis dp.
    ours = '[{"fsdp"}, {"tp"}]' if axis_types == "explicit" else '[{"fsdp", "dp"}, {"tp"}]'
    assert (ours, "8x64xf32") in sharding_constraints(text)
    np.testing.assert_allclose(jitted, x @ model.wi.kernel.get_value(), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.xla
def test_compiled_init_needs_a_device_share_of_the_memory():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    plan = fe.plan_sharding(TinyLm, mesh, 0)
    sharded = fe.lower_init(TinyLm, mesh, 0).compile().memory_analysis()
    whole = jax.jit(lambda key: nnx.state(TinyLm(nnx.Rngs(key))))
    total = whole.lower(jax.random.key(0)).compile().memory_analysis().output_size_in_bytes
    slack = 8 * (len(plan) + 2)  # XLA's table of output pointers
    assert plan.nbytes <= total <= plan.nbytes + slack
    assert plan.nbytes_per_device <= sharded.output_size_in_bytes
    assert sharded.output_size_in_bytes <= plan.nbytes_per_device + slack
    assert sharded.output_size_in_bytes <= total / 8 * 1.25


@pytest.mark.slow
@pytest.mark.xla
def test_callable_models_seeds_and_rng_dicts():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    by_class = fe.init_sharded(TinyLm, mesh, 3)
    by_callable = fe.init_sharded(lambda rngs: TinyLm(rngs), mesh, jax.random.key(3))
    by_dict = fe.init_sharded(TinyLm, mesh, {"params": 4, "default": 3})
    # Each against the unsharded constructor given the same seeds, not against each other.
    want = flat_values(nnx.jit(lambda: TinyLm(nnx.Rngs(3)))())
    want_dict = flat_values(nnx.jit(lambda: TinyLm(nnx.Rngs(params=4, default=3)))())
    a, b, c = flat_values(by_class), flat_values(by_callable), flat_values(by_dict)
    assert set(a) == set(b) == set(c) == set(EXPECTED)
    for path in EXPECTED:
        assert_same_value(a[path], want[path], path)
        assert_same_value(b[path], want[path], path)
        assert_same_value(c[path], want_dict[path], path)
    # The params stream, not the default one, seeds the kernels.
    assert not np.array_equal(c["wi/kernel"], a["wi/kernel"])
    top = fe.init_sharded(TinyLm, mesh, 3)
    np.testing.assert_array_equal(flat_values(top)["wi/kernel"], a["wi/kernel"])


def test_errors():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"model is an NNX module already built \(a TinyLm\).*pass its class, or a function",
    ):
        fe.init_sharded(TinyLm(nnx.Rngs(0)), mesh, 0)
    with pytest.raises(fe.EscaleTypeError, match="not an NNX module"):
        fe.init_sharded(lambda rngs: 3, mesh, 0)
    with pytest.raises(fe.EscaleTypeError, match="NamedSharding"):
        fen.init_optimizer(TinyLm(nnx.Rngs(0)), optax.sgd(0.1))
    with pytest.raises(fe.EscaleTypeError, match=r"flax\.nnx\.Module"):
        fen.init_optimizer("model", optax.sgd(0.1))
    with pytest.raises(
        fe.EscaleTypeError, match=r"model must be a flax\.linen\.Module instance.*got int 3"
    ):
        fe.init_sharded(3, mesh, 0)
    with pytest.raises(fe.EscaleTypeError, match=r"got the class Dense; pass Dense\(\.\.\.\)"):
        fe.plan_sharding(nn.Dense, mesh, 0)


def test_nnx_init_of_a_kernel_no_rule_divides(devices):
    fsdp8 = fe.create_mesh(MESHES["fsdp8"])

    # (6, 12) on fsdp=8: hidden_state's fallback (fsdp, sp) divides neither 6 nor 12, and tp=1.
    @fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate")})
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Linear(6, 12, use_bias=False, rngs=rngs)

    with pytest.raises(fe.ShardingResolutionError, match=r"parameter 'w/kernel'.*\(6, 12\)"):
        fe.init_sharded(Odd, fsdp8, 0, strict=True)
    with pytest.warns(
        fe.ShardingCorrectionWarning, match=r"(?s)'w/kernel'.*size 6 is not divisible"
    ):
        module = fe.init_sharded(Odd, fsdp8, 0)
    assert module.w.kernel.get_value().sharding.spec == P(None, None)


class _Scaled(nnx.Module):
    """Initializers with arithmetic after the random draw, where rounding can differ."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("fsdp", "tp"))
        self.up = nnx.Linear(64, 128, kernel_init=init, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(128, 64, use_bias=False, rngs=rngs)


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_values_are_bit_equal_on_auto_and_explicit_meshes(axis_types):
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    model = fe.init_sharded(_Scaled, mesh, jax.random.key(3))
    with nnx.use_eager_sharding(False):
        reference = jax.jit(lambda key: nnx.state(_Scaled(nnx.Rngs(key))))(jax.random.key(3))
    got = nnx.state(model)
    for path in (("up", "kernel"), ("down", "kernel")):
        a, b = got[path[0]][path[1]].get_value(), reference[path[0]][path[1]].get_value()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.mesh == mesh


# Mistakes users make with init_optimizer (its wrt filter too) and with the NNX constructors
# that init_sharded and plan_sharding call. What a case asserts, and the rest of the table:
# support/mistakes.py.


# Named with an underscore, as the messages of the cases that pass the classes show them.
class _Sized(nnx.Module):
    def __init__(self, din, rngs):
        self.wi = nnx.Linear(din, 8, use_bias=False, rngs=rngs)


class _NoRngs(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((4, 4)))


def _built():
    """A model whose only variable is a Param, built sharded."""
    return fe.init_sharded(_Up, mesh5(), 0)


CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fen.init_optimizer(
            fe.init_sharded(_Up, fe.create_mesh((1, 4, 1, 2, 1)), 0), TX, shard_over="dp"
        ),
        T,
        "shard_over",
        "'dp'",
        r"pass \('dp',\)",
        id="nnx-init_optimizer-shard_over",
    ),
    # --- the vocabulary and the front ends ---------------------------------------------------
    case(
        lambda: fen.init_optimizer("model", TX),
        T,
        "model",
        "'model'",
        r"flax\.nnx\.Module",
        id="nnx-init_optimizer-model-string",
    ),
    case(
        lambda: fen.init_optimizer(_Up(nnx.Rngs(0)), None),
        T,
        "tx",
        "None",
        r"optax\.adam\(1e-3\)",
        id="nnx-init_optimizer-tx-none",
    ),
    # --- a filter of what to optimize that is none, or selects nothing ----------------------
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=3),
        T,
        "wrt",
        "int 3",
        r"pass nnx\.Param \(the default\)",
        id="nnx-init_optimizer-wrt-int",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=[nnx.Param, 3.5]),
        T,
        "wrt",
        "3.5",
        r"pass nnx\.Param \(the default\)",
        id="nnx-init_optimizer-wrt-list-with-float",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=lambda: True),
        T,
        "wrt",
        "<lambda>()",
        r"\(path, value\).*exactly those 2 parameters",
        id="nnx-init_optimizer-wrt-arity",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=lambda path, value: None),
        fe.EscaleError,
        "wrt",
        "function",
        r"selects none of the model's variables \(it holds Param\).*pass nnx\.Param",
        id="nnx-init_optimizer-wrt-selects-nothing",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt="params"),
        fe.EscaleError,
        "wrt",
        "'params'",
        r"selects variables by tag, not by collection name.*pass nnx\.Param",
        id="nnx-init_optimizer-wrt-collection-name",
    ),
    case(
        lambda: fen.init_optimizer(_built(), TX, wrt=nnx.BatchStat),
        fe.EscaleError,
        "wrt",
        "BatchStat",
        r"selects none of the model's variables.*pass nnx\.Param",
        id="nnx-init_optimizer-wrt-absent-type",
    ),
    # --- a constructor that cannot be called as model(*args, rngs=..., **kwargs) ------------
    case(
        lambda: fe.init_sharded(_Sized, mesh5(), 0),
        T,
        "model",
        "_Sized(din, rngs)",
        r"missing a required argument: 'din'.*after rng.*lambda rngs: _Sized\(\.\.\., rngs=rngs\)",
        id="nnx-init_sharded-class-missing-argument",
    ),
    case(
        lambda: fe.plan_sharding(_Sized, mesh5(), 0),
        T,
        "model",
        "_Sized(din, rngs)",
        r"missing a required argument: 'din'.*after rng",
        id="nnx-plan_sharding-class-missing-argument",
    ),
    case(
        lambda: fe.init_sharded(_Sized, mesh5(), 0, 4, 5),
        T,
        "model",
        "_Sized(din, rngs)",
        r"2 positional argument.*after rng",
        id="nnx-init_sharded-class-extra-argument",
    ),
    case(
        lambda: fe.init_sharded(lambda: _Up(nnx.Rngs(0)), mesh5(), 0),
        T,
        "model",
        "<lambda>()",
        r"unexpected keyword argument 'rngs'.*must take the keyword argument rngs",
        id="nnx-init_sharded-factory-without-rngs",
    ),
    case(
        lambda: fe.init_sharded(lambda r: _Up(r), mesh5(), 0),
        T,
        "model",
        "<lambda>(r)",
        r"must take the keyword argument rngs.*lambda rngs: Model\(\.\.\., rngs=rngs\)",
        id="nnx-init_sharded-factory-rngs-misnamed",
    ),
    case(
        lambda: fe.init_sharded(_NoRngs, mesh5(), 0),
        T,
        "model",
        "_NoRngs()",
        r"must take the keyword argument rngs",
        id="nnx-init_sharded-class-without-rngs",
    ),
    case(
        lambda: fe.init_sharded(functools.partial(_Sized), mesh5(), 0),
        T,
        "model",
        "functools.partial(<class",
        r"missing a required argument: 'din'",
        id="nnx-init_sharded-partial-missing-argument",
    ),
    case(
        lambda: fe.init_sharded(_Up, mesh5(), 0, rngs=nnx.Rngs(1)),
        T,
        "rngs",
        "Rngs",
        r"pass its seed or key as rng",
        id="nnx-init_sharded-rngs-keyword",
    ),
    # --- a factory that builds no module; a class where a built module is expected -------
    case(
        lambda: fe.init_sharded(lambda rngs: {"up": _Up(rngs)}, mesh5(), 0),
        T,
        "model",
        "returned a dict",
        r"goes inside a module's attribute",
        id="nnx-init_sharded-factory-returns-dict",
    ),
    case(
        lambda: fen.init_optimizer(_Up, TX),
        T,
        "model",
        "_Up",
        r"build it first, e\.g\. init_sharded\(_Up, mesh, 0\)",
        id="nnx-init_optimizer-model-class",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
