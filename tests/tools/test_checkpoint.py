"""Saving and restoring checkpoints (``flax_escale/tools/_checkpoint.py``).

Round trips onto meshes of other shapes, checksums that catch damaged data, and trees that are
refused. The kill test runs the save in a real subprocess (one CPU device) and kills it with
SIGKILL at several instants of an overwrite of a ~96 MB tree; after each kill the checkpoint
must restore bit-exact to either the tree it held before or the one being saved. The instants a
random kill rarely hits (between the two renames of the swap, before the old directory is
deleted) are built on disk directly, in ``test_checkpoint_dirs.py``.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.checkpoints import restored_value, small_tree, target_like
from support.mistakes import CKPT, MISTAKE, T, case, mesh_dp_tp, params, raises_a_library_error

import flax_escale as fe
from flax_escale import linen as fel

KERNEL_AXES = ("hidden_state", "mlp_intermediate")


def dense():
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), KERNEL_AXES)
    return nn.Dense(64, kernel_init=init)


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_train_state_restores_onto_a_mesh_of_another_shape(tmp_path):
    x = jnp.ones((4, 32))
    key = jax.random.key(0)
    saved_mesh = fe.create_mesh((1, 8, 1, 1, 1))
    state = fel.init_train_state(dense(), saved_mesh, key, x, tx=optax.adam(1e-3))
    state, _ = jax.jit(lambda s: (s.apply_gradients(grads=s.params), 0))(state)  # non-zero moments
    fe.save_checkpoint(tmp_path / "ckpt", state)

    serve_mesh = fe.create_mesh((2, 2, 1, 2, 1))
    target = fel.init_train_state(dense(), serve_mesh, key, x, tx=optax.adam(1e-3))
    restored = fe.restore_checkpoint(tmp_path / "ckpt", target)
    assert_bit_equal(restored, state)
    kernel = restored.params["kernel"]
    assert kernel.sharding.mesh == serve_mesh
    assert kernel.sharding.is_equivalent_to(NamedSharding(serve_mesh, P(("fsdp", "sp"), "tp")), 2)
    assert restored.opt_state[0].mu["kernel"].sharding.mesh == serve_mesh
    assert int(restored.step) == 1


def test_restore_with_plan_shardings_and_abstract_targets(tmp_path):
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    x = jnp.ones((4, 32))
    variables = fe.init_sharded(dense(), mesh, jax.random.key(1), x)
    fe.save_checkpoint(tmp_path / "v", variables)
    other = fe.create_mesh((2, 4, 1, 1, 1))
    plan = fe.plan_sharding(dense(), other, jax.random.key(1), x)
    abstract = jax.eval_shape(lambda: variables)
    restored = fe.restore_checkpoint(tmp_path / "v", abstract, shardings=plan.shardings())
    assert_bit_equal(restored, variables)
    assert restored["params"]["kernel"].sharding.spec == plan["params/kernel"].spec


def test_nnx_state_round_trip(tmp_path):
    @fe.sharded_module({"kernel": KERNEL_AXES})
    class Up(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(32, 64, rngs=rngs)

    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    model = fe.init_sharded(Up, mesh, 0)
    fe.save_checkpoint(tmp_path / "m", nnx.state(model))
    fresh = fe.init_sharded(Up, fe.create_mesh((1, 8, 1, 1, 1)), 1)
    restored = fe.restore_checkpoint(tmp_path / "m", nnx.state(fresh))
    nnx.update(fresh, restored)
    assert_bit_equal(nnx.state(fresh), nnx.state(model))
    assert fresh.wi.kernel.get_value().sharding.mesh.shape["fsdp"] == 8


def test_nnx_state_restores_into_an_abstract_model_with_plan_shardings(tmp_path):
    # The variables stay variables: an NNX state saves each value under ".../value".
    @fe.sharded_module({"kernel": KERNEL_AXES})
    class Up(nnx.Module):
        def __init__(self, rngs):
            self.wi = nnx.Linear(32, 64, rngs=rngs)

    model = fe.init_sharded(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    fe.save_checkpoint(tmp_path / "m", nnx.state(model))
    other = fe.create_mesh((2, 4, 1, 1, 1))
    plan = fe.plan_sharding(Up, other, 0)
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Up(nnx.Rngs(0))))
    restored = fe.restore_checkpoint(tmp_path / "m", abstract, shardings=plan.shardings())
    assert_bit_equal(restored, nnx.state(model))
    assert restored["wi"]["kernel"].get_value().sharding.spec == plan["wi/kernel"].spec
    assert nnx.merge(graph, restored).wi.kernel.get_value().sharding.mesh == other


def test_errors(tmp_path):
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    tree = {"w": jax.device_put(np.zeros((8, 2)), NamedSharding(mesh, P("fsdp")))}
    fe.save_checkpoint(tmp_path / "c", tree)
    with pytest.raises(fe.EscaleError, match="exists; pass force=True"):
        fe.save_checkpoint(tmp_path / "c", tree)
    fe.save_checkpoint(tmp_path / "c", tree, force=True)
    with pytest.raises(fe.EscaleError, match="no checkpoint at"):
        fe.restore_checkpoint(tmp_path / "missing", tree)
    with pytest.raises(fe.EscaleError, match="NamedSharding"):
        fe.restore_checkpoint(tmp_path / "c", {"w": np.zeros((8, 2))})


def test_a_path_with_a_nul_character_is_refused_before_anything_is_written(tmp_path):
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    tree = {"w": jax.device_put(np.zeros((8, 2)), NamedSharding(mesh, P("fsdp")))}
    bad = str(tmp_path / "c\0k")
    message = r"directory must be a path without NUL characters, got '.*c\\x00k'.*remove"
    with pytest.raises(fe.EscaleError, match=message):
        fe.save_checkpoint(bad, tree)
    with pytest.raises(fe.EscaleError, match=message):
        fe.restore_checkpoint(bad, tree)
    assert list(tmp_path.iterdir()) == []


ROWS, COLS, LEAVES = 1024, 2048, 12  # 12 float32 leaves of 8 MiB: 96 MiB


SAVER = textwrap.dedent(
    """
    import sys, time
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flax_escale as fe

    path, seed, force = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    rows, cols, leaves = {rows}, {cols}, {leaves}
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    tree = {{f"w{{i}}": jax.device_put(rng.random((rows, cols), dtype=np.float32), sharding)
             for i in range(leaves)}}
    jax.block_until_ready(tree)
    print("saving", flush=True)
    start = time.perf_counter()
    fe.save_checkpoint(path, tree, force=force)
    print(f"saved {{time.perf_counter() - start:.3f}}", flush=True)
    """
).format(rows=ROWS, cols=COLS, leaves=LEAVES)


_TREES: dict[int, dict[str, np.ndarray]] = {}


def tree_of(seed):
    if seed not in _TREES:
        rng = np.random.default_rng(seed)
        _TREES[seed] = {f"w{i}": rng.random((ROWS, COLS), dtype=np.float32) for i in range(LEAVES)}
    return _TREES[seed]


def start_saver(script, path, seed, force):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path), str(seed), "1" if force else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert line.strip() == "saving", (line, proc.stderr.read())
    return proc


def which_tree(path, seeds):
    """The seed whose tree ``path`` restores to bit-exact, asserting there is one."""
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    target = {
        f"w{i}": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=sharding)
        for i in range(LEAVES)
    }
    restored = {k: np.asarray(v) for k, v in fe.restore_checkpoint(path, target).items()}
    for seed in seeds:
        expected = tree_of(seed)
        if all(
            np.array_equal(restored[k].view(np.uint32), expected[k].view(np.uint32))
            for k in expected
        ):
            return seed
    raise AssertionError(f"{path} restores to neither tree {seeds}")


@pytest.mark.slow
def test_overwrite_killed_at_any_instant_keeps_a_whole_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    path = tmp_path / "ckpt"
    first = start_saver(script, path, 0, force=False)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    current = which_tree(path, [0])
    # One overwrite not killed, timed from the start of the save to the saver's exit.
    whole = start_saver(script, path, 1, force=True)
    started = time.monotonic()
    _, err = whole.communicate(timeout=120)
    seconds = time.monotonic() - started
    assert whole.returncode == 0, err
    assert which_tree(path, [current, 1]) == 1
    current = 1

    # Kill after fractions of that duration, and once as soon as the temporary directory appears.
    kill_points = [0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 0.98, "tmp appears"]
    outcomes = []
    for seed, point in enumerate(kill_points, start=2):
        proc = start_saver(script, path, seed, force=True)
        if point == "tmp appears":
            deadline = time.monotonic() + 60
            while not any(".flax-escale-tmp" in n for n in os.listdir(tmp_path)):
                assert proc.poll() is None
                assert time.monotonic() < deadline
                time.sleep(0.001)
        else:
            time.sleep(point * seconds)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
        restored = which_tree(path, [current, seed])
        outcomes.append((point, "new" if restored == seed else "old"))
        current = restored
    print(f"whole save {seconds:.2f} s; kill point -> version restored: {outcomes}")

    # The next save, in this process, succeeds and leaves nothing beside the checkpoint.
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    fe.save_checkpoint(path, jax.device_put(tree_of(99), sharding), force=True)
    assert which_tree(path, [99]) == 99
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "saver.py"]


def test_a_failed_write_is_a_clear_error_and_the_old_checkpoint_stays(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    path = tmp_path / "c"
    fe.save_checkpoint(path, small_tree())

    def full_disk(self, *args, **kwargs):
        raise ValueError("OUT_OF_RANGE: Error writing local file: No space left on device")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", full_disk)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"could not write the checkpoint {str(path)!r}: ValueError: OUT_OF_RANGE: Error "
            "writing local file: No space left on device. Nothing was swapped in"
        ),
    ) as info:
        fe.save_checkpoint(path, jax.tree.map(lambda a: a + 1, small_tree()), force=True)
    assert info.value.__cause__ is None
    monkeypatch.undo()
    assert restored_value(path, small_tree()) == 0.0


def _deleted(tree):
    tree["w"].delete()
    return tree


@pytest.mark.parametrize(
    ("tree", "error", "message"),
    [
        (dict, fe.EscaleTypeError, "tree: dict {} holds no array, so nothing would be saved"),
        (
            lambda: {"p": {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32)}},
            fe.EscaleTypeError,
            "tree: the leaf 'p/w' is a jax.ShapeDtypeStruct float32[8, 2], which holds no values",
        ),
        (
            lambda: _deleted(small_tree()),
            fe.EscaleError,
            "tree: the array at 'w' was deleted (donated to a jitted step",
        ),
    ],
    ids=["empty", "abstract", "donated"],
)
def test_a_tree_without_values_to_save_is_refused(tmp_path, tree, error, message):
    with pytest.raises(error, match=re.escape(message)):
        fe.save_checkpoint(tmp_path / "c", tree())
    assert os.listdir(tmp_path) == []


FLIPPER = textwrap.dedent(
    """
    import collections, json, re, shutil, sys
    from pathlib import Path
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import flax_escale as fe

    root = Path(sys.argv[1])
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    rows = NamedSharding(mesh, P("fsdp"))
    values = {
        "a": np.arange(256 * 128, dtype=np.float32).reshape(256, 128),
        "b": np.arange(256 * 128, dtype=np.float32).reshape(256, 128) * 0.5 + 1,
    }
    fe.save_checkpoint(root / "c", {k: jax.device_put(v, rows) for k, v in values.items()})
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows) for k, v in values.items()}
    outcomes, named = collections.Counter(), []
    for file in sorted((root / "c").glob("ocdbt.process_*/d/*")):
        size = file.stat().st_size
        for position in range(0, size, max(1, size // 12)):
            copy = root / "flipped"
            shutil.copytree(root / "c", copy)
            flipped = copy / file.relative_to(root / "c")
            content = bytearray(flipped.read_bytes())
            content[position] ^= 0x10
            flipped.write_bytes(bytes(content))
            try:
                restored = fe.restore_checkpoint(copy, target)
            except fe.EscaleError as error:
                checksum = "differ from the ones saved (their checksums do not match)"
                outcomes["checksum" if checksum in str(error) else "unreadable"] += 1
                if checksum in str(error):
                    named.append(str(error))
            else:
                same = all(np.array_equal(np.asarray(restored[k]), v) for k, v in values.items())
                outcomes["unchanged" if same else "SILENTLY WRONG"] += 1
            shutil.rmtree(copy)
    print(json.dumps({"outcomes": outcomes, "named": named}))
    """
)


def test_a_flipped_byte_never_restores_wrong_values_without_a_word(tmp_path):
    # In a process of its own: orbax, once a chunk fails to decompress, leaves reads behind
    # that report "Exception ignored" at random moments later, on whatever runs then.
    script = tmp_path / "flipper.py"
    script.write_text(FLIPPER)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    outcomes = found["outcomes"]
    assert "SILENTLY WRONG" not in outcomes, outcomes
    # Most flips land in compressed chunks that still decompress, to other numbers: only the
    # checksums see those.
    assert outcomes.get("checksum", 0) > 0, outcomes
    for message in found["named"]:  # the leaf whose values changed, by its path
        assert re.search(r"the values restored for \['[ab]'\] from ", message), message


def _swap_data(checkpoint, other):
    # The data files of `other`, under the record (checksums) of `checkpoint`: what a mixed-up
    # copy leaves, with values that read back without an error.
    record = (checkpoint / "flax_escale_checksums.json").read_bytes()
    shutil.rmtree(checkpoint)
    shutil.copytree(other, checkpoint)
    (checkpoint / "flax_escale_checksums.json").write_bytes(record)


@pytest.mark.parametrize("cast", [False, True])
def test_damaged_data_is_named_with_cast_or_without(tmp_path, cast):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    fe.save_checkpoint(tmp_path / "other", jax.tree.map(lambda a: a + 1, tree))
    _swap_data(tmp_path / "c", tmp_path / "other")
    target = target_like(tree, dtype=jnp.bfloat16) if cast else tree
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"the values restored for ['w'] from {str(tmp_path / 'c')!r} differ from the ones "
            "saved (their checksums do not match)"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "c", target, cast=cast)


def test_a_module_is_refused_where_its_state_belongs(tmp_path):
    model = nnx.Linear(2, 8, rngs=nnx.Rngs(0))
    with pytest.raises(
        fe.EscaleTypeError,
        match=re.escape("tree: got the NNX module Linear, not its state; save nnx.state(model)"),
    ):
        fe.save_checkpoint(tmp_path / "m", model)
    assert os.listdir(tmp_path) == []
    fe.save_checkpoint(tmp_path / "m", nnx.state(model))
    with pytest.raises(
        fe.EscaleTypeError,
        match=re.escape(
            "target: got the NNX module Linear, not its state; pass nnx.state(model), then put "
            "the result in with nnx.update(model, restored)"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "m", model)
    with pytest.raises(
        fe.EscaleTypeError,
        match=re.escape(
            "tree: got the Linen module Dense, which holds no arrays; pass its variables"
        ),
    ):
        fe.save_checkpoint(tmp_path / "l", nn.Dense(4))


def _serving_tree(values):
    # A serving layout: the attention weights over all 8 devices, the head on a sub-mesh of 4.
    everywhere = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
    head = Mesh(np.array(jax.devices()[4:]), ("tp",))
    return {
        "attention": jax.device_put(values["attention"], NamedSharding(everywhere, P("dp", "tp"))),
        "head": jax.device_put(values["head"], NamedSharding(head, P(None, "tp"))),
    }


def test_a_tree_on_two_device_sets_round_trips_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    values = {
        "attention": rng.standard_normal((8, 16), dtype=np.float32),
        "head": rng.standard_normal((16, 8), dtype=np.float32),
    }
    fe.save_checkpoint(tmp_path / "c", _serving_tree(values))
    restored = fe.restore_checkpoint(
        tmp_path / "c", _serving_tree(jax.tree.map(np.zeros_like, values))
    )
    for name, value in values.items():
        assert restored[name].sharding == _serving_tree(values)[name].sharding
        np.testing.assert_array_equal(
            np.asarray(restored[name]).view(np.uint32), value.view(np.uint32)
        )
    # The checksums of both device sets were kept and are compared.
    record = json.loads((tmp_path / "c" / "flax_escale_checksums.json").read_text())
    assert set(record["leaves"]) == {"attention", "head"}
    assert all(isinstance(s, int) for s in record["leaves"].values())


@pytest.mark.parametrize(
    ("argument", "call"),
    [("tree", fe.save_checkpoint), ("target", fe.restore_checkpoint)],
)
def test_a_single_array_is_refused_where_a_tree_belongs(tmp_path, argument, call):
    array = small_tree()["w"]
    message = (
        f"{argument}: got a single array float32[8, 2], where a checkpoint holds a tree of "
        f"them; put it in a dict, e.g. {{'w': {argument}}}"
    )
    with pytest.raises(fe.EscaleTypeError, match=re.escape(message)):
        call(tmp_path / "c", array)
    assert os.listdir(tmp_path) == []


# --- mistakes: each raises a library error naming the argument and showing the value ----

CASES = [
    case(
        lambda: fe.save_checkpoint(None, params()),
        T,
        "directory",
        "None",
        "/tmp/checkpoints",
        id="save_checkpoint-directory-none",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT.encode(), params()),
        T,
        "directory",
        "bytes b'",
        r"str or pathlib\.Path",
        id="save_checkpoint-directory-bytes",
    ),
    case(
        lambda: fe.save_checkpoint("", params()),
        fe.EscaleError,
        "directory",
        "''",
        "non-empty path",
        id="save_checkpoint-directory-empty",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT, "params"),
        T,
        "tree",
        "'params'",
        "not its name",
        id="save_checkpoint-tree-string",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT, None),
        T,
        "tree",
        "None",
        "pytree of arrays",
        id="save_checkpoint-tree-none",
    ),
    case(
        lambda: fe.save_checkpoint(CKPT, params(), force="yes"),
        T,
        "force",
        "'yes'",
        "True or False",
        id="save_checkpoint-force-string",
    ),
    case(
        lambda: fe.restore_checkpoint(3, params()),
        T,
        "directory",
        "int 3",
        "/tmp/checkpoints",
        id="restore_checkpoint-directory-int",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, "params"),
        T,
        "target",
        "'params'",
        "not its name",
        id="restore_checkpoint-target-string",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, None),
        T,
        "target",
        "None",
        "pytree of arrays",
        id="restore_checkpoint-target-none",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, params(), shardings={"w": P("dp")}),
        T,
        "shardings",
        "P('dp',)",
        r"NamedSharding\(mesh, P\('dp',\)\)",
        id="restore_checkpoint-shardings-spec",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, params(), shardings="dp"),
        fe.EscaleError,
        "shardings",
        "'dp'",
        "shaped like target",
        id="restore_checkpoint-shardings-string",
    ),
    case(
        lambda: fe.restore_checkpoint(
            CKPT, params(), shardings={"v": NamedSharding(mesh_dp_tp(), P())}
        ),
        fe.EscaleError,
        "shardings",
        "{'v': NamedSharding",
        "same keys",
        id="restore_checkpoint-shardings-other-keys",
    ),
    case(
        lambda: fe.restore_checkpoint(CKPT, params(), cast="yes"),
        T,
        "cast",
        "'yes'",
        "True or False",
        id="restore_checkpoint-cast-string",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
