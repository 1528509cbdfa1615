import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from support.mistakes import MISTAKE, T, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe
from flax_escale import linen as fel


@fe.sharded_module({"kernel": ("hidden_state", "mlp_intermediate"), "bias": ("mlp_intermediate",)})
class Up(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(64, 256, rngs=rngs)


def render(report):
    console = Console(file=io.StringIO(), width=200)
    console.print(report.table())
    return console.file.getvalue()


def test_report_of_a_plan_lists_every_array_with_figures():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    plan = fe.plan_sharding(Up, mesh, 0)
    console = Console(file=io.StringIO(), width=200)
    report = fe.sharding_report(plan, console=console)
    text = console.file.getvalue()
    for word in ("wi/kernel", "wi/bias", "(64, 256)", "float32", "mlp_intermediate", "8.00 KiB"):
        assert word in text
    assert "balance 1.00" in text
    assert report.total_bytes == (64 * 256 + 256) * 4
    assert report.max_device_bytes == report.min_device_bytes == 64 * 256 * 4 // 8 + 256 * 4 // 2
    rows = {row["path"]: row for row in report.rows()}
    assert rows["wi/kernel"]["spec"] == P(("fsdp", "sp"), "tp")
    assert rows["wi/kernel"]["logical_axes"] == ("hidden_state", "mlp_intermediate")
    assert rows["wi/kernel"]["bytes_per_device"] == 64 * 256 * 4 // 8
    # (an NNX variable keeps its names in its metadata, which is part of the tree's structure:
    # the pattern that set them is not recorded there)
    assert rows["wi/kernel"]["source"] == "sharded_module"
    assert "annotated by" in text


def test_report_notes_say_briefly_why_a_spec_came_out_so():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    rules = [("embed", "fsdp"), ("embed", "tp"), ("other", "tp")]
    tree = {
        "w": nn.LogicallyPartitioned(jnp.zeros((6, 8)), ("embed", None)),
        "big": nn.LogicallyPartitioned(jnp.zeros((1024, 512)), ("embed", None)),
        "v": nn.LogicallyPartitioned(jnp.zeros((8, 8)), (None, "other")),
    }
    rows = {r["path"]: r for r in fe.sharding_report(tree, mesh, rules=rules, show=False).rows()}
    assert rows["w"]["notes"] == ["('fsdp',) passed over on dim 0 (size 6)"]
    assert rows["w"]["spec"] == P("tp", None)
    assert rows["big"]["notes"] == [
        "idle mesh axis 'tp' put to use on dim 1 (size 512, now split 2 ways)"
    ]
    assert rows["w"]["source"] == "nn.with_logical_partitioning"


def test_report_of_live_models_and_trees():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    model = fe.init_sharded(Up, mesh, 0)
    report = fe.sharding_report(model, show=False)
    assert {r["path"] for r in report.rows()} == {"wi/kernel", "wi/bias"}
    assert report.plan.mesh == mesh

    dense = nn.Dense(
        32,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "vocab")
        ),
    )
    boxed = dense.init(jax.random.key(0), jnp.ones((2, 16)))
    boxed_report = fe.sharding_report(boxed, mesh, show=False)
    assert boxed_report.plan["params/kernel"].spec == P(("fsdp", "sp"), "tp")
    state = fel.init_train_state(
        dense, mesh, jax.random.key(0), jnp.ones((2, 16)), tx=optax.adam(1e-3)
    )
    state_report = fe.sharding_report(state, show=False)
    assert "params/kernel" in {r["path"] for r in state_report.rows()}
    with pytest.raises(fe.NoMeshError, match="pass mesh="):
        fe.sharding_report({"w": np.zeros(4)}, show=False)


def test_report_shows_corrections():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    tree = {"w": nn.LogicallyPartitioned(jnp.zeros((6, 6)), ("hidden_state", "nameless"))}
    report = fe.sharding_report(tree, mesh, show=False)
    assert report.rows()[0]["notes"] == ["no rule for 'nameless'"]
    assert "no rule for 'nameless'" in render(report)


