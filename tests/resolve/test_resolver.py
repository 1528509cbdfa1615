"""``Resolver`` (``flax_escale/resolve/_resolver.py``): logical axes and rules to a spec.

It resolves as Flax does, shape-aware. ``Resolver.resolve`` (rules read once per rules and
mesh, merged once per logical axes, a resolution kept per rank and per which dimensions divide)
gives the :class:`Resolution` of the plain algorithm: every rule scanned in order, as Flax does,
then ``fit_spec``, for any rules, names, shape and mesh, whatever shapes the same resolver
resolved before.
"""

import math

import flax.linen as nn
import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import (
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingResolutionError,
    create_mesh,
    logical_to_mesh_axes,
    resolve_logical_axes,
)
from flax_escale._specs import mesh_axes_of
from flax_escale.resolve import PassedOver, Resolution, fit_spec
from flax_escale.resolve._resolver import _FREE, _unplaced, resolver
from flax_escale.t5x import standard_logical_axis_rules

FALLBACK_RULES = [
    ("batch", "data"),
    ("embed", "model"),
    ("mlp", "model"),
    ("embed", "data"),
    ("heads", ("model", "expert")),
    ("kv", None),
    ("heads", "data"),
    ("length", None),
    ("vocab", ("data", "model")),
]


# (rules, logical axes): repeated names as fallbacks, tuple targets, None targets and names.
TABLE = [
    (FALLBACK_RULES, ("batch", "embed")),
    (FALLBACK_RULES, ("embed", "mlp")),
    (FALLBACK_RULES, ("mlp", "embed")),
    (FALLBACK_RULES, ("batch", "mlp", "embed")),
    (FALLBACK_RULES, ("heads", "kv", "embed")),
    (FALLBACK_RULES, ("embed", "heads")),
    (FALLBACK_RULES, ("batch", "heads", "mlp")),
    (FALLBACK_RULES, ("vocab", "embed")),
    (FALLBACK_RULES, (None, "embed", None)),
    (FALLBACK_RULES, ("length", "embed")),
    (FALLBACK_RULES, ("unknown", "embed")),
    (FALLBACK_RULES, ()),
    (standard_logical_axis_rules(2, 2), ("batch", "length", "embed")),
    (standard_logical_axis_rules(2, 2), ("embed", "mlp")),
    (standard_logical_axis_rules(1, 2), ("vocab", "embed")),
    (standard_logical_axis_rules(), ("layers", "embed", "joined_kv")),
    (PartitionAxis().logical_axis_rules(), ("batch", "sequence", "vocab")),
    (PartitionAxis().logical_axis_rules(), ("expert", "head", "hidden_state")),
    (PartitionAxis().logical_axis_rules(generation=True), ("batch", "key_sequence", "head")),
    ([("a", "x"), ("a", "y"), ("b", "x"), ("b", None), ("c", "y")], ("a", "b", "c")),
    ([("a", None), ("a", "x")], ("a",)),
    ([("a", ("x", "y")), ("b", "y"), ("b", "x")], ("b", "a")),
]


MESH_AXES = ["x", "y", "z"]


LOGICAL = ["a", "b", "c", "d", "e"]


targets = st.one_of(
    st.none(),
    st.sampled_from(MESH_AXES),
    st.lists(st.sampled_from(MESH_AXES), min_size=1, max_size=2, unique=True).map(tuple),
)


# Names without a rule warn (the library is never silent); the values must still be Flax's.
@pytest.mark.filterwarnings("ignore::flax_escale.ShardingCorrectionWarning")
@pytest.mark.parametrize(("rules", "axes"), TABLE)
def test_agrees_with_flax_linen(rules, axes):
    assert logical_to_mesh_axes(axes, rules) == nn.logical_to_mesh_axes(axes, rules)
    with nn.logical_axis_rules(rules):
        assert logical_to_mesh_axes(axes) == nn.logical_to_mesh_axes(axes)


@pytest.mark.filterwarnings("ignore::flax_escale.ShardingCorrectionWarning")
@settings(max_examples=300, deadline=None)
@given(
    rules=st.lists(st.tuples(st.sampled_from(LOGICAL), targets), max_size=8),
    axes=st.lists(st.one_of(st.none(), st.sampled_from(LOGICAL)), max_size=4).filter(
        lambda names: len({n for n in names if n}) == len([n for n in names if n])
    ),
)
def test_agrees_with_flax_linen_on_random_rules(rules, axes):
    assert logical_to_mesh_axes(axes, rules) == nn.logical_to_mesh_axes(axes, rules)


def test_shape_aware_fallback_for_hidden_state():
    mesh = create_mesh((1, 2, 1, 4, 1))  # fsdp=2, tp=4
    resolution = resolve_logical_axes(("hidden_state",), shape=(6,), mesh=mesh, strict=True)
    assert resolution.spec == P(("fsdp", "sp"))
    assert [(p.logical_name, p.mesh_axes, p.size) for p in resolution.passed_over] == [
        ("hidden_state", ("tp",), 6)
    ]
    assert resolution.ok
    # Without the shape, flax's answer.
    assert logical_to_mesh_axes(("hidden_state",), mesh=mesh) == P("tp")


