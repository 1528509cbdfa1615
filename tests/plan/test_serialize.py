"""``ShardingPlan.to_json`` and ``ShardingPlan.from_json`` (``flax_escale/plan/_serialize.py``)."""

import functools
import json

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from support import example_modules
from support.mlp_plan import Mlp, X, mlp_plan

import flax_escale as fe
from flax_escale.errors import EscaleError, EscaleTypeError


@functools.cache
def _llama_plan():
    # The NNX example with its AdamW state: every kind of entry a real plan holds.
    llama = example_modules.load("nnx_llama")
    model = fe.init_sharded(
        functools.partial(llama.Llama, llama.Config()), fe.create_mesh((1, 4, 1, 2, 1)), 0
    )
    import optax
    from flax import nnx

    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return fe.sharding_report(optimizer, show=False).plan


def test_a_plan_round_trips_through_json_entry_for_entry():
    plan = _llama_plan()
    assert len(plan) > 20
    assert any("opt_state" in e.path for e in plan)
    loaded = fe.ShardingPlan.from_json(plan.to_json())
    assert isinstance(loaded.mesh, AbstractMesh)
    assert dict(loaded.mesh.shape) == dict(plan.mesh.shape)
    assert loaded.rules == plan.rules
    assert loaded.notes == plan.notes
    assert sorted(e.path for e in loaded) == sorted(e.path for e in plan)
    for entry in plan:
        assert loaded[entry.path] == entry, entry.path
    assert loaded.specs() == {e.path: e.spec for e in plan}
    assert not loaded.diff(plan)
    assert not plan.diff(loaded)
    # Reports and explanations read a loaded plan as the plan it came from.
    assert fe.sharding_report(loaded, show=False).bytes_per_device == (
        fe.sharding_report(plan, show=False).bytes_per_device
    )
    path = plan.entries[0].path
    assert loaded.explain(path) == plan.explain(path)


def test_a_plan_with_corrections_and_completions_round_trips():
    rules = [("hidden_state", "fsdp"), ("mlp_intermediate", "expert")]
    plan = mlp_plan(Mlp(width=1024), rules=rules)
    assert plan.corrections
    loaded = fe.ShardingPlan.from_json(plan.to_json(), plan.mesh)
    assert loaded.mesh is plan.mesh
    for entry in plan:
        assert loaded[entry.path] == entry
    assert loaded.shardings()["params/Dense_0/kernel"].spec == plan["params/Dense_0/kernel"].spec


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_loaded_plan_keeps_its_mesh_axis_types(kind):
    # The JSON says which kind of axes the plan was made on: a bare AbstractMesh's default
    # changed with JAX 0.12 (Explicit), and a loaded plan must not change kind with it.
    mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types=kind)
    plan = fe.plan_sharding(Mlp(), mesh, 0, X)
    text = plan.to_json()
    assert f'"axis_types": {json.dumps([kind.capitalize()] * 5)}' in text
    assert fe.ShardingPlan.from_json(text).mesh.axis_types == mesh.axis_types


def test_a_plan_written_without_axis_types_loads_on_auto_axes():
    plan = mlp_plan()
    data = json.loads(plan.to_json())
    del data["axis_types"]
    loaded = fe.ShardingPlan.from_json(json.dumps(data))
    assert loaded.mesh.axis_types == (AxisType.Auto,) * 5
    assert loaded.specs() == {e.path: e.spec for e in plan}


def test_from_json_refuses_what_to_json_did_not_write():
    text = mlp_plan().to_json()
    with pytest.raises(EscaleTypeError, match=r"text must be the JSON string to_json\(\) wrote"):
        fe.ShardingPlan.from_json(b"{}")
    with pytest.raises(EscaleError, match=r"the text is not JSON"):
        fe.ShardingPlan.from_json("{nope")
    with pytest.raises(EscaleError, match=r"format None, expected 'flax_escale.ShardingPlan/1'"):
        fe.ShardingPlan.from_json('{"arrays": []}')
    other = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(EscaleError, match=r"is not the plan's mesh \{'dp': 1, 'fsdp': 4"):
        fe.ShardingPlan.from_json(text, other)
    bad = text.replace('"axis_types": ["Auto", ', '"axis_types": ["Implicit", ', 1)
    with pytest.raises(EscaleError, match=r"'axis_types' is \['Implicit', 'Auto'.*expected one of"):
        fe.ShardingPlan.from_json(bad)
    short = text.replace('"axis_types": ["Auto", ', '"axis_types": [', 1)
    with pytest.raises(EscaleError, match=r"per axis of the mesh \{'dp': 1, 'fsdp': 4"):
        fe.ShardingPlan.from_json(short)


def test_the_json_keeps_one_array_per_line():
    text = mlp_plan().to_json()
    lines = text.splitlines()
    assert len(lines) == 2 + len(mlp_plan())
    assert np.all([ln.strip() for ln in lines])
    assert jax.tree.leaves(fe.ShardingPlan.from_json(text).specs(), is_leaf=lambda x: True)
