"""``logical_to_mesh_sharding`` of annotated variables is ``plan_sharding``'s plan, on every tree.

For each kind of tree Flax users hold (``jax.eval_shape`` of a Linen ``init``, an NNX state or
module, a train state with optimizer state, t5x's ``params_axes``, boxes with their own rules,
a tree that needs corrections), ``fe.logical_to_mesh_sharding(tree, mesh)`` gives, leaf for
leaf, the specs of the plan the entry points make (``fe.plan_sharding`` of the model, or the
plan of the same tree): the same defaults, large arrays completed with idle mesh axes,
optimizer state following its parameter, corrections warned about and strict errors naming
the path. Specs, which carry no shapes, are never completed. It agrees with Flax's own
``nn.logical_to_mesh_sharding`` where Flax's applies, and its fast way (each distinct annotation
read once and resolved once) gives what ``build_plan`` gives on any tree.
"""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict
from flax.linen import partitioning
from flax.training.train_state import TrainState
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from support.mistakes import MISTAKE, T, case, mesh5, raises_a_library_error

import flax_escale as fe
from flax_escale.plan import annotated_leaves, build_plan

INIT = nn.initializers.lecun_normal()
WIDE = ("hidden_state", None)  # rules: tp; completion adds the idle fsdp on a large array
UP = ("hidden_state", "mlp_intermediate")
X = jnp.ones((2, 1024))
OWN_RULES = (("hidden_state", "fsdp"), ("mlp_intermediate", "tp"))


@pytest.fixture(scope="module")
def mesh(devices):
    return fe.create_mesh((1, 4, 1, 2, 1), devices=devices)


def _specs(tree):
    """The specs of a tree of shardings or specs, in flattening order."""
    return [getattr(x, "spec", x) for x in jax.tree.leaves(tree, is_leaf=lambda x: x is None)]


def _plan_specs(plan):
    return [entry.spec for entry in plan]


class LinenWide(nn.Module):
    """A large kernel the rules leave half idle, a small one, and an unannotated bias."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(1024, kernel_init=nn.with_logical_partitioning(INIT, WIDE), name="wide")(x)
        return nn.Dense(64, kernel_init=nn.with_logical_partitioning(INIT, UP), name="up")(x)


class LinenParamWithAxes(nn.Module):
    """t5x's style: names in the ``params_axes`` collection."""

    @nn.compact
    def __call__(self, x):
        wide = partitioning.param_with_axes("wide", INIT, (1024, 1024), axes=WIDE)
        up = partitioning.param_with_axes("up", INIT, (1024, 64), axes=UP)
        return x @ wide @ up


class LinenOwnRules(nn.Module):
    """Boxes that carry their own rules, which win over the plan's."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(INIT, UP, rules=OWN_RULES)
        return nn.Dense(64, kernel_init=init, use_bias=False, name="up")(x)


class LinenUneven(nn.Module):
    """A kernel of 6 columns: ``mlp_intermediate`` on tp=2 divides, ``vocab`` on 4 does not."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(INIT, ("hidden_state", "batch"))
        return nn.Dense(6, kernel_init=init, use_bias=False, name="odd")(x)


class NnxWide(nnx.Module):
    """Flax's ``out_sharding`` metadata on one kernel, the library's ``logical_axes`` on one."""

    def __init__(self, rngs):
        wide = nnx.with_metadata(INIT, out_sharding=WIDE)
        up = nnx.with_metadata(INIT, logical_axes=UP)
        self.wide = nnx.Linear(1024, 1024, kernel_init=wide, rngs=rngs)
        self.up = nnx.Linear(1024, 64, use_bias=False, kernel_init=up, rngs=rngs)


def _linen_abstract(model):
    return jax.eval_shape(model.init, jax.random.key(0), X)


def _nnx_abstract():
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: NnxWide(nnx.Rngs(0)))


def test_the_issue_example_agrees_with_plan_sharding(mesh):
    # A (1024, 1024) parameter annotated ("hidden_state", None) on fsdp=4 x tp=2.
    plan = fe.plan_sharding(LinenWide(), mesh, jax.random.key(0), X)
    shardings = fe.logical_to_mesh_sharding(_linen_abstract(LinenWide()), mesh)
    assert plan["params/wide/kernel"].spec == P("tp", "fsdp")
    assert shardings["params"]["wide"]["kernel"].spec == P("tp", "fsdp")
    # Turned off, both keep the rules' answer.
    plan = fe.plan_sharding(LinenWide(), mesh, jax.random.key(0), X, use_idle_axes=False)
    shardings = fe.logical_to_mesh_sharding(_linen_abstract(LinenWide()), mesh, use_idle_axes=False)
    assert plan["params/wide/kernel"].spec == P("tp", None)
    assert shardings["params"]["wide"]["kernel"].spec == P("tp", None)