def test_passed_over_frees_the_axis_for_another_dimension():
    mesh = create_mesh((1, 2, 1, 4, 1))
    spec = logical_to_mesh_axes(("vocab", "hidden_state"), shape=(10, 8), mesh=mesh)
    # vocab=10 cannot take tp=4, so it falls back to (fsdp, sp) of size 2; tp is then free for
    # hidden_state.
    assert spec == P(("fsdp", "sp"), "tp")


def test_nothing_fits_leaves_the_dimension_unsharded_and_says_so():
    mesh = create_mesh((1, 2, 1, 4, 1))
    resolution = resolve_logical_axes(("hidden_state",), shape=(7,), mesh=mesh)
    assert resolution.spec == P(None)
    assert len(resolution.passed_over) == 2
    assert not resolution.ok
    assert [(c.kind, c.dim, c.mesh_axes) for c in resolution.corrections] == [
        ("not_divisible", 0, ("tp",))
    ]
    with pytest.raises(
        ShardingResolutionError,
        match=r"dimension 0 \(hidden_state\): size 7 is not divisible by the mesh axes of any "
        r"of its rules \(\('tp',\) of size 4, \('fsdp', 'sp'\) of size 2\)",
    ):
        resolve_logical_axes(("hidden_state",), shape=(7,), mesh=mesh, strict=True)


def test_strict_raises_when_the_only_rule_does_not_divide():
    mesh = create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(ShardingResolutionError, match=r"\('batch',\) with shape \(3,\)"):
        resolve_logical_axes(("batch",), shape=(3,), mesh=mesh, strict=True)
    # A passed-over rule whose later rule applies is the fallback working, not a correction.
    assert resolve_logical_axes(("hidden_state",), shape=(6,), mesh=create_mesh((1, 2, 1, 4, 1))).ok


def test_size_one_axes_are_fine():
    mesh = create_mesh((1, 8, 1, 1, 1))
    resolution = resolve_logical_axes(
        ("batch", "sequence", "hidden_state"), shape=(8, 3, 5), mesh=mesh, strict=True
    )
    # sp has no later rule, so it stays; tp would split nothing and hidden_state has a
    # fallback, which fsdp (already taken by batch) cannot serve: the dimension stays whole.
    assert resolution.spec == P(("fsdp", "dp"), "sp", None)
    assert resolution.ok


def test_size_one_rules_leave_the_dimension_to_a_later_rule():
    mesh = create_mesh((1, 8, 1, 1, 1))
    assert logical_to_mesh_axes(("hidden_state",), shape=(64,), mesh=mesh) == P(("fsdp", "sp"))
    assert logical_to_mesh_axes(("hidden_state",)) == P("tp")  # no mesh: Flax's answer
    two = create_mesh((1, 4, 1, 2, 1))
    assert logical_to_mesh_axes(("hidden_state",), shape=(64,), mesh=two) == P("tp")


def test_axis_missing_from_the_mesh_is_corrected_and_recorded():
    mesh = create_mesh((2, 4), ("data", "model"))
    resolution = resolve_logical_axes(("batch", "hidden_state"), shape=(8, 8), mesh=mesh)
    assert resolution.rules_spec == P(("fsdp", "dp"), "tp")
    assert resolution.spec == P(None, None)
    assert [(c.kind, c.dim, c.mesh_axes) for c in resolution.corrections] == [
        ("not_in_mesh", 0, ("fsdp", "dp")),
        ("not_in_mesh", 1, ("tp",)),
    ]
    assert not resolution.ok


def test_strict_error_names_path_axes_shape_spec_mesh_and_fix():
    mesh = create_mesh((2, 4), ("data", "model"))
    with pytest.raises(ShardingResolutionError) as info:
        resolve_logical_axes(
            ("batch", "embed"),
            [("batch", "data"), ("embed", "tp")],
            shape=(8, 6),
            mesh=mesh,
            strict=True,
            path="decoder/mlp/kernel",
        )
    message = str(info.value)
    for fragment in (
        "parameter 'decoder/mlp/kernel'",
        "logical axes ('batch', 'embed')",
        "shape (8, 6)",
        "mesh {'data': 2, 'model': 4}",
        f"resolve to {P('data', 'tp')}",
        "mesh axis 'tp' is not in the mesh",
        "Add the axis to the mesh",
        "strict=False",
    ):
        assert fragment in message, (fragment, message)


def test_unknown_names_are_recorded_and_raise_in_strict_mode():
    resolution = resolve_logical_axes(("batch", "embed"), PartitionAxis())
    assert resolution.unknown_names == ("embed",)
    assert resolution.spec == P(("fsdp", "dp"), None)
    with pytest.raises(
        ShardingResolutionError, match=r"logical name 'embed' has no rule.*\('embed', None\)"
    ):
        resolve_logical_axes(("batch", "embed"), PartitionAxis(), strict=True)


