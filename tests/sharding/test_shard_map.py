"""logical_shard_map: jax.shard_map whose specs are logical names, resolved by the rules."""

import re

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
        match=rf"logical_shard_map\('<lambda>'\): {where} is .*; each array takes a tuple of "
        r"logical names \(or None\), e\.g\. \('batch', 'hidden_state'\)\.",
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
    with pytest.raises(
        fe.EscaleError, match=rf"logical_shard_map\('<lambda>'\): in_axes\[0\] is {structure}"
    ):
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
        match=r"logical_shard_map\('<lambda>'\): in_axes\[0\] P\('model',\) names mesh axis "
        r"'model', which is not in the mesh",
    ):
        f(jnp.ones((8, 2)))


# --- an output named like an input is split like it -------------------------------------------


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
@pytest.mark.parametrize("jitted", [False, True])
def test_an_output_follows_the_correction_of_the_input_it_is_named_like(axis_types, jitted):
    # batch -> (fsdp, dp): 6 rows do not split over fsdp=4, so the input is left whole; the
    # output, named alike, must be too, or the whole block would be taken for a quarter (24 rows).
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    x = jnp.arange(36.0).reshape(6, 6)
    f = logical_shard_map(
        lambda x: x, in_axes=[("batch", None)], out_axes=("batch", None), mesh=mesh
    )
    with pytest.warns(fe.ShardingCorrectionWarning) as caught:
        out = (jax.jit(f) if jitted else f)(x)
    assert out.shape == (6, 6)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    messages = [str(w.message) for w in caught]
    assert any(m.startswith("parameter 'in_axes[0]'") for m in messages)
    assert any(
        re.match(
            r"(?s)parameter 'out_axes': logical axes \('batch', None\) with shape None on mesh "
            r"\{.*\} resolve to P\(\('fsdp', 'dp'\), None\), corrected to P\(None, None\):\n"
            r"  - dimension 0 \(batch\): it is the dimension 'batch' of in_axes\[0\], where size 6 "
            r"is not divisible .*; dropped \('fsdp', 'dp'\)",
            m,
        )
        for m in messages
    )


