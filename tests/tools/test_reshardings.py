"""XLA's involuntary-rematerialization reports: collected from a compile, not printed.

The oracle is a program whose resharding XLA's partitioner is known to do by replicating: an
array split over ``(fsdp, dp)`` on its first dimension, needed split over ``fsdp`` on its
last; and one it does cheaply (keeping ``dp``, moving ``fsdp``), which must report nothing.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale.sizing._evaluate import Figures
from flax_escale.tools import Resharding
from flax_escale.tools._reshardings import (
    _standard_error_captured,
    compile_collecting,
    summarize,
)

REPORT_LINE = (
    "W1126 07:55:25.183108   25754 spmd_partitioner.cc:656] [SPMD] Involuntary full "
    "rematerialization. The compiler cannot go from sharding {devices=[1,1,8]<=[8]} to "
    "{devices=[4,2,1]<=[8]} efficiently for HLO operation %gather = f32[16,32,8]{2,1,0} "
    "gather(%fake_parameter.0, %all-gather), offset_dims={2}. As the last resort, SPMD will "
    "replicate the tensor and then partition it to obtain the target sharding.\n"
)


TILES = (
    "{devices=[8,1,1]<=[4,2]T(1,0)}",
    "{devices=[1,1,2,4]<=[4,2]T(1,0) last_tile_dim_replicate}",
)
MESH = "mesh['dp'=4,'fsdp'=2,'ep'=1,'tp'=1,'sp'=1]"
NAMED = (f"{{{MESH}, [{{'fsdp', 'dp'}}, {{}}, {{}}]}}", f"{{{MESH}, [{{}}, {{}}, {{'fsdp'}}]}}")


def _move(source, target, shape=(8, 32, 64)):
    mesh = fe.create_mesh((4, 2, 1, 1, 1))
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, source))

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, target)) + 1

    return jax.jit(f).lower(x)


def test_a_resharding_done_by_replicating_is_reported_and_not_printed(capfd):
    compiled, reports = compile_collecting(_move(P(("fsdp", "dp")), P(None, None, "fsdp")))
    assert isinstance(compiled, jax.stages.Compiled)
    # XLA spells shardings as tiles up to jaxlib 0.10, by mesh axes from 0.11.
    assert reports in [
        (Resharding("parameter", "f32[1,32,64]", *TILES),),
        (Resharding("parameter", "f32[1,32,64]", *NAMED),),
    ]
    assert "Involuntary" not in capfd.readouterr().err


def test_a_cheap_resharding_reports_nothing():
    assert compile_collecting(_move(P(("dp", "fsdp")), P("dp", None, "fsdp")))[1] == ()


def test_a_program_compiled_again_reports_what_its_first_compile_did():
    # The second compile comes from JAX's cache and logs nothing.
    lowered = _move(P(("fsdp", "dp")), P(None, None, "fsdp"), shape=(16, 32, 64))
    first = compile_collecting(lowered)[1]
    assert len(first) == 1
    assert compile_collecting(lowered)[1] == first


def test_other_lines_written_while_compiling_go_on_to_standard_error(capfd):
    with _standard_error_captured() as captured:
        os.write(2, b"a line of someone else\n")
        os.write(2, REPORT_LINE.encode())
    assert "a line of someone else" in captured.text
    assert "Involuntary" in captured.text
    err = capfd.readouterr().err
    assert "a line of someone else" in err
    assert "Involuntary" not in err


def test_the_summary_counts_them_and_names_each_operation_once():
    gather = Resharding("gather", "f32[16,32,8]", "{a}", "{b}")
    parameter = Resharding("parameter", "f32[4,16,64]", "{b}", "{a}")
    assert summarize(()) == ""
    assert summarize((gather, gather, parameter)) == (
        "3 involuntary rematerializations (replicated to split): gather f32[16,32,8], "
        "parameter f32[4,16,64]"
    )
    assert str(gather) == "gather f32[16,32,8] {a} -> {b}"


def test_will_it_fit_says_which_arrays_the_compiler_replicated():
    estimate = fe.will_it_fit(_move(P(("fsdp", "dp")), P(None, None, "fsdp"), shape=(24, 8, 64)))
    assert [r.operation for r in estimate.reshardings] == ["parameter"]
    assert "1 involuntary rematerialization (replicated to split): parameter f32[" in str(estimate)
    # A program compiled elsewhere: its compile was not seen.
    assert fe.will_it_fit(_move(P("dp"), P("dp")).compile()).reshardings is None


def test_the_planner_figures_keep_them_through_json():
    found = Figures(
        shape={"dp": 4, "fsdp": 2, "ep": 1, "tp": 1, "sp": 1},
        status="compiled",
        reshardings=(Resharding("gather", "f32[16,32,8]", "{a}", "{b}"),),
    )
    assert Figures.from_json(found.as_json()) == found
    # Figures cached before reshardings were collected read as none.
    older = {k: v for k, v in found.as_json().items() if k != "reshardings"}
    assert Figures.from_json(older).reshardings == ()


# A program compiled in another process comes from JAX's persistent cache, and XLA reports
# nothing; each step below is a fresh process sharing one cache folder.
_PERSISTENT = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("error")
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import flax_escale as fe
    from flax_escale.mesh import Target
    from flax_escale.tools._reshardings import compile_collecting

    how, where = sys.argv[1:]
    target = Target.named(where) if where != "cpu" else None
    mesh = target.mesh((4, 2, 1, 1, 1)) if target else fe.create_mesh((4, 2, 1, 1, 1))
    options = target.compiler_options if target else None
    source = NamedSharding(mesh, P(("fsdp", "dp")))
    wanted = NamedSharding(mesh, P(None, None, "fsdp"))
    x = jax.ShapeDtypeStruct((8, 32, 64), jnp.float32, sharding=source)
    lowered = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, wanted)).lower(x)
    if how == "plain":
        lowered.compile(options)
    else:
        print("@@", [r.operation for r in compile_collecting(lowered, options)[1]])
    """
)


def _in_fresh_process(how, where, cache):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", _PERSISTENT, how, where],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line[3:] for line in done.stdout.splitlines() if line.startswith("@@ ")]


def test_a_program_from_the_persistent_cache_reports_what_its_compile_did(tmp_path):
    # Compiled once without collecting (its executable cached, its reports nowhere), then
    # collected twice: afresh, then from the reports kept beside the cache.
    assert _in_fresh_process("plain", "cpu", tmp_path) == []
    assert _in_fresh_process("collect", "cpu", tmp_path) == ["['parameter']"]
    kept = [p.name for p in tmp_path.iterdir() if p.name.startswith("flax-escale-reshardings-")]
    assert len(kept) == 1, kept
    assert _in_fresh_process("collect", "cpu", tmp_path) == ["['parameter']"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the TPU compiler")
def test_a_tpu_program_compiles_again_quietly_with_the_persistent_cache_on(tmp_path):
    # The TPU compiler's client can write the cache's entries but not load them: JAX warns
    # and compiles again, which compile_collecting expects (warnings are errors in the child).
    # The same text on XLA:CPU is another program: its reports are its own.
    for _ in range(2):
        assert _in_fresh_process("collect", "v5e-8", tmp_path) == ["[]"]
    assert _in_fresh_process("collect", "cpu", tmp_path) == ["['parameter']"]