def test_a_plan_is_reported_on_mesh_of_its_shape_and_refused_on_another():
    plan = fe.plan_sharding(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    loaded = fe.ShardingPlan.from_json(plan.to_json())  # on an abstract mesh
    devices = jax.devices()[::-1]  # the same shape on other devices
    reversed_mesh = fe.create_mesh((1, 4, 1, 2, 1), devices=devices)
    report = fe.sharding_report(loaded, mesh=reversed_mesh, show=False)
    assert report.plan.mesh is reversed_mesh  # mesh= is the mesh reported on
    assert report.bytes_per_device == fe.sharding_report(plan, show=False).bytes_per_device
    other = fe.create_mesh((1, 8, 1, 1, 1))
    refused = (
        r"^sharding_report: mesh=\(dp=1, fsdp=8, ep=1, tp=1, sp=1\) is not the plan's mesh "
        r"\(dp=1, fsdp=4, ep=1, tp=2, sp=1\), for which its specs were resolved; plan the model "
        r"on this mesh"
    )
    with pytest.raises(fe.EscaleError, match=refused):
        fe.sharding_report(plan, mesh=other, show=False)
    with pytest.raises(fe.EscaleError, match=refused):
        fe.check_sharded(plan, other)


def test_rules_given_with_a_plan_are_refused_unless_they_are_its_own():
    plan = fe.plan_sharding(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    with pytest.raises(fe.EscaleError, match=r"rules= cannot apply to a ShardingPlan"):
        fe.sharding_report(plan, rules=[("mlp_intermediate", "fsdp")], show=False)
    with pytest.raises(fe.EscaleError, match=r"rules= cannot apply to a ShardingPlan"):
        fe.check_sharded(plan, rules=[("mlp_intermediate", "fsdp")])
    assert fe.sharding_report(plan, rules=plan.rules, show=False).plan is plan


def _on(mesh, spec, shape=(8, 8)):
    return jax.device_put(
        np.arange(np.prod(shape), dtype=np.float32).reshape(shape), NamedSharding(mesh, spec)
    )


def test_arrays_on_two_meshes_are_refused_naming_each_mesh():
    # A serving layout: some weights on all 8 devices, others on a 4-device sub-mesh.
    whole = fe.create_mesh((8,), ("fsdp",))
    half = fe.create_mesh((4,), ("fsdp",), devices=jax.devices()[:4])
    tree = {"a": _on(whole, P("fsdp")), "b": _on(half, P("fsdp")), "c": _on(half, P())}
    message = (
        r"^sharding_report: the arrays live on 2 meshes: 'a' on \(fsdp=8; devices 0-7\), 'b' "
        r"and 1 more on \(fsdp=4; devices 0-3\); a report shows one mesh: report the arrays "
        r"of each mesh apart"
    )
    with pytest.raises(fe.EscaleError, match=message):
        fe.sharding_report(tree, show=False)
    with pytest.raises(fe.EscaleError, match=message):
        fe.check_sharded(tree)
    # Each part on its own mesh reports as it lives.
    part = fe.sharding_report({"b": tree["b"], "c": tree["c"]}, show=False)
    assert part.plan.mesh == half
    assert part.plan["b"].spec == P("fsdp", None)
    each = 8 * 8 * 4 // 4 + 8 * 8 * 4  # a quarter of b, all of c
    assert part.bytes_per_device == dict.fromkeys(range(4), each)


def test_mesh_other_than_where_the_arrays_live_is_refused():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    tree = {"w": _on(mesh, P("fsdp", "tp"))}
    other = fe.create_mesh((1, 8, 1, 1, 1))
    with pytest.raises(
        fe.EscaleError,
        match=r"^sharding_report: mesh=\(dp=1, fsdp=8, ep=1, tp=1, sp=1; devices 0-7\) is not "
        r"where the arrays live: 'w' on \(dp=1, fsdp=4, ep=1, tp=2, sp=1; devices 0-7\); a "
        r"report shows arrays where they are",
    ):
        fe.sharding_report(tree, mesh=other, show=False)
    # Their own mesh, the same mesh made again, or an abstract mesh of its shape are theirs.
    again = fe.create_mesh((1, 4, 1, 2, 1))
    for given in (mesh, again, mesh.abstract_mesh):
        report = fe.sharding_report(tree, mesh=given, show=False)
        assert report.plan["w"].spec == P("fsdp", "tp")
        assert report.max_device_bytes == 8 * 8 * 4 // 8


def test_what_would_go_unused_is_refused():
    plan = fe.plan_sharding(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    console = Console(file=io.StringIO())
    with pytest.raises(fe.EscaleError, match=r"console= is where the table is printed, but show="):
        fe.sharding_report(plan, console=console, show=False)
    with pytest.raises(fe.EscaleError, match=r"baseline= lists what changed .* pass html="):
        fe.sharding_report(plan, show=False, baseline=plan)
    fe.sharding_report(plan, console=console, baseline=plan)  # printed: both used
    assert "0 array(s) differ" in console.file.getvalue()


def test_check_sharded_passes_good_layouts_and_names_offenders():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    good = {
        "w": jax.ShapeDtypeStruct(
            (1024, 1024), np.float32, sharding=NamedSharding(mesh, P("fsdp", "tp"))
        )
    }
    fe.check_sharded(good)
    half = {
        "big": jax.ShapeDtypeStruct(
            (1024, 1024), np.float32, sharding=NamedSharding(mesh, P("fsdp"))
        ),
        "replicated": jax.ShapeDtypeStruct(
            (2048, 1024), np.float32, sharding=NamedSharding(mesh, P())
        ),
        "small": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, P())),
    }
    with pytest.raises(fe.UnshardedParameterError, match=r"2 large array\(s\)") as caught:
        fe.check_sharded(half)
    message = str(caught.value)
    assert message.index("replicated") < message.index("big")  # largest first
    assert "could also use ['tp']" in message
    assert "small" not in message
    fe.check_sharded(half, min_bytes=1 << 30)
    fe.check_sharded({"big": half["big"]}, tolerance=1.0)


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.check_sharded(params(), "dp:8"),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="check_sharded-mesh-string",
    ),
    case(
        lambda: fe.check_sharded("params", mesh_dp_tp()),
        T,
        "tree",
        "'params'",
        r"variables\['params'\]",
        id="check_sharded-string",
    ),
    case(
        lambda: fe.check_sharded(42, mesh_dp_tp()),
        T,
        "tree",
        "int 42",
        "pytree of arrays",
        id="check_sharded-int",
    ),
    case(
        lambda: fe.check_sharded(None, mesh_dp_tp()),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="check_sharded-none",
    ),
    case(
        lambda: fe.check_sharded({"w": "kernel"}, mesh_dp_tp()),
        T,
        "tree",
        "{'w': 'kernel'}",
        "no array leaf",
        id="check_sharded-no-arrays",
    ),
    case(
        lambda: fe.sharding_report("params", mesh_dp_tp(), show=False),
        T,
        "tree",
        "'params'",
        r"variables\['params'\]",
        id="sharding_report-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), min_bytes="1MB"),
        T,
        "min_bytes",
        "'1MB'",
        "int of at least 0",
        id="check_sharded-min_bytes-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), min_bytes=-1),
        fe.EscaleError,
        "min_bytes",
        "-1",
        "int of at least 0",
        id="check_sharded-min_bytes-negative",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), tolerance="0.1"),
        T,
        "tolerance",
        "'0.1'",
        "not a string",
        id="check_sharded-tolerance-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), tolerance=-0.1),
        fe.EscaleError,
        "tolerance",
        "-0.1",
        "at least 0",
        id="check_sharded-tolerance-negative",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), top="5"),
        T,
        "top",
        "'5'",
        "pass the int 5",
        id="check_sharded-top-string",
    ),
    case(
        lambda: fe.check_sharded(params(), mesh_dp_tp(), rules="batch"),
        T,
        "rules",
        "'batch'",
        "pairs",
        id="check_sharded-rules-string",
    ),
    case(
        lambda: fe.sharding_report(params(), mesh_dp_tp(), console="stdout"),
        T,
        "console",
        "'stdout'",
        r"Console\(\)",
        id="sharding_report-console-string",
    ),
    case(
        lambda: fe.sharding_report(params(), mesh_dp_tp(), show="no"),
        T,
        "show",
        "'no'",
        "True or False",
        id="sharding_report-show-string",
    ),
    case(
        lambda: fe.sharding_report(None, mesh_dp_tp(), show=False),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="sharding_report-none",
    ),
    case(
        lambda: fe.sharding_report(params(), "dp:8", show=False),
        T,
        "mesh",
        "'dp:8'",
        "parse_mesh_from_string",
        id="sharding_report-mesh-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