@pytest.mark.parametrize(
    "model",
    [LinenWide(), LinenParamWithAxes(), LinenOwnRules()],
    ids=["linen_boxes", "params_axes", "own_rules"],
)
def test_linen_trees_agree_with_plan_sharding(mesh, model):
    plan = fe.plan_sharding(model, mesh, jax.random.key(0), X)
    shardings = fe.logical_to_mesh_sharding(_linen_abstract(model), mesh)
    assert _specs(shardings["params"]) == _plan_specs(plan)


def test_own_rules_win_over_the_plans(mesh):
    shardings = fe.logical_to_mesh_sharding(_linen_abstract(LinenOwnRules()), mesh)
    assert shardings["params"]["up"]["kernel"].spec == P("fsdp", "tp")


def test_params_axes_collection_has_no_shardings_of_its_own(mesh):
    shardings = fe.logical_to_mesh_sharding(_linen_abstract(LinenParamWithAxes()), mesh)
    assert shardings["params"]["wide"].spec == P("tp", "fsdp")
    assert jax.tree.leaves(shardings["params_axes"]) == []


def test_nnx_state_and_module_agree_with_plan_sharding(mesh):
    plan = fe.plan_sharding(NnxWide, mesh, 0)
    abstract = _nnx_abstract()
    from_state = fe.logical_to_mesh_sharding(nnx.state(abstract), mesh)
    from_module = fe.logical_to_mesh_sharding(abstract, mesh)
    assert _specs(from_state) == _plan_specs(plan)
    assert _specs(from_module) == _plan_specs(plan)
    assert from_state["wide"]["kernel"].spec == P("tp", "fsdp")


def test_train_state_follows_the_completed_parameters(mesh):
    params = _linen_abstract(LinenWide())["params"]
    state = jax.eval_shape(
        lambda p: TrainState.create(apply_fn=None, params=p, tx=optax.adamw(1e-3)), params
    )
    shardings = fe.logical_to_mesh_sharding(state, mesh)
    assert _specs(shardings) == _plan_specs(build_plan(*annotated_leaves(state), mesh))
    # The parameters as plan_sharding plans them; Adam's moments follow them; counts replicate.
    model_plan = fe.plan_sharding(LinenWide(), mesh, jax.random.key(0), X)
    assert _specs(shardings.params) == _plan_specs(model_plan)
    adam = shardings.opt_state[0]
    assert _specs(adam.mu) == _specs(adam.nu) == _plan_specs(model_plan)
    assert adam.mu["wide"]["kernel"].spec == P("tp", "fsdp")
    assert adam.count.spec == P()


def test_corrections_warn_naming_the_path_as_plan_sharding_does(mesh):
    model = LinenUneven()
    with pytest.warns(fe.ShardingCorrectionWarning, match="'params/odd/kernel'") as ours:
        shardings = fe.logical_to_mesh_sharding(_linen_abstract(model), mesh)
    with pytest.warns(fe.ShardingCorrectionWarning, match="'params/odd/kernel'") as theirs:
        plan = fe.plan_sharding(model, mesh, jax.random.key(0), X)
    assert _specs(shardings["params"]) == _plan_specs(plan)
    assert str(ours[0].message) == str(theirs[0].message)


def test_strict_raises_naming_the_path_as_plan_sharding_does(mesh):
    model = LinenUneven()
    with pytest.raises(fe.ShardingResolutionError, match="'params/odd/kernel'") as ours:
        fe.logical_to_mesh_sharding(_linen_abstract(model), mesh, strict=True)
    with pytest.raises(fe.ShardingResolutionError, match="'params/odd/kernel'") as theirs:
        fe.plan_sharding(model, mesh, jax.random.key(0), X, strict=True)
    assert str(ours.value) == str(theirs.value)


def test_errors_name_the_path(mesh):
    tree = {"params": {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8,), jnp.float32), UP)}}
    with pytest.raises(fe.ShardingResolutionError, match="parameter 'params/w': logical axes"):
        fe.logical_to_mesh_sharding(tree, mesh)


def test_specs_are_never_completed(mesh):
    # No shape: the rules' answer, whatever use_idle_axes says.
    shardings = fe.logical_to_mesh_sharding({"w": P(*WIDE)}, mesh, use_idle_axes=True)
    assert shardings["w"].spec == P("tp", None)


