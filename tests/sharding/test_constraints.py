import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.lowered import sharding_constraints

from flax_escale import (
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingResolutionError,
    constrain,
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


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_in_jit_reaches_the_compiled_program(axis_types):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    x = jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16)

    @jax.jit
    def f(x):
        return constrain(jnp.sin(x), ("batch", "sequence", "hidden_state"))

    with jax.set_mesh(mesh):
        y = f(x)
        lowered = f.lower(x)
        compiled = lowered.compile()
        compiled_text = compiled.as_text()
    expected = P(("fsdp", "dp"), "sp", "tp")
    assert _equivalent(y, mesh, expected)
    assert y.addressable_shards[0].data.shape == (2, 4, 8)
    # On Explicit axes those of size 1 (dp, sp) stay out of the type: JAX would count them.
    layout = (
        '[{"fsdp"}, {}, {"tp"}]' if axis_types == "explicit" else '[{"fsdp", "dp"}, {"sp"}, {"tp"}]'
    )
    assert sharding_constraints(lowered.as_text()) == [(layout, "8x4x16xf32")]
    assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, expected), 3)
    assert "f32[2,4,8]" in compiled_text  # the per-device shape in the partitioned program
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(jnp.sin)(x)))


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_constrain_outside_jit_and_with_explicit_mesh(axis_types):
    mesh = create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    y = constrain(np.ones((8, 16)), ("hidden_state", "mlp_intermediate"), mesh=mesh)
    assert _equivalent(y, mesh, P(("fsdp", "sp"), "tp"))


def test_constrain_is_corrected_for_the_shape():
    mesh = create_mesh((1, 2, 1, 4, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShardingCorrectionWarning)  # a fallback is not a warning
        y = constrain(jnp.ones((6,)), ("hidden_state",), mesh=mesh)
    assert _equivalent(y, mesh, P("fsdp"))


def test_constrain_uses_the_given_or_context_rules():
    mesh = create_mesh((2, 4), ("data", "model"))
    x = jnp.ones((8, 8))
    y = constrain(x, ("embed", "mlp"), rules=[("embed", "data"), ("mlp", "model")], mesh=mesh)
    assert _equivalent(y, mesh, P("data", "model"))
    with nn.logical_axis_rules([("embed", "model")]), jax.set_mesh(mesh):
        z = constrain(x, (None, "embed"))
    assert _equivalent(z, mesh, P(None, "model"))
    renamed = PartitionAxis(data_parallel_axis="data", tensor_parallel_axis="model")
    w = constrain(x, ("vocab", None), rules=renamed, mesh=mesh)
    assert _equivalent(w, mesh, P("model", None))


def test_constrain_unknown_names_warn_or_raise():
    mesh = create_mesh()
    with pytest.warns(ShardingCorrectionWarning, match=r"logical name 'embed' has no rule"):
        constrain(jnp.ones((8, 8)), ("batch", "embed"), mesh=mesh)
    with pytest.raises(ShardingResolutionError, match=r"logical name 'embed' has no rule"):
        constrain(jnp.ones((8, 8)), ("batch", "embed"), mesh=mesh, strict=True)


def test_constrain_without_a_mesh_is_the_identity():
    x = jnp.ones((4, 4))
    assert constrain(x, ("batch", "hidden_state")) is x
