"""``build_plan`` (``flax_escale/plan/_build.py``): every annotation resolved, warned or raised."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from support.built_plans import HM, plan_of, quiet_plan, sds
from support.mistakes import MISTAKE, T, X, case, mesh5, raises_a_library_error

import flax_escale as fe
from flax_escale import (
    EscaleError,
    PartitionAxis,
    ShardingCorrectionWarning,
    ShardingResolutionError,
    create_mesh,
    resolve_logical_axes,
)
from flax_escale import plan as fep
from flax_escale.plan import Annotation
from flax_escale.resolve import Correction

MESH_SHAPE = "{'dp': 1, 'fsdp': 4, 'ep': 1, 'tp': 2, 'sp': 1}"


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
            plan = plan_of(mesh, {"w": sds(shape)}, annotations)
    else:
        plan = quiet_plan(mesh, {"w": sds(shape)}, annotations)
    entry = plan["w"]
    assert entry.spec == expected
    assert entry.resolution == resolve_logical_axes(names, shape=shape, mesh=mesh)
    assert tuple(c.dim for _, c in plan.corrections) == dropped
    assert plan.unannotated == ()


def test_passed_over_rules_are_recorded_without_a_warning(devices):
    mesh = create_mesh((1, 2, 1, 4, 1))
    names = (None, "hidden_state")
    plan = quiet_plan(mesh, {"x": sds((3, 6))}, {"x": Annotation(logical_axes=names)})
    assert plan["x"].spec == P(None, ("fsdp", "sp"))
    passed = plan["x"].resolution.passed_over
    assert [(p.dim, p.logical_name, p.mesh_axes, p.size) for p in passed] == [
        (1, "hidden_state", ("tp",), 6),
    ]
    assert plan.corrections == ()
    assert "dim 1: ('tp',) passed over (6 not divisible)" in plan.describe()


def test_plan_rules_are_used(mesh):
    rules = [("hidden_state", "fsdp"), ("mlp_intermediate", ("tp", "sp"))]
    plan = quiet_plan(mesh, {"w": sds((8, 16))}, {"w": Annotation(logical_axes=HM)}, rules=rules)
    assert plan["w"].spec == P("fsdp", ("tp", "sp"))


def test_plan_rules_may_be_a_partition_axis(mesh):
    paxis = PartitionAxis(hidden_state_axis="fsdp")
    plan = quiet_plan(mesh, {"w": sds((8, 16))}, {"w": Annotation(logical_axes=HM)}, rules=paxis)
    assert plan["w"].spec == resolve_logical_axes(HM, paxis, shape=(8, 16), mesh=mesh).spec
    assert plan["w"].spec == P("fsdp", "tp")


def test_annotation_rules_win_over_plan_rules(mesh):
    plan_rules = [("hidden_state", "fsdp"), ("mlp_intermediate", "tp")]
    own_rules = (("hidden_state", "tp"), ("mlp_intermediate", "fsdp"))
    tree = {"own": sds((8, 16)), "plan": sds((8, 16))}
    annotations = {
        "own": Annotation(logical_axes=HM, rules=own_rules),
        "plan": Annotation(logical_axes=HM),
    }
    plan = quiet_plan(mesh, tree, annotations, rules=plan_rules)
    assert plan["own"].spec == P("tp", "fsdp")
    assert plan["plan"].spec == P("fsdp", "tp")


def test_repeated_logical_name_always_raises(mesh):
    annotations = {"w": Annotation(logical_axes=("hidden_state", "hidden_state"))}
    with pytest.raises(ShardingResolutionError, match=r"parameter 'w': .*'hidden_state' names"):
        plan_of(mesh, {"w": sds((8, 8))}, annotations)


def test_rank_mismatch_always_raises(mesh):
    annotations = {"w": Annotation(logical_axes=HM)}
    with pytest.raises(ShardingResolutionError, match=r"parameter 'w': .*shape \(8,\) has 1"):
        plan_of(mesh, {"w": sds((8,))}, annotations)


# Mesh-axes annotations.


def test_mesh_axes_annotation_fits_and_records_the_correction(mesh2):
    tree = {"ok": sds((8, 8)), "bad": sds((8, 6))}
    annotations = {
        "ok": Annotation(mesh_axes=("dp", "tp"), source="with_partitioning"),
        "bad": Annotation(mesh_axes=("dp", "tp")),
    }
    with pytest.warns(ShardingCorrectionWarning):
        plan = plan_of(mesh2, tree, annotations)
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
    tree = {"missing": sds((8, 8)), "reused": sds((8, 8)), "long": sds((8,))}
    annotations = {
        "missing": Annotation(mesh_axes=("fsdp", "tp")),
        "reused": Annotation(mesh_axes=("tp", "tp")),
        "long": Annotation(mesh_axes=("dp", "tp")),
    }
    with pytest.warns(ShardingCorrectionWarning):
        plan = plan_of(mesh2, tree, annotations)
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
    plan = quiet_plan(mesh2, {"w": sds((8, 8))}, {"w": annotation})
    assert plan["w"].spec == P(None, "dp")


# Unannotated arrays.


def test_unannotated_arrays_are_replicated_and_listed(mesh):
    tree = {
        "dense": {"kernel": sds((8, 16)), "bias": sds((16,))},
        "norm": {"scale": sds((8,))},
        "step": sds((), jnp.int32),
    }
    plan = quiet_plan(mesh, tree, {"dense/kernel": Annotation(logical_axes=HM)})
    # Dicts flatten in sorted key order.
    assert [e.path for e in plan] == ["dense/bias", "dense/kernel", "norm/scale", "step"]
    assert len(plan) == 4
    assert plan.unannotated == ("dense/bias", "norm/scale", "step")
    assert plan["dense/bias"].spec == P(None)
    assert plan["norm/scale"].spec == P(None)
    assert plan["step"].spec == P()
    assert plan["dense/bias"].annotation is None
    assert plan.corrections == ()


# Warnings and strict mode.


def test_non_strict_problems_emit_exactly_one_warning(mesh):
    tree = {"a": sds((6, 8)), "b": sds((8,)), "c": sds((8, 16))}
    annotations = {
        "a": Annotation(mesh_axes=("fsdp", "tp")),
        "b": Annotation(logical_axes=("mystery",)),
        "c": Annotation(logical_axes=HM),
    }
    with pytest.warns(ShardingCorrectionWarning) as record:
        plan = plan_of(mesh, tree, annotations)
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
    tree = {"w": sds((8, 16)), "b": sds((3,))}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan_of(mesh, tree, {"w": Annotation(logical_axes=HM)})
    assert [w for w in record if issubclass(w.category, ShardingCorrectionWarning)] == []


def test_strict_raises_naming_path_shape_and_mesh(mesh):
    tree = {"good": sds((8, 16)), "layer/kernel": sds((6, 8))}
    annotations = {
        "good": Annotation(logical_axes=HM),
        "layer/kernel": Annotation(mesh_axes=("fsdp", "tp")),
    }
    with pytest.raises(ShardingResolutionError) as info:
        plan_of(mesh, tree, annotations, strict=True)
    message = str(info.value)
    assert "parameter 'layer/kernel'" in message
    assert "shape (6, 8)" in message
    assert f"on mesh {MESH_SHAPE}" in message
    assert "size 6 is not divisible by ('fsdp',)" in message
    assert message.endswith("(strict=True; pass strict=False to correct instead.)")


def test_strict_raises_on_an_unknown_logical_name(mesh):
    annotations = {"emb": Annotation(logical_axes=("mystery", "hidden_state"))}
    with pytest.raises(ShardingResolutionError) as info:
        plan_of(mesh, {"emb": sds((8, 8))}, annotations, strict=True)
    message = str(info.value)
    assert "parameter 'emb': logical axes ('mystery', 'hidden_state') with shape (8, 8)" in message
    assert f"on mesh {MESH_SHAPE}" in message
    assert "logical name 'mystery' has no rule" in message


def test_strict_passes_when_everything_fits(mesh):
    tree = {"w": sds((8, 16)), "b": sds((5,))}
    plan = quiet_plan(mesh, tree, {"w": Annotation(logical_axes=HM)}, strict=True)
    assert plan["w"].spec == P(("fsdp", "sp"), "tp")
    assert plan.unannotated == ("b",)


def test_notes_warn(mesh):
    notes = ["pattern 'a' matched nothing", "pattern 'b' matched nothing"]
    with pytest.warns(ShardingCorrectionWarning) as record:
        plan = plan_of(mesh, {"w": sds((8, 16))}, {"w": Annotation(logical_axes=HM)}, notes=notes)
    assert len(record) == 1
    assert str(record[0].message) == (
        "pattern 'a' matched nothing\npattern 'b' matched nothing\n"
        "(Pass strict=True to make these errors.)"
    )
    assert plan.notes == tuple(notes)
    assert plan["w"].spec == P(("fsdp", "sp"), "tp")


def test_notes_raise_in_strict_mode(mesh):
    with pytest.raises(EscaleError) as info:
        plan_of(mesh, {"w": sds((8, 16))}, {}, strict=True, notes=["pattern 'a' matched nothing"])
    assert type(info.value) is EscaleError
    assert str(info.value) == (
        "pattern 'a' matched nothing\n(strict=True; pass strict=False to go on.)"
    )


def test_notes_and_problems_share_one_warning(mesh2):
    with pytest.warns(ShardingCorrectionWarning) as record:
        plan_of(
            mesh2,
            {"w": sds((8, 6))},
            {"w": Annotation(mesh_axes=("dp", "tp"))},
            notes=["a note"],
        )
    assert len(record) == 1
    message = str(record[0].message)
    assert message.index("parameter 'w'") < message.index("a note")


# Mistakes with build_plan, one case each (what a case asserts: support/mistakes.py).
MISTAKES = [
    case(
        lambda: fep.build_plan(jax.tree.structure({}), [], "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="build_plan-mesh-string",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0}), [("w", X, None)], mesh5(), notes="n"),
        T,
        "notes",
        "'n'",
        r"pass \('n',\)",
        id="build_plan-notes-string",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0}), [("w", "x", None)], mesh5()),
        T,
        "the leaf 'w'",
        "str 'x'",
        r"make it one \(jnp.asarray",
        id="build_plan-item-not-an-array",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0}), {"w": X}, mesh5()),
        T,
        "items",
        "dict",
        r"annotated_leaves\(tree\)\[1\]",
        id="build_plan-items-dict",
    ),
    case(
        lambda: fep.build_plan(jax.tree.structure({"w": 0, "v": 0}), [("w", X, None)], mesh5()),
        T,
        "treedef",
        "PyTreeDef",
        r"the treedef annotated_leaves\(tree\) gives",
        id="build_plan-treedef-of-other-leaves",
    ),
    case(
        lambda: fep.build_plan(
            jax.tree.structure({"w": 0, "v": 0}), [("w", X, None), ("w", X, None)], mesh5()
        ),
        fe.EscaleError,
        "build_plan",
        "'w' 2 times",
        r"give each item its own path",
        id="build_plan-path-twice",
    ),
]


@pytest.mark.parametrize(MISTAKE, MISTAKES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