def test_use_idle_axes_is_checked(mesh):
    with pytest.raises(fe.EscaleTypeError, match="use_idle_axes must be True or False"):
        fe.logical_to_mesh_sharding(_linen_abstract(LinenWide()), mesh, use_idle_axes="no")


# Flax's own function, on specs and on annotated variables.

RULES = [("batch", "fsdp"), ("hidden_state", "tp"), ("mlp_intermediate", "tp")]


def test_logical_to_mesh_sharding_agrees_with_flax(mesh):
    specs = {"w": P("batch", "hidden_state"), "b": P("mlp_intermediate"), "s": None}
    ours = fe.logical_to_mesh_sharding(specs, mesh, RULES)
    flax = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    assert jax.tree.map(lambda s: s.spec, ours) == jax.tree.map(lambda s: s.spec, flax)


def test_logical_to_mesh_sharding_reads_annotated_variables(mesh):
    # 6 is not divisible by tp=2's partner fsdp=4: shape-aware where Flax's cannot be.
    model = nn.Dense(
        16,
        kernel_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed", "hidden_state")),
    )
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 6)))
    with pytest.warns(fe.ShardingCorrectionWarning, match=r"logical name 'embed' has no rule"):
        shardings = fe.logical_to_mesh_sharding(abstract, mesh, RULES)
    assert shardings["params"]["kernel"].spec == P(None, "tp")
    assert shardings["params"]["bias"].spec == P(None)


# The fast way (each distinct annotation read once, each distinct one resolved once) against
# the plain one, build_plan, on any tree: warnings and errors included. Nothing here times
# anything: the speed is measured by bench/b03_resolution_speed.py.

NAMES = [
    ("hidden_state", "mlp_intermediate"),
    ("mlp_intermediate", "hidden_state"),
    ("hidden_state", "head", "attention_dim"),
    ("vocab", "hidden_state"),
    ("hidden_state",),
    ("expert", "hidden_state", "mlp_intermediate"),
    ("layers", "hidden_state"),
    ("batch", None),
]


BAD_NAMES = [("hidden_state", "no_such_name"), ("hidden_state", "hidden_state")]


MESH_NAMES = [("fsdp", "tp"), (("fsdp", "sp"), None), ("tp",), ("fsdp", None), ("nope", None)]
MESH_NAMES += [("tp", "tp")]


def leaf_st(good: bool):
    """A leaf that resolves as it is (``good``: sizes the mesh divides), or any leaf."""
    sizes = st.sampled_from([8, 16, 32] if good else [1, 2, 3, 4, 6, 8])

    def logical(names):
        rank = st.integers(len(names), len(names) + 1)
        shape = rank.flatmap(lambda n: st.lists(sizes, min_size=n, max_size=n))
        return shape.map(
            lambda s: nn.LogicallyPartitioned(jax.ShapeDtypeStruct(tuple(s), jnp.float32), names)
        )

    def meshed(names):
        shape = st.lists(sizes, min_size=len(names), max_size=len(names))
        return shape.map(
            lambda s: nn.Partitioned(jax.ShapeDtypeStruct(tuple(s), jnp.float32), names)
        )

    plain = st.lists(sizes, max_size=3).map(lambda s: jax.ShapeDtypeStruct(tuple(s), jnp.float32))
    return st.one_of(
        st.sampled_from(NAMES if good else NAMES + BAD_NAMES).flatmap(logical),
        st.sampled_from(MESH_NAMES[:4] if good else MESH_NAMES).flatmap(meshed),
        plain,
    )


def tree_st(good: bool):
    return st.recursive(
        leaf_st(good),
        lambda children: (
            st.dictionaries(st.sampled_from("abcdefg"), children, min_size=1, max_size=4)
            | st.lists(children, min_size=1, max_size=3)
            | st.lists(children, min_size=1, max_size=3).map(tuple)
        ),
        max_leaves=10,
    ).map(lambda t: {"params": t})


def general(tree, mesh, rules, strict=False):
    treedef, items = annotated_leaves(tree)
    return build_plan(treedef, items, mesh, rules=rules, strict=strict).shardings()


def run(fn, *args, **kwargs) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(*args, **kwargs)
        except Exception as error:  # the same error either way
            result = f"{type(error).__name__}: {error}"
    return result, [f"{w.category.__name__}: {w.message}" for w in caught]


def same_shardings(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.mesh == y.mesh and x.spec == y.spec for x, y in zip(left, right, strict=True)
    )


def box(shape, names, **kwargs):
    return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names, **kwargs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=tree_st(good=True) | tree_st(good=False), strict=st.booleans())
