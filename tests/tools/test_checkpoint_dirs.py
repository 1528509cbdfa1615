"""Where a checkpoint lives on disk (``flax_escale/tools/_checkpoint_dirs.py``).

What an interrupted save leaves is recovered or cleaned by the next save, what is not a
checkpoint is named as such on restore, and a save replaces, deletes or writes into nothing the
library did not create: not a file, a directory that is not a checkpoint, what no save wrote, a
reserved name, or a place inside a checkpoint.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from support.checkpoints import restored_value, small_tree
from support.permissions import permission_bits_apply

import flax_escale as fe


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
    from flax_escale.tools import _checkpoint_dirs

    path = tmp_path / "c"
    fe.save_checkpoint(path, small_tree())
    before = _files(path)
    # As for a user without root: this suite may run as root, whom permission bits never stop.
    monkeypatch.setattr(_checkpoint_dirs.os, "access", lambda p, mode: os.fspath(p) != str(path))
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
