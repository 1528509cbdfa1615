"""Checkpoints that survive a killed save, and restore errors that say what is wrong.

The kill test runs the save in a real subprocess (one CPU device) and kills it with SIGKILL at
several instants of an overwrite of a ~96 MB tree; after each kill the checkpoint must restore
bit-exact to either the tree it held before or the one being saved. The instants a random kill
rarely hits (between the two renames of the swap, before the old directory is deleted) are
built on disk directly.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe

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


def small_tree():
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    return {
        "w": jax.device_put(
            np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(mesh, P("fsdp"))
        )
    }


def restored_value(path, tree):
    return float(fe.restore_checkpoint(path, tree)["w"][0, 0])


@pytest.mark.parametrize("left", ["between renames", "before deleting old", "tmp half written"])
def test_interrupted_swap_states_restore_and_are_cleaned(tmp_path, left):
    old, new = small_tree(), jax.tree.map(lambda a: a + 100, small_tree())
    path = tmp_path / "c"
    fe.save_checkpoint(path, old)
    fe.save_checkpoint(tmp_path / "staged", new)
    if left == "between renames":  # old renamed aside, the complete new one not yet in place
        os.rename(path, f"{path}.flax-escale-old")
        os.rename(tmp_path / "staged", f"{path}.flax-escale-tmp")
        expected = 0.0
    elif left == "before deleting old":  # new in place, old not yet deleted
        os.rename(path, f"{path}.flax-escale-old")
        os.rename(tmp_path / "staged", path)
        expected = 100.0
    else:  # killed while orbax wrote the new one
        os.rename(tmp_path / "staged", f"{path}.flax-escale-tmp.orbax-checkpoint-tmp-123")
        os.remove(f"{path}.flax-escale-tmp.orbax-checkpoint-tmp-123/_METADATA")
        expected = 0.0
    assert restored_value(path, old) == expected
    fe.save_checkpoint(path, jax.tree.map(lambda a: a + 7, old), force=True)
    assert restored_value(path, old) == 7.0
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_save_without_force_after_interrupted_first_save(tmp_path):
    path = tmp_path / "c"
    os.makedirs(f"{path}.flax-escale-tmp.orbax-checkpoint-tmp-5/d")
    with pytest.raises(fe.EscaleError, match=r"does not exist; an interrupted save left only"):
        fe.restore_checkpoint(path, small_tree())
    fe.save_checkpoint(path, small_tree())  # no force needed: nothing whole was there
    assert restored_value(path, small_tree()) == 0.0
    assert sorted(os.listdir(tmp_path)) == ["c"]


def _empty(d):
    os.makedirs(d)


def _not_checkpoint(d):
    os.makedirs(d)
    (d / "notes.txt").write_text("hello")


def _a_file(d):
    d.write_text("hello")


def _half_deleted(d):
    fe.save_checkpoint(d, small_tree())
    shutil.rmtree(d / "d")
    for sub in d.glob("ocdbt.process_*"):
        shutil.rmtree(sub)


def _no_metadata(d):
    fe.save_checkpoint(d, small_tree())
    os.remove(d / "_METADATA")


def _orbax_leftover(d):
    fe.save_checkpoint(d, small_tree())


@pytest.mark.parametrize(
    ("name", "make", "message"),
    [
        ("missing", lambda d: None, "no checkpoint at {d}: the directory does not exist"),
        ("empty", _empty, "not a checkpoint: {d} is an empty directory"),
        ("other", _not_checkpoint, "not a checkpoint: {d} holds no checkpoint metadata"),
        ("file", _a_file, "not a checkpoint: {d} is a file"),
        ("half", _half_deleted, "incomplete or damaged checkpoint at {d}"),
        ("nometa", _no_metadata, "incomplete or damaged checkpoint at {d}"),
        (
            "c.orbax-checkpoint-tmp-17",
            _orbax_leftover,
            "incomplete checkpoint, left by an interrupted save at {d}",
        ),
        (
            "c.flax-escale-tmp",
            _orbax_leftover,
            "incomplete checkpoint, left by an interrupted save at {d}",
        ),
    ],
)
def test_restore_errors_name_the_directory(tmp_path, name, make, message):
    d = tmp_path / name
    make(d)
    with pytest.raises(fe.EscaleError, match=re.escape(message.format(d=repr(str(d))))) as info:
        fe.restore_checkpoint(d, small_tree())
    assert len(str(info.value)) < 600
    assert info.value.__cause__ is None


def _like(tree, **changes):
    w = tree["w"]
    spec = {"shape": w.shape, "dtype": w.dtype, **changes}
    return {"w": jax.ShapeDtypeStruct(spec["shape"], spec["dtype"], sharding=w.sharding)}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            lambda t: _like(t, dtype=jnp.bfloat16),
            "leaf 'w' is saved as float32[8, 2] in {d} "
            "but the target is bfloat16[8, 2]; pass cast=True",
        ),
        (
            lambda t: _like(t, dtype=jnp.int8),
            "leaf 'w' is saved as float32[8, 2] in {d} "
            "but the target is int8[8, 2]; pass cast=True",
        ),
        (
            lambda t: _like(t, shape=(4, 4)),
            "leaf 'w' is saved as float32[8, 2] in {d} "
            "but the target is float32[4, 4]; shapes must match",
        ),
        (
            lambda t: {**t, "b": t["w"]},
            "target leaves not saved: ['b']; saved leaves not in the target: []",
        ),
        (
            lambda t: {"v": t["w"]},
            "target leaves not saved: ['v']; saved leaves not in the target: ['w']",
        ),
        (
            lambda t: {"w": {"x": t["w"]}},
            "target leaves not saved: ['w/x']; saved leaves not in the target: ['w']",
        ),
    ],
)
def test_mismatched_targets_name_the_leaf(tmp_path, target, message):
    tree = small_tree()
    d = tmp_path / "c"
    fe.save_checkpoint(d, tree)
    with pytest.raises(fe.EscaleError, match=re.escape(message.format(d=repr(str(d))))):
        fe.restore_checkpoint(d, target(tree))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8, jnp.float16])
def test_cast_true_converts(tmp_path, dtype):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    restored = fe.restore_checkpoint(tmp_path / "c", _like(tree, dtype=dtype), cast=True)["w"]
    assert restored.dtype == dtype
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(tree["w"]).astype(dtype))
