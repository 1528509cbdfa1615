"""logical_shard_map: jax.shard_map whose specs are logical names, resolved by the rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.sharding import logical_shard_map

AXIS_TYPES = ["auto", "explicit"]


def _where(x):
    """Per block: which fsdp and tp device holds it, as ``10 * fsdp + tp``."""
    index = jax.lax.axis_index("fsdp") * 10 + jax.lax.axis_index("tp")
    return jnp.full((1, 1), index, jnp.int32) + jnp.zeros_like(x[:1, :1], jnp.int32)


def test_specs_come_from_the_rules(mesh):
    # mesh: fsdp=4, tp=2. batch -> (fsdp, dp), hidden_state -> tp.
    seen = []

    def body(x):
        seen.append(x.shape)
        return _where(x)

    f = logical_shard_map(
        body, in_axes=[("batch", "hidden_state")], out_axes=("batch", "hidden_state"), mesh=mesh
    )
    out = jax.jit(f)(jnp.ones((8, 6)))
    assert seen == [(2, 3)]  # 8 / fsdp=4 rows, 6 / tp=2 columns
    # Block (i, j) of the output is the one fsdp device i and tp device j computed.
    assert out.tolist() == [[0, 1], [10, 11], [20, 21], [30, 31]]
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "tp")), 2)


def test_the_blocks_are_the_devices_slices(mesh):
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)

    def body(x):
        # Each device's block, summed over its rows: its share of the global column sums.
        return x.sum(axis=0, keepdims=True)

    f = logical_shard_map(
        body, in_axes=[("batch", "hidden_state")], out_axes=("batch", "hidden_state"), mesh=mesh
    )
    got = np.asarray(jax.jit(f)(x))
    want = np.asarray(x).reshape(4, 2, 6).sum(axis=1)
    np.testing.assert_array_equal(got, want)


def test_the_current_mesh_is_used(mesh):
    def body(x):
        return jnp.full((1, 1), jax.lax.axis_index("fsdp"), jnp.int32) + jnp.zeros_like(
            x[:1, :1], jnp.int32
        )

    f = logical_shard_map(body, in_axes=[("batch", None)], out_axes=("batch", None))
    with jax.set_mesh(mesh):
        out = jax.jit(f)(jnp.ones((4, 2)))
    assert out.tolist() == [[0], [1], [2], [3]]


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_auto_and_explicit_meshes(axis_types):
    mesh = fe.create_mesh((2, 2, 1, 2, 1), axis_types=axis_types)
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    f = logical_shard_map(
        lambda x: x * 2 + jax.lax.axis_index("tp"),
        in_axes=[("batch", "hidden_state")],
        out_axes=("batch", "hidden_state"),
        mesh=mesh,
    )
    out = jax.jit(f)(x)
    tp_of_column = np.repeat([0, 1], 3)[None, :]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2 + tp_of_column)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(("fsdp", "dp"), "tp")), 2)
    with jax.set_mesh(mesh):
        eager = f(x)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(out))


def test_explicit_mesh_with_a_size_one_axis_in_the_spec():
    # batch -> (fsdp, dp), and dp has size 1 here.
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types="explicit")
    f = logical_shard_map(
        lambda x: x.sum(axis=0, keepdims=True),
        in_axes=[("batch", "hidden_state")],
        out_axes=("batch", "hidden_state"),
        mesh=mesh,
    )
    assert jax.jit(f)(jnp.ones((8, 6))).shape == (4, 6)


def test_explicit_mesh_with_a_size_one_axis_works_outside_jit():
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types="explicit")
    f = logical_shard_map(
        lambda x: x.sum(axis=0, keepdims=True),
        in_axes=[("batch", "hidden_state")],
        out_axes=("batch", "hidden_state"),
        mesh=mesh,
    )
    out = f(jnp.ones((8, 6)))
    np.testing.assert_array_equal(np.asarray(out), np.full((4, 6), 2.0))


def test_pytree_in_axes_and_several_arguments(mesh):
    seen = {}

    def body(params, x):
        seen.update({name: value.shape for name, value in params.items()}, x=x.shape)
        return x @ params["kernel"] + params["bias"]

    f = logical_shard_map(
        body,
        in_axes=[
            {"kernel": ("hidden_state", None), "bias": (None,)},
            ("batch", "hidden_state"),
        ],
        out_axes=("batch", None),
        mesh=mesh,
        check_vma=False,  # the partial sums over tp are summed below, outside the body
    )
    params = {"kernel": jnp.ones((6, 3)), "bias": jnp.arange(3.0)}
    x = jnp.ones((8, 6))
    out = jax.jit(f)(params, x)
    assert seen == {"kernel": (3, 3), "bias": (3,), "x": (2, 3)}
    # Each tp device's half of the contraction: 3 ones, plus the bias.
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to([3.0, 4.0, 5.0], (8, 3)))


def test_list_in_axes_and_tuple_outputs(mesh):
    def body(pair):
        a, b = pair
        return a + 1, b.sum(axis=1, keepdims=True)

    f = logical_shard_map(
        body,
        in_axes=[[("batch", None), (None, "hidden_state")]],
        out_axes=(("batch", None), (None, "hidden_state")),
        mesh=mesh,
    )
    a, b = jax.jit(f)([jnp.zeros((8, 2)), jnp.ones((2, 6))])
    np.testing.assert_array_equal(np.asarray(a), np.ones((8, 2)))
    np.testing.assert_array_equal(np.asarray(b), np.full((2, 2), 3.0))


def test_a_partition_spec_is_taken_as_it_is(mesh):
    seen = []

    def body(x):
        seen.append(x.shape)
        return x

    # tp on the rows and fsdp on the columns: no rule would give this layout.
    f = logical_shard_map(body, in_axes=[P("tp", "fsdp")], out_axes=P("tp", "fsdp"), mesh=mesh)
    x = jnp.arange(32.0).reshape(4, 8)
    out = jax.jit(f)(x)
    assert seen == [(2, 2)]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", "fsdp")), 2)


def test_rules_are_respected(mesh):
    seen = []

    def body(x):
        seen.append(x.shape)
        return x

    f = logical_shard_map(
        body,
        in_axes=[("batch", "hidden_state")],
        out_axes=("batch", "hidden_state"),
        mesh=mesh,
        rules=fe.PartitionAxis(batch_axis="tp", hidden_state_axis="fsdp"),
    )
    out = jax.jit(f)(jnp.ones((8, 8)))
    assert seen == [(4, 2)]  # rows over tp=2, columns over fsdp=4
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("tp", "fsdp")), 2)
    # Plain Flax rules too.
    seen.clear()
    plain = logical_shard_map(
        body,
        in_axes=[("rows", "cols")],
        out_axes=("rows", "cols"),
        mesh=mesh,
        rules=[("rows", "fsdp"), ("cols", None)],
    )
    jax.jit(plain)(jnp.ones((8, 8)))
    assert seen == [(2, 8)]


def test_the_rules_context_is_used(mesh):
    seen = []

    def body(x):
        seen.append(x.shape)
        return x

    f = logical_shard_map(body, in_axes=[("batch", None)], out_axes=("batch", None), mesh=mesh)
    with fe.use_sharding(mesh, fe.PartitionAxis(batch_axis="tp")):
        jax.jit(f)(jnp.ones((8, 2)))
    assert seen == [(4, 2)]


def test_a_dimension_that_does_not_divide_is_replicated_with_a_warning(mesh):
    seen = []

    def body(x):
        seen.append(x.shape)
        return x

    f = logical_shard_map(body, in_axes=[("batch", None)], out_axes=(None, None), mesh=mesh)
    with pytest.warns(
        fe.ShardingCorrectionWarning, match=r"(?s)parameter 'in_axes\[0\]'.*size 6 is not"
    ):
        out = f(jnp.ones((6, 2)))
    assert seen == [(6, 2)]
    assert out.shape == (6, 2)


# --- mistakes -----------------------------------------------------------------------------------


def test_one_in_axes_entry_per_argument(mesh):
    f = logical_shard_map(
        lambda x: x,
        in_axes=[("batch", None), ("batch", None)],
        out_axes=("batch", None),
        mesh=mesh,
    )
    with pytest.raises(
        fe.EscaleError,
        match=r"logical_shard_map\('<lambda>'\): 1 arguments but 2 entries in in_axes; give one",
    ):
        f(jnp.ones((8, 2)))


def test_in_axes_must_be_a_sequence(mesh):
    with pytest.raises(
        fe.EscaleTypeError,
        match=r"in_axes must be a sequence with one entry per argument, got str 'batch'; e\.g\. "
        r"in_axes=\[\('batch', 'hidden_state'\)\]",
    ):
        logical_shard_map(lambda x: x, in_axes="batch", out_axes=("batch",), mesh=mesh)
    with pytest.raises(fe.EscaleTypeError, match=r"in_axes must be a sequence.*got int 3"):
        logical_shard_map(lambda x: x, in_axes=3, out_axes=("batch",), mesh=mesh)


@pytest.mark.parametrize(
    ("in_axes", "out_axes", "arg", "where"),
    [
        (["batch"], ("batch", None), jnp.ones((8, 2)), r"in_axes\[0\]"),
        ([{"a": "batch"}], ("batch", None), {"a": jnp.ones((8, 2))}, r"in_axes\[0\]\['a'\]"),
        ([("batch", None)], "batch", jnp.ones((8, 2)), r"out_axes"),
        ([3], ("batch", None), jnp.ones((8, 2)), r"in_axes\[0\]"),
    ],
)
def test_a_leaf_must_be_a_tuple_of_names(mesh, in_axes, out_axes, arg, where):
    f = logical_shard_map(lambda x: x, in_axes=in_axes, out_axes=out_axes, mesh=mesh)
    with pytest.raises(
        fe.EscaleTypeError,
        match=rf"logical_shard_map: {where} is .*; each array takes a tuple of logical names "
        r"\(or None\), e\.g\. \('batch', 'hidden_state'\)\.",
    ):
        f(arg)


def test_a_tuple_with_a_name_that_is_not_a_string_is_a_type_error(mesh):
    f = logical_shard_map(lambda x: x, in_axes=[("batch", 3)], out_axes=("batch", None), mesh=mesh)
    with pytest.raises(fe.EscaleTypeError, match=r"each array takes a tuple of logical names"):
        f(jnp.ones((8, 2)))


@pytest.mark.parametrize(
    ("in_axes", "arg", "structure"),
    [
        (
            {"a": ("batch", None), "b": (None, None)},
            {"a": jnp.ones((8, 2))},
            r"\{'a': \('batch', None\), 'b': \(None, None\)\}, whose structure does not match "
            r"the argument's \(PyTreeDef\(\{'a': \*\}\)\)",
        ),
        (
            [("batch", None), (None, None)],
            [jnp.ones((8, 2))],
            r"\[\('batch', None\), \(None, None\)\], whose structure does not match the "
            r"argument's \(PyTreeDef\(\[\*\]\)\)",
        ),
    ],
)
def test_the_structure_must_match_the_argument(mesh, in_axes, arg, structure):
    f = logical_shard_map(lambda x: x, in_axes=[in_axes], out_axes=(None, None), mesh=mesh)
    with pytest.raises(fe.EscaleError, match=rf"logical_shard_map: in_axes\[0\] is {structure}"):
        f(arg)


def test_no_mesh(devices):
    f = logical_shard_map(lambda x: x, in_axes=[("batch", None)], out_axes=("batch", None))
    with pytest.raises(fe.NoMeshError, match=r"No mesh is set in the current context"):
        f(jnp.ones((8, 2)))


def test_strict_refuses_a_dimension_that_does_not_divide(mesh):
    f = logical_shard_map(
        lambda x: x, in_axes=[("batch", None)], out_axes=("batch", None), mesh=mesh, strict=True
    )
    with pytest.raises(
        fe.ShardingResolutionError,
        match=r"logical axes \('batch', None\) with shape \(6, 2\) on mesh .* resolve to "
        r"P\(None, None\)(?s:.*)size 6 is not divisible by the mesh axes",
    ):
        f(jnp.ones((6, 2)))
    with pytest.raises(fe.EscaleTypeError, match=r"strict must be True or False, got int 1"):
        logical_shard_map(lambda x: x, in_axes=[("batch",)], out_axes=("batch",), strict=1)


def test_a_partition_spec_must_name_the_meshs_axes(mesh):
    f = logical_shard_map(lambda x: x, in_axes=[P("model")], out_axes=(None, None), mesh=mesh)
    with pytest.raises(
        fe.EscaleError,
        match=r"logical_shard_map: in_axes\[0\] P\('model',\) names mesh axis 'model', which is "
        r"not in the mesh",
    ):
        f(jnp.ones((8, 2)))