def test_repeated_names_and_rank_mismatch_always_raise():
    with pytest.raises(ShardingResolutionError, match=r"'embed' names more than one dimension"):
        resolve_logical_axes(("embed", "embed"))
    with pytest.raises(
        ShardingResolutionError,
        match=r"parameter 'w': logical axes \('a', 'b'\) name 2 dimensions but the shape \(4,\)",
    ):
        resolve_logical_axes(("a", "b"), [], shape=(4,), path="w")


def test_not_divisible_after_the_rules_is_corrected():
    mesh = create_mesh((2, 4), ("data", "model"))
    resolution = resolve_logical_axes(("a", "b"), [("a", "model"), ("b", "model")], mesh=mesh)
    # Without a shape, only the mesh axes are checked; the rules already avoid reuse.
    assert resolution.spec == P("model", None)
    resolution = resolve_logical_axes(("a",), [("a", ("data", "model"))], shape=(6,), mesh=mesh)
    assert resolution.spec == P(None)
    assert resolution.passed_over[0].mesh_axes == ("data", "model")


def test_unannotated_arrays_are_replicated():
    assert resolve_logical_axes(None, shape=(3, 4)).spec == P(None, None)
    assert logical_to_mesh_axes(None) is None
    assert nn.logical_to_mesh_axes(None) is None  # the same as Flax's


def test_names_without_a_rule_warn_and_strict_raises():
    with pytest.warns(ShardingCorrectionWarning, match=r"logical name 'unknown' has no rule"):
        assert logical_to_mesh_axes(("unknown", "embed"), FALLBACK_RULES) == P(None, "model")
    with pytest.raises(ShardingResolutionError, match=r"logical name 'unknown' has no rule"):
        logical_to_mesh_axes(("unknown", "embed"), FALLBACK_RULES, strict=True)


def test_logical_to_mesh_axes_warns_on_what_does_not_fit():
    mesh = create_mesh((1, 8, 1, 1, 1))
    with pytest.warns(ShardingCorrectionWarning, match=r"size 3 is not divisible"):
        assert logical_to_mesh_axes(("batch",), shape=(3,), mesh=mesh) == P(None)


def test_an_empty_rules_context_means_no_rules():
    axes = ("batch", "hidden_state")
    with nn.logical_axis_rules(()):
        assert logical_to_mesh_axes(axes) == nn.logical_to_mesh_axes(axes) == P(None, None)
    # Outside any rules context, the library's defaults apply.
    assert logical_to_mesh_axes(axes) == P(("fsdp", "dp"), "tp")


def test_rules_sources_and_precedence():
    explicit = [("embed", "x")]
    with nn.logical_axis_rules([("embed", "y")]):
        assert logical_to_mesh_axes(("embed",)) == P("y")
        assert logical_to_mesh_axes(("embed",), explicit) == P("x")
        assert logical_to_mesh_axes(("hidden_state",), PartitionAxis()) == P("tp")
    # No rules anywhere: the PartitionAxis defaults.
    assert logical_to_mesh_axes(("hidden_state", "mlp_intermediate")) == P(("fsdp", "sp"), "tp")


def test_context_mesh_is_used_when_none_is_given():
    mesh = create_mesh((1, 2, 1, 4, 1))
    with jax.set_mesh(mesh):
        assert logical_to_mesh_axes(("hidden_state",), shape=(6,)) == P(("fsdp", "sp"))
    assert logical_to_mesh_axes(("hidden_state",), shape=(6,)) == P("tp")


def test_results_are_cached():
    mesh = create_mesh((1, 4, 1, 2, 1))
    first = resolve_logical_axes(("vocab", "hidden_state"), shape=(64, 32), mesh=mesh)
    again = resolve_logical_axes(["vocab", "hidden_state"], shape=[64, 32], mesh=mesh)
    assert first is again
    # The cached result is the right one, not just the same one: vocab takes tp, hidden_state
    # falls back to (fsdp, sp).
    assert first.spec == P("tp", ("fsdp", "sp"))
    assert first.ok


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


RANDOM_MESH_AXES = ("x", "y", "z")


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


RANDOM_NAMES = ["a", "b", "c", "d", "unknown", None, ("x", "y"), ("z",)]


SIZES = [0, 1, 2, 3, 4, 6, 8, 12]


rules_st = st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(TARGETS)), max_size=8)


mesh_st = st.none() | st.permutations(RANDOM_MESH_AXES).flatmap(
    lambda axes: st.lists(st.sampled_from([1, 2, 3, 4]), min_size=3, max_size=3).map(
        lambda sizes: tuple(zip(axes, sizes, strict=True))
    )
)


names_st = st.none() | st.lists(st.sampled_from(RANDOM_NAMES), max_size=4).map(tuple)


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
def test_a_resolver_resolves_every_shape_like_the_plain_algorithm(rules, mesh_shape, names, data):
    # One resolver for many shapes of the same names: a resolution kept for a shape that
    # divides alike must hold for every shape that comes after.
    rules = fe.resolve.as_logical_rules(rules)
    shapes = data.draw(st.lists(shapes_st(names).filter(lambda s: s is not None), max_size=12))
    for shape in shapes:
        got = resolver(rules, mesh_shape).resolve(names, shape)
        assert got == reference(names, rules, shape, mesh_shape)
