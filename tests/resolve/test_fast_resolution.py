"""The fast ways of resolving give exactly what the plain algorithm gives.

- ``Resolver.resolve`` (rules read once per rules and mesh, merged once per logical axes) gives
  the :class:`Resolution` of the plain algorithm: every rule scanned in order, as Flax does, then
  ``fit_spec``, for any rules, names, shape and mesh;
- ``Resolver.spec_if_ok`` (an answer kept per rank and per which dimensions divide) gives that
  resolution's spec when it is ``ok`` and ``None`` otherwise, whatever shapes came before;
- ``logical_to_mesh_sharding`` on a plain tree of Linen boxes (each distinct box resolved once)
  gives what ``build_plan`` gives, warnings and errors included, and falls back to it for any
  tree where a leaf's spec may depend on another leaf's.

Nothing here times anything: the speed is measured by ``bench/resolution_speed.py``.
"""

import math
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax.core import FrozenDict
from flax.linen import partitioning
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale._specs import mesh_axes_of
from flax_escale.plan._annotation import annotated_leaves
from flax_escale.plan._plan import build_plan
from flax_escale.plan._tree import _plain_shardings
from flax_escale.resolve import PassedOver, Resolution, fit_spec
from flax_escale.resolve._logical import _FREE, _unplaced, resolver


def reference(names, rules, shape, mesh_shape) -> Resolution | str:
    """The plain algorithm: every rule scanned in order for every array."""
    if names is None:
        spec = P(*([None] * (0 if shape is None else len(shape))))
        return Resolution(None, spec, shape, mesh_shape, spec)
    repeated = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    if repeated:
        return (
            f"logical axes {names}: {repeated[0]!r} names more than one dimension; each logical "
            "name can shard at most one dimension of an array. Give the dimensions distinct names."
        )
    if shape is not None and len(shape) < len(names):
        return (
            f"logical axes {names} name {len(names)} dimensions but the shape {shape} has "
            f"{len(shape)}: give one logical name (or None) per dimension."
        )
    padded = 0 if shape is None else len(shape) - len(names)
    names = (*names, *(None,) * padded)
    mesh = None if mesh_shape is None else dict(mesh_shape)
    result = [_FREE if isinstance(n, str) else n for n in names]
    used: set[str] = set()
    passed = []
    for index, (name, target) in enumerate(rules):
        if name not in names:
            continue
        dim = names.index(name)
        axes = mesh_axes_of(target)
        if result[dim] is not _FREE or used.intersection(axes):
            continue
        in_mesh = mesh is not None and all(a in mesh for a in axes)
        size = math.prod(mesh[a] for a in axes) if in_mesh else None
        if size is not None and shape is not None and shape[dim] % size:
            passed.append(PassedOver(dim, name, axes, shape[dim]))
            continue
        if axes and size == 1 and any(n == name for n, _ in rules[index + 1 :]):
            continue
        result[dim] = target
        used.update(axes)
    rules_spec = P(*(None if r is _FREE else r for r in result))
    known = {name for name, _ in rules}
    unknown = tuple(n for n in names if isinstance(n, str) and n not in known) if rules else ()
    spec, corrections = rules_spec, ()
    if mesh is not None:
        spec, corrections = fit_spec(rules_spec, shape, mesh)
        corrections = _unplaced(result, passed, mesh) + corrections
    return Resolution(
        names, spec, shape, mesh_shape, rules_spec, corrections, tuple(passed), unknown, padded
    )


MESH_AXES = ("x", "y", "z")
TARGETS = [
    None,
    P.UNCONSTRAINED,
    "x",
    "y",
    "z",
    "q",
    ("x", "y"),
    ("y", "z"),
    ("x", "x"),
    ("z", "q"),
]
LOGICAL = ["a", "b", "c", "d", "unknown", None, ("x", "y"), ("z",)]
SIZES = [0, 1, 2, 3, 4, 6, 8, 12]

rules_st = st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(TARGETS)), max_size=8)
mesh_st = st.none() | st.permutations(MESH_AXES).flatmap(
    lambda axes: st.lists(st.sampled_from([1, 2, 3, 4]), min_size=3, max_size=3).map(
        lambda sizes: tuple(zip(axes, sizes, strict=True))
    )
)
names_st = st.none() | st.lists(st.sampled_from(LOGICAL), max_size=4).map(tuple)


def shapes_st(names):
    rank = 0 if names is None else len(names)
    lengths = st.integers(max(rank - 1, 0), rank + 2)
    one = lengths.flatmap(lambda n: st.lists(st.sampled_from(SIZES), min_size=n, max_size=n))
    return st.none() | one.map(tuple)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=rules_st, mesh_shape=mesh_st, data=st.data())
def test_resolver_is_the_plain_algorithm(rules, mesh_shape, data):
    rules = fe.resolve.as_logical_rules(rules)
    for _ in range(4):
        names = data.draw(names_st)
        shape = data.draw(shapes_st(names))
        got = resolver(rules, mesh_shape).resolve(names, shape)
        assert got == reference(names, rules, shape, mesh_shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rules=rules_st, mesh_shape=mesh_st, names=names_st, data=st.data())
def test_spec_if_ok_is_the_spec_of_an_ok_resolution(rules, mesh_shape, names, data):
    # One resolver for many shapes of the same names: its answers kept per rank and per which
    # dimensions divide must hold for every shape that comes after.
    rules = fe.resolve.as_logical_rules(rules)
    shapes = data.draw(st.lists(shapes_st(names).filter(lambda s: s is not None), max_size=12))
    for shape in shapes:
        expected = reference(names, rules, shape, mesh_shape)
        ok = isinstance(expected, Resolution) and expected.ok
        assert resolver(rules, mesh_shape).spec_if_ok(names, shape) == (
            expected.spec if ok else None
        )


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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=tree_st(good=True) | tree_st(good=False), strict=st.booleans())
def test_plain_trees_give_what_build_plan_gives(mesh, tree, strict):
    rules = fe.PartitionAxis().logical_axis_rules()
    ours, our_warnings = run(fe.logical_to_mesh_sharding, tree, mesh, rules, strict=strict)
    theirs, their_warnings = run(general, tree, mesh, rules, strict=strict)
    assert same_shardings(ours, theirs)
    assert our_warnings == their_warnings
    # The fast path answers exactly when nothing had to be said.
    fast = _plain_shardings(tree, mesh, rules)
    assert (fast is not None) == (not their_warnings and not isinstance(theirs, str))


def test_eval_shape_of_a_linen_model_takes_the_fast_path(mesh):
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
    fast = _plain_shardings(abstract, mesh, None)
    assert fast is not None
    assert same_shardings(fast, general(abstract, mesh, None))
    assert fast["params"]["up"]["kernel"].spec == P(("fsdp", "sp"), "tp")
    assert fast["params"]["up"]["bias"].spec == P(None)  # unannotated: replicated


def box(shape, names, **kwargs):
    return nn.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names, **kwargs)


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
def test_trees_the_fast_path_leaves_to_build_plan(mesh, tree):
    assert _plain_shardings(tree, mesh, None) is None
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
