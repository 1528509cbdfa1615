"""Tests of ``with_sharding_constraint`` and ``apply_spec``
(``flax_escale/sharding/_constraint.py``): arrays placed by mesh-axis specs, in and out of
``jax.jit``, on Auto and Explicit axes; the mistakes they refuse.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints
from support.mistakes import MISTAKE, T, X, case, mesh_dp_tp, raises_a_library_error

import flax_escale as fe
from flax_escale import (
    ShardingCorrectionWarning,
    ShardingResolutionError,
    create_mesh,
    with_sharding_constraint,
)

AXIS_TYPES = ["auto", "explicit"]


def _mesh(axis_types, dims=(2, 4), names=("dp", "tp")):
    return create_mesh(dims, names, axis_types=axis_types)


def _equivalent(array, mesh, spec):
    return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_partition_spec_with_explicit_mesh_outside_jit(axis_types):
    mesh = _mesh(axis_types)
    x = jnp.arange(64.0).reshape(8, 8)
    y = with_sharding_constraint(x, P("dp", "tp"), mesh=mesh)
    assert _equivalent(y, mesh, P("dp", "tp"))
    assert y.addressable_shards[0].data.shape == (4, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_named_sharding_carries_its_mesh(axis_types):
    mesh = _mesh(axis_types)
    y = with_sharding_constraint(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "tp")))
    assert _equivalent(y, mesh, P(None, "tp"))


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_set_mesh_context_in_and_out_of_jit(axis_types):
    mesh = _mesh(axis_types)
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)

    @jax.jit
    def f(x):
        return with_sharding_constraint(x * 2, P("tp", "dp"))

    with jax.set_mesh(mesh):
        eager = with_sharding_constraint(x, P("tp", "dp"))
        traced = f(x)
        text = f.lower(x).as_text()
    assert _equivalent(eager, mesh, P("tp", "dp"))
    assert _equivalent(traced, mesh, P("tp", "dp"))
    # Under Explicit axes the program has open constraints ([{}, {}]) of its own: look for ours.
    assert ('[{"tp"}, {"dp"}]', "8x8xf32") in sharding_constraints(text)
    np.testing.assert_array_equal(np.asarray(traced), x * 2)


def test_legacy_mesh_context_is_seen():
    mesh = _mesh("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            y = with_sharding_constraint(jnp.ones((8, 8)), P("dp"))
    assert _equivalent(y, mesh, P("dp"))


def test_numpy_and_python_input():
    mesh = _mesh("auto")
    y = with_sharding_constraint(np.arange(8), P("tp"), mesh=mesh)
    assert isinstance(y, jax.Array)
    assert _equivalent(y, mesh, P("tp"))
    np.testing.assert_array_equal(np.asarray(y), np.arange(8))
    scalar = with_sharding_constraint(3.0, P(), mesh=mesh)
    assert isinstance(scalar, jax.Array)
    assert float(scalar) == 3.0


def test_no_mesh_returns_the_input_unchanged():
    x = np.ones((4, 4))
    assert with_sharding_constraint(x, P("dp")) is x
    tree = {"a": jnp.ones(2)}
    assert with_sharding_constraint(tree, P("dp"))["a"] is tree["a"]


def test_pytrees_with_one_spec_or_a_tree_of_specs():
    mesh = _mesh("auto")
    tree = {"w": jnp.ones((8, 8)), "b": [jnp.ones(8)]}
    same = with_sharding_constraint(tree, P("tp"), mesh=mesh)
    assert _equivalent(same["w"], mesh, P("tp"))
    assert _equivalent(same["b"][0], mesh, P("tp"))
    specs = {"w": P(None, "tp"), "b": [None]}
    each = with_sharding_constraint(tree, specs, mesh=mesh)
    assert _equivalent(each["w"], mesh, P(None, "tp"))
    assert _equivalent(each["b"][0], mesh, P())


def test_spec_is_padded_and_truncated_to_the_rank():
    mesh = _mesh("auto")
    padded = with_sharding_constraint(jnp.ones((8, 8, 2)), P("dp"), mesh=mesh)
    assert _equivalent(padded, mesh, P("dp", None, None))
    with pytest.warns(ShardingCorrectionWarning, match=r"dimension 1: the spec has 2 entries"):
        truncated = with_sharding_constraint(jnp.ones(8), P(None, "tp"), mesh=mesh)
    assert _equivalent(truncated, mesh, P())


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_dimensions_that_do_not_fit_are_dropped_with_a_warning(axis_types):
    mesh = _mesh(axis_types)
    with pytest.warns(ShardingCorrectionWarning, match=r"size 6 is not divisible by \('tp',\)"):
        y = with_sharding_constraint(jnp.ones((8, 6)), P("dp", "tp"), mesh=mesh)
    with pytest.warns(ShardingCorrectionWarning, match=r"mesh axis 'model' is not in the mesh"):
        z = with_sharding_constraint(jnp.ones((8, 8)), P("model", "tp"), mesh=mesh)
    assert _equivalent(y, mesh, P("dp", None))
    assert _equivalent(z, mesh, P(None, "tp"))


def test_strict_raises_instead():
    mesh = _mesh("auto")
    with pytest.raises(
        ShardingResolutionError,
        match=r"mesh axes P\('dp', 'tp'\) with shape \(8, 6\) on mesh \{'dp': 2, 'tp': 4\} "
        r"resolve to P\('dp', 'tp'\), corrected to P\('dp', None\):\n  - dimension 1: size 6 is "
        r"not divisible(.|\n)*strict=False",
    ):
        with_sharding_constraint(jnp.ones((8, 6)), P("dp", "tp"), mesh=mesh, strict=True)


def test_mixed_auto_and_explicit_axes():
    mesh = create_mesh((2, 4), ("dp", "tp"), axis_types=("explicit", "auto"))
    x = jnp.arange(64.0).reshape(8, 8)

    @jax.jit
    def f(x):
        return with_sharding_constraint(x + 1, P("dp", "tp"))

    with jax.set_mesh(mesh):
        y = f(x)
    assert _equivalent(y, mesh, P("dp", "tp"))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) + 1)


def test_unconstrained_in_a_spec_stays_unconstrained(mesh):
    # As JAX's own with_sharding_constraint leaves it.
    x = jnp.ones((8, 16))
    spec = P(P.UNCONSTRAINED, "tp")
    with jax.set_mesh(mesh):
        ours, jax_own = (
            sharding_constraints(jax.jit(lambda x, f=f: f(x * 2, spec)).lower(x).as_text())
            for f in (with_sharding_constraint, jax.lax.with_sharding_constraint)
        )
    assert len(ours) == 1
    assert ours == jax_own


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    # --- a string where a sequence of names is expected -------------------------------------
    case(
        lambda: fe.with_sharding_constraint(X, "dp", mesh=mesh_dp_tp()),
        T,
        "sharding",
        "'dp'",
        r"PartitionSpec\('dp'\)",
        id="with_sharding_constraint-spec-string",
    ),
    # --- a wrong type where a mesh is expected ---------------------------------------------
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh="dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="with_sharding_constraint-mesh-string",
    ),
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh=8),
        T,
        "mesh",
        "int 8",
        r"create_mesh\(",
        id="with_sharding_constraint-mesh-int",
    ),
    # --- the sharding layer: transfers, trees of specs, constraints, optimizer state -------
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh=mesh_dp_tp(), strict="yes"),
        T,
        "strict",
        "'yes'",
        "True or False",
        id="with_sharding_constraint-strict-string",
    ),
    case(
        lambda: fe.with_sharding_constraint("x", P("dp"), mesh=mesh_dp_tp()),
        T,
        "x",
        "'x'",
        "arrays to constrain",
        id="with_sharding_constraint-x-string",
    ),
    case(
        lambda: fe.with_sharding_constraint({"a": X}, {"b": P()}, mesh=mesh_dp_tp()),
        fe.EscaleError,
        "sharding",
        "{'b': P()}",
        "same keys",
        id="with_sharding_constraint-other-keys",
    ),
    case(
        lambda: fe.sharding.apply_spec(jnp.zeros((8, 4)), "dp", mesh_dp_tp()),
        T,
        "spec",
        "'dp'",
        r"PartitionSpec\('dp'\)",
        id="apply_spec-string",
    ),
    case(
        lambda: fe.sharding.apply_spec(jnp.zeros((8, 4)), P("dp", "dp"), mesh_dp_tp()),
        fe.EscaleError,
        "spec",
        "P('dp', 'dp')",
        "twice",
        id="apply_spec-axis-twice",
    ),
    case(
        lambda: fe.sharding.apply_spec(jnp.zeros((8, 4)), P("dp"), "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="apply_spec-mesh-string",
    ),
    # --- an AbstractMesh where a concrete array must be placed, outside jax.jit ---------------
    case(
        lambda: fe.with_sharding_constraint(X, P("dp"), mesh=mesh_dp_tp().abstract_mesh),
        T,
        "mesh",
        "AbstractMesh",
        r"or constrain inside a jitted function",
        id="with_sharding_constraint-abstract-mesh-outside-jit",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
