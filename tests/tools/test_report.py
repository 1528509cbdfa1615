import inspect
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
from support.wide_tables import (
    WIDTHS,
    assert_readable,
    column,
    header_cells,
    rendered,
    transformer_plan,
)

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale import sizing
from flax_escale.__main__ import main


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
    # Each device holds 1/8 of the kernel and half the bias: a little above its share.
    assert report.fullest_share == report.max_device_bytes / (report.total_bytes / 8)
    assert f"balance {report.fullest_share:.2f}x the ideal share" in " ".join(text.split())
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


# --- the table at every width ------------------------------------------------------------


# The columns shown at each width: the rest give way, annotated by first, then dtype, logical
# axes, shape and notes; path, spec and bytes per device never do.
SHOWN = {
    80: ["path", "spec", "bytes/device"],
    100: ["path", "spec", "bytes/device", "notes"],
    120: ["path", "shape", "spec", "bytes/device", "notes"],
    160: ["path", "shape", "dtype", "logical axes", "spec", "bytes/device", "notes"],
}


@pytest.mark.parametrize("width", WIDTHS)
def test_the_table_reads_at_every_width_in_a_log(width):
    plan = transformer_plan()
    text = rendered(fe.sharding_report(plan, show=False).table(), width)
    assert_readable(text, width, [e.path for e in plan])
    assert header_cells(text) == SHOWN[width]
    said = " ".join(text.split())
    assert "1 corrections" in said
    if "notes" in SHOWN[width]:  # the bias's correction
        assert "size 3 is not divisible" in said


def test_the_table_leaves_out_empty_notes_and_gives_way_in_order():
    plan = transformer_plan(corrected=False)
    report = fe.sharding_report(plan, show=False)
    wide, laptop = rendered(report.table(), 160), rendered(report.table(), 100)
    assert "notes" not in header_cells(wide)
    assert header_cells(laptop) == ["path", "shape", "spec", "bytes/device"]
    said = " ".join(laptop.split())
    assert "(left out at this width: dtype, logical axes, annotated by)" in said


def test_below_its_key_columns_the_plain_report_is_printed():
    plan = transformer_plan()
    report = fe.sharding_report(plan, show=False)
    text = rendered(report, 50)
    assert "┃" not in text
    assert_readable(text, 50, [e.path for e in plan])
    assert " ".join(report.summary().split()) in " ".join(text.split())


def test_balance_is_the_fullest_devices_share_over_the_ideal():
    # Arrays below IDLE_AXES_MIN_BYTES, so that the plan leaves them as they are given.
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    whole = NamedSharding(mesh, P())  # replicated: every device holds it all
    big = jax.ShapeDtypeStruct((256, 256), np.float32, sharding=whole)
    split = jax.ShapeDtypeStruct((256, 256), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    report = fe.sharding_report({"w": big}, show=False)
    assert report.balance_score == 1.0  # min / max: every device holds the same
    assert report.fullest_share == 8.0
    assert "balance 8.00x the ideal share" in " ".join(rendered(report, 120).split())
    # Each device holds all of one and 1/8 of the other: 9 / 16 of everything, where its
    # share is 1 / 8.
    report = fe.sharding_report({"w": big, "v": split}, show=False)
    assert report.fullest_share == pytest.approx((9 / 16) / (1 / 8))
    assert "balance 4.50x the ideal share" in report.summary()


# --- the command line ---------------------------------------------------------------------


class Corrected(nn.Module):
    """A kernel of 6 rows on fsdp=4 and a batch of 6 constrained over it: both corrected."""

    @nn.compact
    def __call__(self, x):
        x = fe.constrain(x, ("batch", "hidden_state"))
        init = nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        )
        return x @ self.param("kernel", init, (x.shape[-1], 32))


_SOURCE, _START = inspect.getsourcelines(Corrected.__call__)
LINE = _START + next(i for i, line in enumerate(_SOURCE) if "fe.constrain" in line)


def corrected_workload():
    batch = (jax.ShapeDtypeStruct((6, 6), jnp.float32),)
    return sizing.Workload(Corrected(), 0, batch, tx=optax.adam(1e-3))


def test_the_command_line_shows_corrections_as_notes_not_warnings(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    # The command sizes JAX's simulated devices to its mesh where the backend has not started
    # yet; in this process the suite's 8 devices stand, whichever test a worker runs first.
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    code = main(["report", f"{__name__}:corrected_workload", "--mesh", "fsdp:4,tp:2"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.err == ""  # no warning's text
    out = captured.out
    assert "Warning" not in out
    assert "/" + __file__.split("/")[1] not in out  # no absolute path of this machine
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "notes" in header_cells(out)
    assert "size 6 is not divisible" in " ".join(column(out, 4))  # the kernel's note
    said = " ".join(out.split())
    assert "1 corrections" in said
    # The constraint's correction, below: where, what was asked, what was dropped.
    below = out[out.index("1 activation constraint(s) corrected while tracing the step") :]
    where = "".join(column(below, 0))  # relative to the working folder
    assert where.endswith(f"test_report.py:{LINE}")
    assert not where.startswith("/")
    assert (
        " ".join(column(below, 1)).strip() == "('batch', 'hidden_state') on (6, 6) -> P(None, 'tp')"
    )
    assert " ".join(column(below, 2)).startswith("dimension 0 (batch): size 6 is not divisible")
    assert " ".join(column(below, 2)).endswith("dropped ('fsdp', 'dp')")


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.sharding_report("params", mesh_dp_tp(), show=False),
        T,
        "tree",
        "'params'",
        r"variables\['params'\]",
        id="sharding_report-string",
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
