"""``ShardingPlan`` (``flax_escale/plan/_plan.py``): lookup, specs and shardings, describe()."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.built_plans import HM, plan_of, quiet_plan, sds

import flax_escale as fe
from flax_escale import ShardingCorrectionWarning, ShardingPlan
from flax_escale.plan import Annotation, PlanEntry, UnknownPathError


def test_specs_and_shardings_have_the_tree_structure(mesh):
    tree = {
        "dense": {"kernel": sds((8, 16)), "bias": sds((16,))},
        "embed": sds((32, 8)),
    }
    annotations = {
        "dense/kernel": Annotation(logical_axes=HM),
        "embed": Annotation(logical_axes=("vocab", "hidden_state")),
    }
    plan = quiet_plan(mesh, tree, annotations)
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
    tree = {"w": sds((8, 16)), "b": sds((16,))}
    plan = quiet_plan(mesh, tree, {"w": Annotation(logical_axes=HM)})
    values = {"w": jnp.arange(128.0).reshape(8, 16), "b": jnp.arange(16.0)}
    placed = jax.device_put(values, plan.shardings())
    assert placed["w"].addressable_shards[0].data.shape == (2, 8)
    assert placed["b"].addressable_shards[0].data.shape == (16,)
    np.testing.assert_array_equal(np.asarray(placed["w"]), np.asarray(values["w"]))


def test_getitem_returns_the_entry(mesh):
    tree = {"a": {"b": sds((8, 16), jnp.bfloat16)}}
    annotation = Annotation(logical_axes=HM, source="pattern 'b'")
    plan = quiet_plan(mesh, tree, {"a/b": annotation})
    entry = plan["a/b"]
    assert isinstance(entry, PlanEntry)
    assert entry.path == "a/b"
    assert entry.shape == (8, 16)
    assert entry.dtype == np.dtype(jnp.bfloat16)
    assert entry.annotation is annotation


def test_getitem_unknown_path_raises_key_error(mesh):
    plan = quiet_plan(mesh, {"a": sds((4,)), "b": sds((4,))}, {})
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
        quiet_plan(mesh, {"a": {"kernel": sds((4,))}}, {})["a/kernal"]


def test_in_get_iteration_and_len_agree_with_getitem(mesh):
    plan = quiet_plan(mesh, {"a": {"kernel": sds((4,))}, "b": sds((4,))}, {})
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


# describe().


def test_describe_lists_every_array_and_a_footer(mesh):
    tree = {
        "w": sds((8, 16)),
        "b": sds((6,), jnp.bfloat16),
        "c": sds((8, 6)),
    }
    annotations = {"w": Annotation(logical_axes=HM), "c": Annotation(mesh_axes=("fsdp", "tp"))}
    plan = quiet_plan(mesh, tree, annotations)
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
    tree = {"a": sds((6, 8)), "b": sds((8,)), "big": sds((1024, 1024))}
    annotations = {
        "a": Annotation(mesh_axes=("fsdp", "tp")),
        "b": Annotation(logical_axes=("mystery",)),
    }
    with pytest.warns(ShardingCorrectionWarning):
        plan = plan_of(mesh, tree, annotations, notes=["pattern 'zz' matched nothing"])
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


def test_describe_shows_empty_logical_axes_of_an_annotated_scalar(mesh):
    plan = quiet_plan(mesh, {"s": sds(())}, {"s": Annotation(logical_axes=())})
    assert plan.unannotated == ()
    row = plan.describe().splitlines()[1]
    assert row.split()[:4] == ["s", "()", "()", str(P())]
