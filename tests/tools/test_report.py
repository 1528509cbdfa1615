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

import flax_escale as fe
from flax_escale import linen as fel
from flax_escale.plan._plan import format_bytes


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


def test_will_it_fit_reads_the_compiled_memory():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    x = jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    step = jax.jit(lambda x: jnp.tanh(x) * 2)
    estimate = fe.will_it_fit(step, x, device_bytes=1 << 30)
    assert estimate.argument_bytes == 1024 * 256 * 4 // 8
    assert estimate.output_bytes == 1024 * 256 * 4 // 8
    assert estimate.fits
    assert not fe.will_it_fit(step.lower(x), device_bytes=1000).fits
    compiled = fe.will_it_fit(step.lower(x).compile())
    assert compiled.peak_bytes >= compiled.argument_bytes
    assert "peak" in str(compiled)
    assert compiled.backend == "cpu"
    assert str(compiled).startswith("per cpu device: arguments 128.00 KiB")


def test_will_it_fit_labels_an_init_with_its_temporaries_and_backend():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    model = nn.Dense(
        1024,
        use_bias=False,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
        ),
    )
    lowered = fe.lower_init(model, mesh, jax.random.key(0), jnp.ones((2, 1024)))
    estimate = fe.will_it_fit(lowered)
    assert estimate.output_bytes == 1024 * 1024 * 4 // 8
    # XLA's CPU backend materializes the random bits before transforming them.
    assert estimate.temp_bytes > 0
    assert estimate.peak_bytes == estimate.argument_bytes + estimate.output_bytes + (
        estimate.temp_bytes
    )
    assert f"temporaries {format_bytes(estimate.temp_bytes)}" in str(estimate)


def test_will_it_fit_reads_nnx_jits_stages_as_jaxs_own():
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    x = jnp.ones((8, 64))
    lowered = nnx.jit(lambda m, x: m(x)).lower(model, x)
    compiled = lowered.compile()
    expected = fe.will_it_fit(compiled.compiled)
    assert fe.will_it_fit(compiled) == expected
    assert fe.will_it_fit(lowered).peak_bytes == expected.peak_bytes
