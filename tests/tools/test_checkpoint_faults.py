"""Checkpoints that survive a killed save, and restore errors that say what is wrong.

The kill test runs the save in a real subprocess (one CPU device) and kills it with SIGKILL at
several instants of an overwrite of a ~96 MB tree; after each kill the checkpoint must restore
bit-exact to either the tree it held before or the one being saved. The instants a random kill
rarely hits (between the two renames of the swap, before the old directory is deleted) are
built on disk directly.
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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.permissions import permission_bits_apply

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
    # A whole checkpoint under a name only a save's temporary directories have.
    fe.save_checkpoint(d.parent / "whole", small_tree())
    os.rename(d.parent / "whole", d)


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


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cast_true_converts(tmp_path, dtype):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    restored = fe.restore_checkpoint(tmp_path / "c", _like(tree, dtype=dtype), cast=True)["w"]
    assert restored.dtype == dtype
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(tree["w"]).astype(dtype))


# --- nothing the library did not create is replaced or deleted ------------------------------


def _files(root):
    return sorted(
        (str(file.relative_to(root)), file.read_bytes())
        for file in Path(root).rglob("*")
        if file.is_file()
    )


def test_force_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("my notes")
    (project / "src" / "train.py").write_text("print('train')")
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"directory: {str(project)!r} is not a checkpoint (it holds notes.txt, src), and "
            "force=True replaces only a checkpoint"
        ),
    ):
        fe.save_checkpoint(project, small_tree(), force=True)
    assert _files(project) == [("notes.txt", b"my notes"), ("src/train.py", b"print('train')")]
    assert sorted(os.listdir(tmp_path)) == ["project"]


@pytest.mark.parametrize("force", [False, True])
def test_a_file_is_never_replaced(tmp_path, force):
    target = tmp_path / "weights.bin"
    target.write_text("the user's file")
    with pytest.raises(
        fe.EscaleError, match=re.escape(f"directory: {str(target)!r} is a file, not a checkpoint")
    ):
        fe.save_checkpoint(target, small_tree(), force=force)
    assert target.read_text() == "the user's file"
    assert sorted(os.listdir(tmp_path)) == ["weights.bin"]


def test_force_replaces_an_empty_directory(tmp_path):
    (tmp_path / "c").mkdir()
    fe.save_checkpoint(tmp_path / "c", small_tree(), force=True)
    assert restored_value(tmp_path / "c", small_tree()) == 0.0


def test_only_the_directories_a_save_makes_are_deleted_beside_it(tmp_path):
    siblings = [
        "c.flax-escale-old-backup",
        "c.flax-escale-tmp2",
        "c.orbax-checkpoint-tmp-mine",
        "c.flax-escale-tmp.orbax-checkpoint-tmp-notes",
        "c.flax-escale-probe-mine",
    ]
    for name in siblings:
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
    fe.save_checkpoint(tmp_path / "c", small_tree())
    # What interrupted saves of c leave, which the next save deletes.
    ours = ["c.flax-escale-tmp", "c.flax-escale-tmp.orbax-checkpoint-tmp-1795", "c.flax-escale-old"]
    for name in ours:
        (tmp_path / name).mkdir()
    fe.save_checkpoint(tmp_path / "c", small_tree(), force=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["c", *siblings])
    for name in siblings:
        assert (tmp_path / name / "keep.txt").read_text() == name


@pytest.mark.parametrize(
    "name",
    [
        "c.flax-escale-tmp",
        "c.flax-escale-old",
        "c.orbax-checkpoint-tmp-17",
        "x.orbax-checkpoint-tmp",
    ],
)
def test_names_of_a_saves_temporary_directories_are_refused(tmp_path, name):
    with pytest.raises(
        fe.EscaleError, match=r"is named like the temporary directories a save makes .* choose"
    ):
        fe.save_checkpoint(tmp_path / name, small_tree())
    assert os.listdir(tmp_path) == []


def test_a_parent_that_is_a_file_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    path = tmp_path / "file.txt" / "ckpt"
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"directory: cannot write the checkpoint {str(path)!r}: "
            f"{str(tmp_path / 'file.txt')!r} is a file, not a directory"
        ),
    ):
        fe.save_checkpoint(path, small_tree())
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]


def test_a_read_only_checkpoint_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from flax_escale.tools import _checkpoint

    path = tmp_path / "c"
    fe.save_checkpoint(path, small_tree())
    before = _files(path)
    # As for a user without root: this suite may run as root, whom permission bits never stop.
    monkeypatch.setattr(_checkpoint.os, "access", lambda p, mode: os.fspath(p) != str(path))
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"directory: cannot replace the checkpoint {str(path)!r}: {str(path)!r} is read-only"
        ),
    ):
        fe.save_checkpoint(path, jax.tree.map(lambda a: a + 1, small_tree()), force=True)
    monkeypatch.undo()
    assert _files(path) == before
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert restored_value(path, small_tree()) == 0.0


UNWRITABLE = textwrap.dedent(
    """
    import jax, numpy as np
    import flax_escale as fe

    try:
        fe.save_checkpoint("/proc/flax_escale_nowhere/ckpt", {"w": jax.numpy.ones((4,))})
    except fe.EscaleError as error:
        print(type(error).__name__, error)
    """
)


def test_an_unwritable_destination_is_a_clear_error_and_the_process_still_exits(tmp_path):
    script = tmp_path / "unwritable.py"
    script.write_text(UNWRITABLE)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "EscaleError directory: cannot write the checkpoint '/proc/flax_escale_nowhere/ckpt': "
    ), done.stdout
    assert "give a directory on a writable file system" in done.stdout


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


def test_a_list_restored_into_a_dict_says_which_container_differs(tmp_path):
    w = small_tree()["w"]
    fe.save_checkpoint(tmp_path / "c", {"layers": [w, w]})
    target = {"layers": {"0": w, "1": w}}
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "at 'layers' the checkpoint holds a list of ['0', '1'] where the target has a dict "
            "of ['0', '1']; restore into a tree of the kind that was saved"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "c", target)


def test_a_target_sharding_that_does_not_divide_names_the_leaf_and_dimension(tmp_path):
    fe.save_checkpoint(tmp_path / "c", {"w": jnp.ones((7, 2))})
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    target = {
        "w": jax.ShapeDtypeStruct((7, 2), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    }
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            "restore_checkpoint: the target leaf 'w': P('fsdp',) on mesh {'dp': 1, 'fsdp': 8, "
            "'ep': 1, 'tp': 1, 'sp': 1} splits dimension 0 of shape (7, 2) into 8 parts"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "c", target)


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


@pytest.mark.parametrize(
    ("dtype", "kinds"),
    [(jnp.int8, "floating point into integer"), (jnp.bool_, "floating point into bool")],
)
def test_cast_never_converts_floats_into_another_kind(tmp_path, dtype, kinds):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    with pytest.raises(fe.EscaleError, match=re.escape(f"{kinds} would change the values")):
        fe.restore_checkpoint(tmp_path / "c", _like(tree, dtype=dtype), cast=True)


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
    target = _like(tree, dtype=jnp.bfloat16) if cast else tree
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"the values restored for ['w'] from {str(tmp_path / 'c')!r} differ from the ones "
            "saved (their checksums do not match)"
        ),
    ):
        fe.restore_checkpoint(tmp_path / "c", target, cast=cast)


def test_cast_converts_in_the_targets_sharding(tmp_path):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    columns = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("tp",)), P(None, "tp"))
    target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.bfloat16, sharding=columns)}
    restored = fe.restore_checkpoint(tmp_path / "c", target, cast=True)["w"]
    assert restored.dtype == jnp.bfloat16
    assert restored.sharding.is_equivalent_to(columns, 2)
    expected = np.asarray(tree["w"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(restored).view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("inside", ["step_2", "a/b/step_2"])
def test_a_save_inside_a_checkpoint_is_refused(tmp_path, inside):
    run = tmp_path / "run"
    fe.save_checkpoint(run, small_tree())
    before = _files(run)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"directory: {str(run / inside)!r} is inside the checkpoint {str(run)!r}, whose "
            "next save would have to replace it; save each checkpoint beside the others, e.g. "
            f"{str(tmp_path / 'step_2')!r}"
        ),
    ):
        fe.save_checkpoint(run / inside, small_tree())
    assert _files(run) == before


def test_a_save_inside_a_saves_temporary_directory_is_refused(tmp_path):
    folder = tmp_path / "run.flax-escale-tmp"
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"directory: {str(folder / 'c')!r} is inside {str(folder)!r}, which is named like "
            "the temporary directories a save makes"
        ),
    ):
        fe.save_checkpoint(folder / "c", small_tree())
    assert os.listdir(tmp_path) == []


def _drop_file_list(run):
    record = run / "flax_escale_checksums.json"
    found = json.loads(record.read_text())
    del found["files"]  # as a checkpoint saved before the record listed its files
    record.write_text(json.dumps(found))


@pytest.mark.parametrize(
    ("where", "listed"),
    [("step_2", True), ("d/notes.txt", True), ("step_2", False)],
    ids=["beside-its-files", "among-its-files", "no-file-list"],
)
def test_force_never_deletes_what_no_save_wrote(tmp_path, where, listed):
    run = tmp_path / "run"
    fe.save_checkpoint(run, small_tree())
    if not listed:
        _drop_file_list(run)
    (run / where).parent.mkdir(parents=True, exist_ok=True)
    (run / where).write_text("mine")
    before = _files(run)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(
            f"directory: the checkpoint {str(run)!r} also holds {where}, which no save wrote, "
            "and force=True deletes only what a save wrote; move that away first"
        ),
    ):
        fe.save_checkpoint(run, jax.tree.map(lambda a: a + 1, small_tree()), force=True)
    assert _files(run) == before
    os.remove(run / where)
    fe.save_checkpoint(run, jax.tree.map(lambda a: a + 1, small_tree()), force=True)
    assert restored_value(run, small_tree()) == 1.0


def test_a_checkpoint_without_a_file_list_is_still_replaced(tmp_path):
    run = tmp_path / "run"
    fe.save_checkpoint(run, small_tree())
    _drop_file_list(run)
    fe.save_checkpoint(run, jax.tree.map(lambda a: a + 1, small_tree()), force=True)
    assert restored_value(run, small_tree()) == 1.0


def test_an_abstract_mesh_is_refused_in_target_and_shardings(tmp_path):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    abstract = NamedSharding(fe.create_mesh((1, 8, 1, 1, 1)).abstract_mesh, P("fsdp"))
    message = (
        "{argument}: the leaf 'w' has a NamedSharding on an AbstractMesh {{'dp': 1, 'fsdp': 8, "
        "'ep': 1, 'tp': 1, 'sp': 1}}, which has no devices to restore onto; build the shardings "
        "on a concrete jax.sharding.Mesh"
    )
    target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=abstract)}
    with pytest.raises(fe.EscaleTypeError, match=re.escape(message.format(argument="target"))):
        fe.restore_checkpoint(tmp_path / "c", target)
    with pytest.raises(fe.EscaleTypeError, match=re.escape(message.format(argument="shardings"))):
        fe.restore_checkpoint(tmp_path / "c", tree, shardings={"w": abstract})


def test_a_module_is_refused_where_its_state_belongs(tmp_path):
    import flax.linen as nn
    from flax import nnx

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


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (P(None, "fsdp"), "splits dimension 1 of shape (8, 2) into 8 parts, which do not divide"),
        (P(None, None, "fsdp"), "has 3 entries for the 2 dimensions of shape (8, 2)"),
    ],
)
def test_shardings_that_do_not_fit_name_the_argument_and_leaf(tmp_path, spec, message):
    tree = small_tree()
    fe.save_checkpoint(tmp_path / "c", tree)
    sharding = NamedSharding(fe.create_mesh((1, 8, 1, 1, 1)), spec)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape("shardings: the sharding of the leaf 'w': ") + ".*" + re.escape(message),
    ):
        fe.restore_checkpoint(tmp_path / "c", tree, shardings=sharding)


def test_a_target_leaf_without_a_named_sharding_is_named(tmp_path):
    fe.save_checkpoint(tmp_path / "c", small_tree())
    with pytest.raises(
        fe.EscaleError,
        match=re.escape("restore_checkpoint: the target leaf 'w' of shape (8, 2) has sharding"),
    ):
        fe.restore_checkpoint(tmp_path / "c", {"w": np.zeros((8, 2), np.float32)})


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


def test_an_unreadable_checkpoint_is_a_clear_error(tmp_path, request):
    if not permission_bits_apply(request):
        return
    fe.save_checkpoint(tmp_path / "c", small_tree())
    os.chmod(tmp_path / "c", 0o000)
    try:
        assert not os.access(tmp_path / "c", os.R_OK)  # the bits apply to this process
        with pytest.raises(
            fe.EscaleError,
            match=re.escape(
                f"directory: cannot read the checkpoint {str(tmp_path / 'c')!r}: Permission denied"
            ),
        ):
            fe.restore_checkpoint(tmp_path / "c", small_tree())
        with pytest.raises(
            fe.EscaleError,
            match=re.escape(
                f"directory: cannot replace the checkpoint {str(tmp_path / 'c')!r}: Permission "
                "denied"
            ),
        ):
            fe.save_checkpoint(tmp_path / "c", small_tree(), force=True)
    finally:
        os.chmod(tmp_path / "c", 0o700)
    assert restored_value(tmp_path / "c", small_tree()) == 0.0


def test_an_nnx_state_with_rng_keys_round_trips(tmp_path):
    # Keys are stored as their key data, and the counts live on one device, unsharded.
    from flax import nnx

    model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    model.rngs()  # the count moves on: a value worth restoring
    fe.save_checkpoint(tmp_path / "c", nnx.state(model))
    fresh = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=9))
    restored = fe.restore_checkpoint(tmp_path / "c", nnx.state(fresh))
    nnx.update(fresh, restored)
    key, saved_key = fresh.rngs.key.get_value(), model.rngs.key.get_value()
    assert key.dtype == saved_key.dtype
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(saved_key))
    assert int(fresh.rngs.count.get_value()) == 1


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
