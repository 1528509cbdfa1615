import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import (
    EscaleError,
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingPlan,
    ShardingResolutionError,
    create_mesh,
    resolve_logical_axes,
)
from flax_escale.plan import Annotation, PlanEntry, UnknownPathError
from flax_escale.plan._plan import build_plan
from flax_escale.resolve import Correction, fit_mesh_axes

HM = ("hidden_state", "mlp_intermediate")
MESH_SHAPE = "{'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1}"


@pytest.fixture
def mesh2(devices):
    return create_mesh((2, 4), ("dp", "tp"))


def _path(keys):
    return "/".join(str(k.key) for k in keys)


def _plan(mesh, tree, annotations, **kwargs):
    """Plans ``tree`` (nested dicts of ShapeDtypeStruct); ``annotations`` maps paths."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    items = [(_path(keys), leaf, annotations.get(_path(keys))) for keys, leaf in flat]
    return build_plan(treedef, items, mesh, **kwargs)


def _sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _quiet_plan(mesh, tree, annotations, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return _plan(mesh, tree, annotations, **kwargs)


# Logical annotations.


@pytest.mark.parametrize(
    ("names", "shape", "expected", "dropped"),
    [
        (HM, (8, 16), P(("fsdp", "sp"), "tp"), ()),
        (("mlp_intermediate", "hidden_state"), (16, 8), P("tp", ("fsdp", "sp")), ()),
        (("batch", "hidden_state"), (8, 4), P(("fsdp", "dp"), "tp"), ()),
        # batch's only rule does not divide 3: a correction, no longer a silent drop.
        (("batch", "hidden_state"), (3, 6), P(None, "tp"), (0,)),
        (("vocab", "hidden_state"), (7, 8), P(None, "tp"), (0,)),
        ((None, "hidden_state"), (5, 6), P(None, "tp"), ()),
        (
            ("layers", "hidden_state", "mlp_intermediate"),
            (2, 8, 4),
            P(None, ("fsdp", "sp"), "tp"),
            (),
        ),
    ],
)
def test_logical_annotations_resolve_like_resolve_logical_axes(
    mesh, names, shape, expected, dropped
):
    annotations = {"w": Annotation(logical_axes=names)}
    if dropped:
        with pytest.warns(ShardingCorrectionWarning, match="is not divisible by the mesh axes"):
            plan = _plan(mesh, {"w": _sds(shape)}, annotations)
    else:
        plan = _quiet_plan(mesh, {"w": _sds(shape)}, annotations)
    entry = plan["w"]
    assert entry.spec == expected
    assert entry.resolution == resolve_logical_axes(names, shape=shape, mesh=mesh)
    assert tuple(c.dim for _, c in plan.corrections) == dropped
    assert plan.unannotated == ()


def test_passed_over_rules_are_recorded_without_a_warning(devices):
    mesh = create_mesh((1, 2, 1, 4, 1))
    names = (None, "hidden_state")
    plan = _quiet_plan(mesh, {"x": _sds((3, 6))}, {"x": Annotation(logical_axes=names)})
    assert plan["x"].spec == P(None, ("fsdp", "sp"))
    passed = plan["x"].resolution.passed_over
    assert [(p.dim, p.logical_name, p.mesh_axes, p.size) for p in passed] == [
        (1, "hidden_state", ("tp",), 6),
    ]
    assert plan.corrections == ()
    assert "dim 1: ('tp',) passed over (6 not divisible)" in plan.describe()


def test_plan_rules_are_used(mesh):
    rules = [("hidden_state", "fsdp"), ("mlp_intermediate", ("tp", "sp"))]
    plan = _quiet_plan(mesh, {"w": _sds((8, 16))}, {"w": Annotation(logical_axes=HM)}, rules=rules)
    assert plan["w"].spec == P("fsdp", ("tp", "sp"))


def test_plan_rules_may_be_a_partition_axis(mesh):
    paxis = PartitionAxis(hidden_state_axis="fsdp")
    plan = _quiet_plan(mesh, {"w": _sds((8, 16))}, {"w": Annotation(logical_axes=HM)}, rules=paxis)
    assert plan["w"].spec == resolve_logical_axes(HM, paxis, shape=(8, 16), mesh=mesh).spec
    assert plan["w"].spec == P("fsdp", "tp")


def test_annotation_rules_win_over_plan_rules(mesh):
    plan_rules = [("hidden_state", "fsdp"), ("mlp_intermediate", "tp")]
    own_rules = (("hidden_state", "tp"), ("mlp_intermediate", "fsdp"))
    tree = {"own": _sds((8, 16)), "plan": _sds((8, 16))}
    annotations = {
        "own": Annotation(logical_axes=HM, rules=own_rules),
        "plan": Annotation(logical_axes=HM),
    }
    plan = _quiet_plan(mesh, tree, annotations, rules=plan_rules)
    assert plan["own"].spec == P("tp", "fsdp")
    assert plan["plan"].spec == P("fsdp", "tp")


def test_repeated_logical_name_always_raises(mesh):
    annotations = {"w": Annotation(logical_axes=("hidden_state", "hidden_state"))}
    with pytest.raises(ShardingResolutionError, match=r"parameter 'w': .*'hidden_state' names"):
        _plan(mesh, {"w": _sds((8, 8))}, annotations)


def test_rank_mismatch_always_raises(mesh):
    annotations = {"w": Annotation(logical_axes=HM)}
    with pytest.raises(ShardingResolutionError, match=r"parameter 'w': .*shape \(8,\) has 1"):
        _plan(mesh, {"w": _sds((8,))}, annotations)


# Mesh-axes annotations.


def test_mesh_axes_annotation_fits_and_records_the_correction(mesh2):
    tree = {"ok": _sds((8, 8)), "bad": _sds((8, 6))}
    annotations = {
        "ok": Annotation(mesh_axes=("dp", "tp"), source="with_partitioning"),
        "bad": Annotation(mesh_axes=("dp", "tp")),
    }
    with pytest.warns(ShardingCorrectionWarning):
        plan = _plan(mesh2, tree, annotations)
    assert plan["ok"].spec == P("dp", "tp")
    assert plan["bad"].spec == P("dp", None)
    assert plan["bad"].resolution.rules_spec == P("dp", "tp")
    assert plan["bad"].resolution.logical_axes is None
    assert plan.corrections == (
        (
            "bad",
            Correction(
                "not_divisible", 1, ("tp",), 6, "size 6 is not divisible by ('tp',) of total size 4"
            ),
        ),
    )
    assert plan["ok"].annotation.source == "with_partitioning"


def test_mesh_axes_not_in_mesh_and_reused(mesh2):
    tree = {"missing": _sds((8, 8)), "reused": _sds((8, 8)), "long": _sds((8,))}
    annotations = {
        "missing": Annotation(mesh_axes=("fsdp", "tp")),
        "reused": Annotation(mesh_axes=("tp", "tp")),
        "long": Annotation(mesh_axes=("dp", "tp")),
    }
    with pytest.warns(ShardingCorrectionWarning):
        plan = _plan(mesh2, tree, annotations)
    assert plan["missing"].spec == P(None, "tp")
    assert plan["reused"].spec == P("tp", None)
    assert plan["long"].spec == P("dp")
    kinds = [(path, c.kind, c.dim, c.mesh_axes) for path, c in plan.corrections]
    # In tree-flattening order (sorted dict keys).
    assert kinds == [
        ("long", "truncated", 1, ("tp",)),
        ("missing", "not_in_mesh", 0, ("fsdp",)),
        ("reused", "reused", 1, ("tp",)),
    ]


def test_mesh_axes_win_over_logical_axes_in_one_annotation(mesh2):
    annotation = Annotation(logical_axes=("hidden_state", None), mesh_axes=(None, "dp"))
    plan = _quiet_plan(mesh2, {"w": _sds((8, 8))}, {"w": annotation})
    assert plan["w"].spec == P(None, "dp")


# Unannotated arrays, structure and lookup.


def test_unannotated_arrays_are_replicated_and_listed(mesh):
    tree = {
        "dense": {"kernel": _sds((8, 16)), "bias": _sds((16,))},
        "norm": {"scale": _sds((8,))},
        "step": _sds((), jnp.int32),
    }
    plan = _quiet_plan(mesh, tree, {"dense/kernel": Annotation(logical_axes=HM)})
    # Dicts flatten in sorted key order.
    assert [e.path for e in plan] == ["dense/bias", "dense/kernel", "norm/scale", "step"]
    assert len(plan) == 4
    assert plan.unannotated == ("dense/bias", "norm/scale", "step")
    assert plan["dense/bias"].spec == P(None)
    assert plan["norm/scale"].spec == P(None)
    assert plan["step"].spec == P()
    assert plan["dense/bias"].annotation is None
    assert plan.corrections == ()


def test_specs_and_shardings_have_the_tree_structure(mesh):
    tree = {
        "dense": {"kernel": _sds((8, 16)), "bias": _sds((16,))},
        "embed": _sds((32, 8)),
    }
    annotations = {
        "dense/kernel": Annotation(logical_axes=HM),
        "embed": Annotation(logical_axes=("vocab", "hidden_state")),
    }
    plan = _quiet_plan(mesh, tree, annotations)
    assert isinstance(plan, ShardingPlan)
    assert plan.mesh is mesh
    specs = plan.specs()
    assert specs == {
        "dense": {"kernel": P(("fsdp", "sp"), "tp"), "bias": P(None)},
        "embed": P("tp", ("fsdp", "sp")),
    }
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(tree)
    shardings = plan.shardings()
    assert jax.tree.structure(shardings) == jax.tree.structure(tree)
    assert shardings["dense"]["kernel"] == NamedSharding(mesh, P(("fsdp", "sp"), "tp"))
    assert shardings["dense"]["bias"] == NamedSharding(mesh, P(None))
    assert shardings["embed"] == NamedSharding(mesh, P("tp", ("fsdp", "sp")))
    assert all(s.mesh is mesh for s in jax.tree.leaves(shardings))


def test_shardings_place_arrays_as_planned(mesh):
    tree = {"w": _sds((8, 16)), "b": _sds((16,))}
    plan = _quiet_plan(mesh, tree, {"w": Annotation(logical_axes=HM)})
    values = {"w": jnp.arange(128.0).reshape(8, 16), "b": jnp.arange(16.0)}
    placed = jax.device_put(values, plan.shardings())
    assert placed["w"].addressable_shards[0].data.shape == (2, 8)
    assert placed["b"].addressable_shards[0].data.shape == (16,)
    np.testing.assert_array_equal(np.asarray(placed["w"]), np.asarray(values["w"]))


def test_getitem_returns_the_entry(mesh):
    tree = {"a": {"b": _sds((8, 16), jnp.bfloat16)}}
    annotation = Annotation(logical_axes=HM, source="pattern 'b'")
    plan = _quiet_plan(mesh, tree, {"a/b": annotation})
    entry = plan["a/b"]
    assert isinstance(entry, PlanEntry)
    assert entry.path == "a/b"
    assert entry.shape == (8, 16)
    assert entry.dtype == np.dtype(jnp.bfloat16)
    assert entry.annotation is annotation


def test_getitem_unknown_path_raises_key_error(mesh):
    plan = _quiet_plan(mesh, {"a": _sds((4,)), "b": _sds((4,))}, {})
    with pytest.raises(
        UnknownPathError,
        match=r"^ShardingPlan\[path\]: no array at path 'c'; the plan has \['a', 'b'\]$",
    ) as caught:
        plan["c"]
    # Both the library's error and the KeyError a mapping raises, with a readable message.
    assert isinstance(caught.value, fe.EscaleError)
    assert isinstance(caught.value, KeyError)
    assert str(caught.value).startswith("ShardingPlan[path]: no array")
    with pytest.raises(UnknownPathError, match=r"the closest: \['a/kernel'\]"):
        _quiet_plan(mesh, {"a": {"kernel": _sds((4,))}}, {})["a/kernal"]


def test_in_get_iteration_and_len_agree_with_getitem(mesh):
    plan = _quiet_plan(mesh, {"a": {"kernel": _sds((4,))}, "b": _sds((4,))}, {})
    assert "a/kernel" in plan
    assert "b" in plan
    assert "a" not in plan
    assert "a/kernal" not in plan
    assert 3 not in plan
    assert [e.path for e in plan] == ["a/kernel", "b"]
    assert len(plan) == 2
    for entry in plan:  # what iteration gives is in the plan too, and found at its path
        assert entry in plan
        assert entry.path in plan
        assert plan[entry.path] is entry
        assert plan.get(entry.path) is entry
    assert plan.get("c") is None
    assert plan.get("c", "none") == "none"
    with pytest.raises(fe.EscaleTypeError, match=r"ShardingPlan\[path\] must be an array's path"):
        plan[0]
    with pytest.raises(fe.EscaleTypeError, match=r"ShardingPlan\.get: path must be .* got int 0"):
        plan.get(0)


def test_nbytes_per_device_on_a_mesh_without_the_plan_axes(mesh):
    plan = _quiet_plan(mesh, {"w": _sds((8, 16))}, {"w": Annotation(logical_axes=HM)})
    entry = plan["w"]
    assert entry.spec != P()
    other = fe.create_mesh((8,), ("data",))
    with pytest.raises(fe.EscaleError, match=r"'w' has the spec .* names axes the mesh \(data=8\)"):
        entry.nbytes_per_device(other)
    with pytest.raises(fe.EscaleTypeError, match=r"nbytes_per_device: mesh must be a jax"):
        entry.nbytes_per_device("fsdp:4")


# Sizes.


def test_nbytes_exact(mesh):
    tree = {
        "w": _sds((8, 16)),  # float32, fsdp*tp = 8 ways
        "b": _sds((6,), jnp.bfloat16),  # unannotated: replicated
        "c": _sds((8, 6)),  # mesh axes (fsdp, tp)
        "d": _sds((8, 4), jnp.int8),  # fsdp only
    }
    annotations = {
        "w": Annotation(logical_axes=HM),
        "c": Annotation(mesh_axes=("fsdp", "tp")),
        "d": Annotation(mesh_axes=("fsdp", None)),
    }
    plan = _quiet_plan(mesh, tree, annotations)
    assert plan["w"].nbytes == 512
    assert plan["w"].nbytes_per_device(mesh) == 64
    assert plan["b"].nbytes == 12
    assert plan["b"].nbytes_per_device(mesh) == 12
    assert plan["c"].nbytes == 192
    assert plan["c"].nbytes_per_device(mesh) == 24
    assert plan["d"].nbytes == 32
    assert plan["d"].nbytes_per_device(mesh) == 8
    assert plan.nbytes == 512 + 12 + 192 + 32
    assert plan.nbytes_per_device == 64 + 12 + 24 + 8


def test_nbytes_per_device_ignores_dropped_axes(mesh2):
    with pytest.warns(ShardingCorrectionWarning):
        plan = _plan(mesh2, {"w": _sds((8, 6))}, {"w": Annotation(mesh_axes=("dp", "tp"))})
    assert plan.nbytes == 192
    assert plan.nbytes_per_device == 96


def test_nbytes_per_device_matches_placed_shards(mesh):
    plan = _quiet_plan(mesh, {"w": _sds((8, 16))}, {"w": Annotation(logical_axes=HM)})
    placed = jax.device_put(jnp.zeros((8, 16)), plan.shardings()["w"])
    assert placed.addressable_shards[0].data.nbytes == plan.nbytes_per_device


# describe().


def test_describe_lists_every_array_and_a_footer(mesh):
    tree = {
        "w": _sds((8, 16)),
        "b": _sds((6,), jnp.bfloat16),
        "c": _sds((8, 6)),
    }
    annotations = {"w": Annotation(logical_axes=HM), "c": Annotation(mesh_axes=("fsdp", "tp"))}
    plan = _quiet_plan(mesh, tree, annotations)
    text = plan.describe()
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "logical", "axes", "spec", "notes"]
    assert len(lines) == 5
    assert lines[1].startswith("b ")
    assert "(6,)" in lines[1]
    assert " - " in lines[1]
    assert str(P(None)) in lines[1]
    assert lines[2].startswith("c ")
    assert "('fsdp', 'tp')" in lines[2]
    assert str(P("fsdp", "tp")) in lines[2]
    assert lines[3].startswith("w ")
    assert "('hidden_state', 'mlp_intermediate')" in lines[3]
    assert str(P(("fsdp", "sp"), "tp")) in lines[3]
    assert lines[4] == (
        "3 arrays on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1): 716 B in all, 100 B per device; "
        "0 corrections, 1 unannotated"
    )
    # The columns are aligned: every spec starts at the same offset.
    spec_start = str(P()).split("(")[0] + "("
    assert len({line.index(spec_start) for line in lines[1:4]}) == 1


def test_describe_notes_corrections_and_unknown_names(mesh):
    tree = {"a": _sds((6, 8)), "b": _sds((8,)), "big": _sds((1024, 1024))}
    annotations = {
        "a": Annotation(mesh_axes=("fsdp", "tp")),
        "b": Annotation(logical_axes=("mystery",)),
    }
    with pytest.warns(ShardingCorrectionWarning):
        plan = _plan(mesh, tree, annotations, notes=["pattern 'zz' matched nothing"])
    text = plan.describe()
    assert "dim 0: size 6 is not divisible by ('fsdp',) of total size 4" in text
    assert "no rule for 'mystery'" in text
    lines = text.splitlines()
    assert lines[-2] == (
        "3 arrays on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1): 4.00 MiB in all, 2.00 MiB per device; "
        "1 corrections, 1 idle axes put to use, 1 unannotated"
    )
    assert lines[-1] == "pattern 'zz' matched nothing"
    assert plan.notes == ("pattern 'zz' matched nothing",)


# Warnings and strict mode.


def test_non_strict_problems_emit_exactly_one_warning(mesh):
    tree = {"a": _sds((6, 8)), "b": _sds((8,)), "c": _sds((8, 16))}
    annotations = {
        "a": Annotation(mesh_axes=("fsdp", "tp")),
        "b": Annotation(logical_axes=("mystery",)),
        "c": Annotation(logical_axes=HM),
    }
    with pytest.warns(ShardingCorrectionWarning) as record:
        plan = _plan(mesh, tree, annotations)
    assert len(record) == 1
    message = str(record[0].message)
    assert f"parameter 'a': mesh axes {P('fsdp', 'tp')} with shape (6, 8)" in message
    assert "parameter 'b': logical axes ('mystery',) with shape (8,)" in message
    assert "logical name 'mystery' has no rule" in message
    assert "parameter 'c'" not in message
    assert message.endswith("(Pass strict=True to make these errors.)")
    assert plan["a"].spec == P(None, "tp")
    assert plan["b"].spec == P(None)
    assert plan["c"].spec == P(("fsdp", "sp"), "tp")


def test_no_warning_when_everything_fits(mesh):
    tree = {"w": _sds((8, 16)), "b": _sds((3,))}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _plan(mesh, tree, {"w": Annotation(logical_axes=HM)})
    assert [w for w in record if issubclass(w.category, ShardingCorrectionWarning)] == []


def test_strict_raises_naming_path_shape_and_mesh(mesh):
    tree = {"good": _sds((8, 16)), "layer/kernel": _sds((6, 8))}
    annotations = {
        "good": Annotation(logical_axes=HM),
        "layer/kernel": Annotation(mesh_axes=("fsdp", "tp")),
    }
    with pytest.raises(ShardingResolutionError) as info:
        _plan(mesh, tree, annotations, strict=True)
    message = str(info.value)
    assert "parameter 'layer/kernel'" in message
    assert "shape (6, 8)" in message
    assert f"on mesh {MESH_SHAPE}" in message
    assert "size 6 is not divisible by ('fsdp',)" in message
    assert message.endswith("(strict=True; pass strict=False to correct instead.)")


def test_strict_raises_on_an_unknown_logical_name(mesh):
    annotations = {"emb": Annotation(logical_axes=("mystery", "hidden_state"))}
    with pytest.raises(ShardingResolutionError) as info:
        _plan(mesh, {"emb": _sds((8, 8))}, annotations, strict=True)
    message = str(info.value)
    assert "parameter 'emb': logical axes ('mystery', 'hidden_state') with shape (8, 8)" in message
    assert f"on mesh {MESH_SHAPE}" in message
    assert "logical name 'mystery' has no rule" in message


def test_strict_passes_when_everything_fits(mesh):
    tree = {"w": _sds((8, 16)), "b": _sds((5,))}
    plan = _quiet_plan(mesh, tree, {"w": Annotation(logical_axes=HM)}, strict=True)
    assert plan["w"].spec == P(("fsdp", "sp"), "tp")
    assert plan.unannotated == ("b",)


def test_notes_warn(mesh):
    notes = ["pattern 'a' matched nothing", "pattern 'b' matched nothing"]
    with pytest.warns(ShardingCorrectionWarning) as record:
        plan = _plan(mesh, {"w": _sds((8, 16))}, {"w": Annotation(logical_axes=HM)}, notes=notes)
    assert len(record) == 1
    assert str(record[0].message) == (
        "pattern 'a' matched nothing\npattern 'b' matched nothing\n"
        "(Pass strict=True to make these errors.)"
    )
    assert plan.notes == tuple(notes)
    assert plan["w"].spec == P(("fsdp", "sp"), "tp")


def test_notes_raise_in_strict_mode(mesh):
    with pytest.raises(EscaleError) as info:
        _plan(mesh, {"w": _sds((8, 16))}, {}, strict=True, notes=["pattern 'a' matched nothing"])
    assert type(info.value) is EscaleError
    assert str(info.value) == (
        "pattern 'a' matched nothing\n(strict=True; pass strict=False to go on.)"
    )


def test_notes_and_problems_share_one_warning(mesh2):
    with pytest.warns(ShardingCorrectionWarning) as record:
        _plan(
            mesh2,
            {"w": _sds((8, 6))},
            {"w": Annotation(mesh_axes=("dp", "tp"))},
            notes=["a note"],
        )
    assert len(record) == 1
    message = str(record[0].message)
    assert message.index("parameter 'w'") < message.index("a note")


# fit_mesh_axes.


@pytest.mark.parametrize(
    ("spec", "shape", "expected", "kinds"),
    [
        (("dp", "tp"), (8, 8), P("dp", "tp"), []),
        (("dp", "tp"), (8, 6), P("dp", None), [("not_divisible", 1)]),
        ((("dp", "tp"),), (16, 3), P(("dp", "tp"), None), []),
        ((("dp", "tp"),), (12,), P(None), [("not_divisible", 0)]),
        (("tp", "tp"), (8, 8), P("tp", None), [("reused", 1)]),
        (("fsdp", None), (8, 8), P(None, None), [("not_in_mesh", 0)]),
        (("dp", None, "tp"), (8, 8), P("dp", None), [("truncated", 2)]),
        ((None,), (8, 8), P(None, None), []),
        ((), (), P(), []),
    ],
)
def test_fit_mesh_axes(mesh2, spec, shape, expected, kinds):
    r = fit_mesh_axes(spec, shape=shape, mesh=mesh2)
    assert r.spec == expected
    assert r.rules_spec == P(*spec)
    assert r.shape == shape
    assert r.mesh_shape == (("dp", 2), ("tp", 4))
    assert r.logical_axes is None
    assert [(c.kind, c.dim) for c in r.corrections] == kinds
    assert r.ok is (not kinds)


def test_fit_mesh_axes_accepts_an_abstract_mesh(mesh2):
    r = fit_mesh_axes(("dp", "tp"), shape=(8, 6), mesh=mesh2.abstract_mesh)
    assert r.spec == P("dp", None)


def test_fit_mesh_axes_strict_message(mesh2):
    with pytest.raises(ShardingResolutionError) as info:
        fit_mesh_axes(("dp", "tp"), shape=(8, 6), mesh=mesh2, strict=True, path="dense/kernel")
    message = str(info.value)
    assert message.startswith(
        f"parameter 'dense/kernel': mesh axes {P('dp', 'tp')} with shape (8, 6) on mesh "
        f"{{'dp': 2, 'tp': 4}} resolve to {P('dp', 'tp')}, corrected to {P('dp', None)}:"
    )
    assert "dimension 1: size 6 is not divisible by ('tp',) of total size 4" in message
    assert "dropped ('tp',)" in message
    assert message.endswith("(strict=True; pass strict=False to correct instead.)")


def test_fit_mesh_axes_strict_without_path(mesh2):
    expected = "^" + re.escape(f"mesh axes {P('fsdp')} with shape")
    with pytest.raises(ShardingResolutionError, match=expected):
        fit_mesh_axes(("fsdp",), shape=(8,), mesh=mesh2, strict=True)


def test_fit_mesh_axes_strict_passes_a_valid_spec(mesh2):
    r = fit_mesh_axes((None, ("dp", "tp")), shape=(3, 16), mesh=mesh2, strict=True)
    assert r.spec == P(None, ("dp", "tp"))
    assert r.corrections == ()


def test_describe_shows_empty_logical_axes_of_an_annotated_scalar(mesh):
    plan = _quiet_plan(mesh, {"s": _sds(())}, {"s": Annotation(logical_axes=())})
    assert plan.unannotated == ()
    row = plan.describe().splitlines()[1]
    assert row.split()[:4] == ["s", "()", "()", str(P())]