def test_plain_trees_give_what_build_plan_gives(mesh, tree, strict):
    rules = fe.PartitionAxis().logical_axis_rules()
    ours, our_warnings = run(fe.logical_to_mesh_sharding, tree, mesh, rules, strict=strict)
    theirs, their_warnings = run(general, tree, mesh, rules, strict=strict)
    assert same_shardings(ours, theirs)
    assert our_warnings == their_warnings


def test_eval_shape_of_a_linen_model_gives_what_build_plan_gives(mesh):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            up = nn.with_logical_partitioning(init, ("hidden_state", "mlp_intermediate"))
            down = nn.with_logical_partitioning(init, ("mlp_intermediate", "hidden_state"))
            scale = nn.with_logical_partitioning(nn.initializers.ones, ("hidden_state",))
            h = nn.Dense(64, kernel_init=up, name="up")(x)
            y = nn.Dense(16, kernel_init=down, use_bias=False, name="down")(h)
            return y * self.param("scale", scale, (16,))

    abstract = jax.eval_shape(Block().init, jax.random.key(0), jnp.ones((2, 16)))
    shardings = fe.logical_to_mesh_sharding(abstract, mesh)
    assert same_shardings(shardings, general(abstract, mesh, None))
    assert shardings["params"]["up"]["kernel"].spec == P(("fsdp", "sp"), "tp")
    assert shardings["params"]["up"]["bias"].spec == P(None)  # unannotated: replicated


@pytest.mark.parametrize(
    "tree",
    [
        {"params": {"w": box((8, 4), ("hidden_state", "mlp_intermediate"))}, "opt_state": {}},
        {"params": {"w": box((8, 4), ("embed", "mlp"), rules=(("embed", "tp"), ("mlp", None)))}},
        {"params": FrozenDict({"w": box((8, 4), ("hidden_state", "mlp_intermediate"))})},
        {"params": {0: box((8, 4), ("hidden_state", "mlp_intermediate"))}},
        {
            "params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)},
            "params_axes": {"w_axes": partitioning.AxisMetadata(("hidden_state", "tp"))},
        },
        {"params": {"w": box((8, 4), ("hidden_state", "mlp_intermediate")), "step": 3}},
    ],
    ids=["opt_state", "own_rules", "frozen_dict", "int_key", "params_axes", "python_int"],
)
def test_other_trees_give_what_build_plan_gives(mesh, tree):
    ours, our_warnings = run(fe.logical_to_mesh_sharding, tree, mesh)
    theirs, their_warnings = run(general, tree, mesh, None)
    assert same_shardings(ours, theirs)
    assert our_warnings == their_warnings


def test_spec_trees_resolve_each_spec_once_and_still_warn(mesh):
    specs = {
        f"layer_{i}": {"w": P("hidden_state", "mlp_intermediate"), "b": P("no_rule")}
        for i in range(3)
    }
    with pytest.warns(fe.ShardingCorrectionWarning, match="no_rule"):
        shardings = fe.logical_to_mesh_sharding(specs, mesh)
    for i in range(3):
        assert shardings[f"layer_{i}"]["w"].spec == P(("fsdp", "sp"), "tp")
        assert shardings[f"layer_{i}"]["b"].spec == P(None)
    with pytest.raises(fe.ShardingResolutionError, match="no_rule"):
        fe.logical_to_mesh_sharding(specs, mesh, strict=True)


# Mistakes with logical_to_mesh_sharding, one case each (what a case asserts: support/mistakes.py).
MISTAKES = [
    case(
        lambda: fe.logical_to_mesh_sharding({"w": P("batch")}, None),
        T,
        "mesh",
        "None",
        r"create_mesh\(",
        id="logical_to_mesh_sharding-mesh-none",
    ),
    case(
        lambda: fe.logical_to_mesh_sharding({"w": "batch"}, mesh5()),
        T,
        "tree",
        "'batch'",
        r"PartitionSpec\('batch'\)",
        id="logical_to_mesh_sharding-leaf-string",
    ),
    case(
        lambda: fe.logical_to_mesh_sharding("params", mesh5()),
        T,
        "tree",
        "'params'",
        r"jax\.eval_shape",
        id="logical_to_mesh_sharding-tree-string",
    ),
    case(
        lambda: fe.logical_to_mesh_sharding({"w": jnp.zeros((8, 4)), "step": 3}, mesh5()),
        T,
        "the leaf 'step'",
        "int 3",
        r"keep it out of the tree, or make it one",
        id="logical_to_mesh_sharding-python-int-leaf",
    ),
]


@pytest.mark.parametrize(MISTAKE, MISTAKES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