def test_an_output_follows_the_input_inside_a_tree(mesh):
    # The second argument's hidden_state (6 on tp=2 divides; 3 does not) decides the output's.
    def body(params, x):
        return {"y": x * 2, "w": params["w"]}

    f = logical_shard_map(
        body,
        in_axes=[{"w": ("hidden_state",)}, ("batch", None)],
        out_axes={"y": ("batch", None), "w": ("hidden_state",)},
        mesh=mesh,
    )
    params, x = {"w": jnp.arange(3.0)}, jnp.arange(16.0).reshape(8, 2)
    with pytest.warns(fe.ShardingCorrectionWarning) as caught:
        out = jax.jit(f)(params, x)
    said = "it is the dimension 'hidden_state' of in_axes[0]['w'], where size 3 is not divisible"
    assert [said in str(w.message) for w in caught] == [False, True]  # the input's, the output's
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(out["y"]), np.asarray(x) * 2)
    assert out["y"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", None)), 2)


def test_an_output_named_like_an_uncorrected_input_warns_nothing(mesh):
    f = logical_shard_map(
        lambda x: x, in_axes=[("batch", None)], out_axes=("batch", None), mesh=mesh
    )
    x = jnp.arange(16.0).reshape(8, 2)
    out = f(x)  # filterwarnings=error: any warning fails
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def test_strict_refuses_the_output_correction_too(mesh):
    f = logical_shard_map(
        lambda x: x, in_axes=[(None, None)], out_axes=("batch", None), mesh=mesh, strict=True
    )
    # No input names batch: the output resolves by the rules alone, and the body's whole block
    # is a quarter of the output (what out_axes say).
    assert f(jnp.ones((6, 2))).shape == (24, 2)


# --- out_axes and in_axes mistakes name their entry ---------------------------------------------

MESH_TEXT = r"on mesh \{'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1\}"


@pytest.mark.parametrize(
    ("body", "out_axes", "message"),
    [
        (
            lambda x: x,
            ("batch", None, None),
            r"out_axes is \('batch', None, None\), longer than the rank of the block of shape "
            rf"\(2, 6\) the body returns there {MESH_TEXT}; give at most one logical name",
        ),
        (
            lambda x: x.sum(),
            ("batch",),
            r"out_axes is \('batch',\), longer than the rank of the block of shape \(\)",
        ),
        (
            lambda x: (x, x),
            (("batch", None), ("batch", None, None)),
            r"out_axes\[1\] is \('batch', None, None\), longer than the rank",
        ),
        (
            lambda x: x,
            P("fsdp", None, None),
            r"out_axes is P\('fsdp', None, None\), longer than the rank of the block of shape "
            r"\(2, 6\)",
        ),
        (
            lambda x: x,
            [("batch", None), (None, None)],
            r"out_axes is \[\('batch', None\), \(None, None\)\], whose structure does not match "
            r"the output's \(PyTreeDef\(\*\)\); give one tuple of logical names per array",
        ),
        (
            lambda x: {"a": x},
            {"b": ("batch", None)},
            r"out_axes is \{'b': \('batch', None\)\}, whose structure does not match the "
            r"output's \(PyTreeDef\(\{'a': \*\}\)\)",
        ),
        (
            lambda x: (x, x),
            (("batch", None),),
            r"out_axes is \(\('batch', None\),\), whose structure does not match the output's "
            r"\(PyTreeDef\(\(\*, \*\)\)\)",
        ),
        (
            lambda x: (x, x),
            [("batch", None), ("batch", None)],
            r"out_axes is \[.*\], whose structure does not match the output's "
            r"\(PyTreeDef\(\(\*, \*\)\)\)",
        ),
        (
            lambda x: x,
            (None, None),
            rf"out_axes \(None, None\) resolve to P\(None, None\) {MESH_TEXT}, which the "
            r"body's outputs do not fit: an output left unsplit over a mesh axis must be the "
            r"same on every device of that axis\. Split the output over those axes in "
            r"out_axes .* JAX says: out_specs is P\(None, None\)",
        ),
    ],
    ids=[
        "rank",
        "rank-scalar",
        "rank-in-a-tuple",
        "rank-spec",
        "list-for-one",
        "other-keys",
        "too-few",
        "list-for-tuple",
        "varying-unsplit",
    ],
)
def test_out_axes_mistakes_raise_a_library_error_naming_out_axes(mesh, body, out_axes, message):
    f = logical_shard_map(body, in_axes=[("batch", None)], out_axes=out_axes, mesh=mesh)
    with pytest.raises(fe.EscaleError, match=r"logical_shard_map\('<lambda>'\): " + message):
        jax.jit(f)(jnp.ones((8, 6)))


def test_out_axes_with_an_unknown_name_warn_then_say_what_the_output_needs(mesh):
    f = logical_shard_map(
        lambda x: x, in_axes=[("batch", None)], out_axes=("batchh", None), mesh=mesh
    )
    with (
        pytest.warns(
            fe.ShardingCorrectionWarning, match=r"(?s)parameter 'out_axes'.*'batchh' has no"
        ),
        pytest.raises(fe.EscaleError, match=r"out_axes \('batchh', None\) resolve to P\(None"),
    ):
        f(jnp.ones((8, 6)))
    strict = logical_shard_map(
        lambda x: x, in_axes=[("batch", None)], out_axes=("batchh", None), mesh=mesh, strict=True
    )
    with pytest.raises(
        fe.ShardingResolutionError, match=r"(?s)parameter 'out_axes'.*'batchh' has no rule"
    ):
        strict(jnp.ones((8, 6)))


@pytest.mark.parametrize(
    ("in_axes", "out_axes", "args", "error", "message"),
    [
        (
            [("batch", None, None)],
            ("batch", None),
            (jnp.ones((8, 6)),),
            fe.ShardingResolutionError,
            rf"in_axes\[0\] \(an argument of shape \(8, 6\)\) {MESH_TEXT}: logical axes "
            r"\('batch', None, None\) name 3 dimensions but the shape \(8, 6\) has 2: give one",
        ),
        (
            [None, ("batch",)],
            ("batch",),
            (jnp.ones(8), jnp.float32(2.0)),
            fe.ShardingResolutionError,
            r"in_axes\[1\] \(an argument of shape \(\)\) .* name 1 dimensions but the shape \(\)",
        ),
        (
            [("batch", "batch")],
            ("batch", None),
            (jnp.ones((8, 8)),),
            fe.ShardingResolutionError,
            r"in_axes\[0\] \(an argument of shape \(8, 8\)\) .*'batch' names more than one "
            r"dimension",
        ),
        (
            [("batch", None)],
            ("batch", "batch"),
            (jnp.ones((8, 8)),),
            fe.ShardingResolutionError,
            rf"out_axes {MESH_TEXT}: logical axes \('batch', 'batch'\): 'batch' names more",
        ),
        (
            [P("fsdp", None, None)],
            ("batch", None),
            (jnp.ones((8, 6)),),
            fe.EscaleError,
            r"in_axes\[0\]: P\('fsdp', None, None\) on mesh .* has 3 entries for the 2 "
            r"dimensions of shape \(8, 6\)",
        ),
        (
            [P("fsdp")],
            P("fsdp"),
            (jnp.ones((6, 6)),),
            fe.EscaleError,
            r"in_axes\[0\]: P\('fsdp',\) on mesh .* splits dimension 0 of shape \(6, 6\) into 4 "
            r"parts, which do not divide it",
        ),
        (
            [("batch", None)],
            P("model"),
            (jnp.ones((8, 6)),),
            fe.EscaleError,
            r"out_axes P\('model',\) names mesh axis 'model', which is not in the mesh",
        ),
        (
            [("batch", None)],
            ("batch", 3),
            (jnp.ones((8, 6)),),
            fe.EscaleTypeError,
            r"out_axes is tuple \('batch', 3\); each array takes a tuple of logical names",
        ),
        (
            [{"a": ("batch",)}],
            ("batch",),
            ({"a": "text"},),
            fe.EscaleTypeError,
            r"args\[0\]\['a'\] is str 'text'; the mapped function takes arrays",
        ),
    ],
    ids=[
        "in-rank",
        "in-scalar",
        "in-name-twice",
        "out-name-twice",
        "in-spec-rank",
        "in-spec-indivisible",
        "out-spec-axis",
        "out-not-a-name",
        "not-an-array",
    ],
)
def test_in_and_out_axes_mistakes_name_the_entry(mesh, in_axes, out_axes, args, error, message):
    f = logical_shard_map(lambda *a: a[-1], in_axes=in_axes, out_axes=out_axes, mesh=mesh)
    with pytest.raises(error, match=r"logical_shard_map\('<lambda>'\): " + message):
        f(*args)


def test_f_and_check_vma_are_checked(mesh):
    with pytest.raises(fe.EscaleTypeError, match=r"f must be a function, got int 3"):
        logical_shard_map(3, in_axes=[("batch",)], out_axes=("batch",), mesh=mesh)
    with pytest.raises(fe.EscaleTypeError, match=r"check_vma must be True or False, got str"):
        logical_shard_map(
            lambda x: x, in_axes=[("batch",)], out_axes=("batch",), mesh=mesh, check_vma="no"
        )


def test_an_abstract_mesh_needs_its_concrete_mesh_set_around_the_call(mesh):
    # XLA:CPU would fail at run time ("no registered implementation ... GlobalToLocalShape").
    f = logical_shard_map(
        lambda x: x * 2,
        in_axes=[("batch", None)],
        out_axes=("batch", None),
        mesh=mesh.abstract_mesh,
    )
    x = jnp.arange(48.0).reshape(8, 6)
    with pytest.raises(
        fe.EscaleTypeError, match=r"mesh is an AbstractMesh .* no mesh of that shape is set"
    ):
        jax.jit(f)(x)
    with jax.set_mesh(mesh):
        out = jax.jit(f)(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)


@pytest.mark.parametrize("axis_types", AXIS_TYPES)
def test_a_constant_closed_over_under_the_current_mesh_is_an_argument_like_any(axis_types):
    # Inside jax.jit under jax.set_mesh the mesh is abstract, and an array the jitted function
    # closes over is concrete: it is staged into the program, not refused as outside jit.
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=axis_types)
    constant = jnp.arange(8.0).reshape(8, 1) * jnp.ones((8, 6))
    f = logical_shard_map(
        lambda x, c: x + c,
        in_axes=[("batch", "hidden_state"), ("batch", "hidden_state")],
        out_axes=("batch", "hidden_state"),
    )
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: f(x, constant))(jnp.ones((8, 6)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(constant) + 1)
