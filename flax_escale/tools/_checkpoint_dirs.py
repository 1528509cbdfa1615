"""Where a checkpoint lives on disk: what a save may replace, delete or write into.

A save writes ``<directory>.flax-escale-tmp`` and swaps it in through
``<directory>.flax-escale-old``; these names are reserved, and only they are ever deleted beside
a checkpoint. Each save records the files it wrote (with the checksums), so that ``force=True``
deletes nothing else, and no save goes inside a checkpoint, whose next save would delete it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

from flax_escale.errors import EscaleError
from flax_escale.tools._checksum import ALGORITHM

__all__ = [
    "OLD",
    "TMP",
    "check_destination",
    "read_record",
    "readable_checkpoint",
    "recover",
    "refuse_inside_a_checkpoint",
    "refuse_reserved",
    "write_record",
]

TMP = ".flax-escale-tmp"  # the new checkpoint while it is written
OLD = ".flax-escale-old"  # the previous one between the two renames of a swap
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's own directory while it writes
_PROBE = ".flax-escale-probe-"  # made and removed at once: is the destination writable?
_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")
_CHECKSUMS = "flax_escale_checksums.json"  # the saved arrays' checksums, by leaf path


def _leftovers(path: str) -> list[str]:
    """What interrupted saves of ``path`` left beside it: the very directories a save makes."""
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:  # missing, not a directory or unreadable: the save or restore says which
        return []
    # Exactly the names a save makes: a sibling that merely begins like them is not ours.
    ours = re.compile(
        "|".join(
            [
                re.escape(base + TMP),
                re.escape(base + OLD),
                re.escape(base + TMP + _ORBAX_TMP) + r"(-\d+)?",
                re.escape(base + _PROBE) + r"[a-z0-9_]{8}",  # tempfile's random suffix
            ]
        )
    )
    return sorted(os.path.join(parent, n) for n in names if ours.fullmatch(n))


def _is_reserved(path: str) -> bool:
    base = os.path.basename(path)
    return base.endswith((TMP, OLD)) or _ORBAX_TMP in base


def _is_checkpoint(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, marker)) for marker in _MARKERS)


def refuse_inside_a_checkpoint(path: str) -> None:
    """Refuses a save into a checkpoint, or into a save's temporary directory, at any depth.

    The next save of that checkpoint (with ``force=True``) would have to delete it, and the
    one of a temporary directory's checkpoint deletes it without asking.
    """
    folder, above = os.path.dirname(path), path
    while folder != above:
        if _is_checkpoint(folder):
            raise EscaleError(
                f"directory: {path!r} is inside the checkpoint {folder!r}, whose next save "
                "would have to replace it; save each checkpoint beside the others, e.g. "
                f"{os.path.join(os.path.dirname(folder), os.path.basename(path))!r}, or in a "
                "folder that is not a checkpoint."
            )
        if _is_reserved(folder):
            raise EscaleError(
                f"directory: {path!r} is inside {folder!r}, which is named like the temporary "
                "directories a save makes, which the next save beside it deletes; choose a "
                "path outside it."
            )
        folder, above = os.path.dirname(folder), folder


def refuse_reserved(path: str) -> None:
    if _is_reserved(path):
        raise EscaleError(
            f"directory: {path!r} is named like the temporary directories a save makes "
            f"(names ending in {TMP!r} or {OLD!r}, or holding {_ORBAX_TMP!r}), which the "
            "next save beside it would delete; choose another name."
        )


def check_destination(path: str, force: bool) -> None:
    """Refuses, before anything is written, a save that could not end with a checkpoint."""
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise EscaleError(
                f"directory: {path!r} is a file, not a checkpoint directory; save_checkpoint "
                "writes a directory and never replaces a file: choose another path."
            )
        if not force:
            raise EscaleError(
                f"checkpoint directory {path!r} exists; pass force=True to overwrite."
            )
        names = _listing(path, "directory: cannot replace the checkpoint")
        if names and not any(marker in names for marker in _MARKERS):
            raise EscaleError(
                f"directory: {path!r} is not a checkpoint (it holds {_shown(names)}), and "
                "force=True replaces only a checkpoint; choose another path, or move its "
                "contents away yourself."
            )
        foreign = _not_written_by_a_save(path, names)
        if foreign:
            raise EscaleError(
                f"directory: the checkpoint {path!r} also holds {_shown(foreign)}, which no "
                "save wrote, and force=True deletes only what a save wrote; move that away "
                "first, or save elsewhere."
            )
        for folder, _, _ in os.walk(path):
            if not os.access(folder, os.W_OK | os.X_OK):
                raise EscaleError(
                    f"directory: cannot replace the checkpoint {path!r}: {folder!r} is "
                    "read-only, so the old checkpoint could not be deleted once the new one is "
                    "in place; make it writable, or save elsewhere."
                )
    parent = os.path.dirname(path)
    existing = parent
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise EscaleError(
            f"directory: cannot write the checkpoint {path!r}: {existing!r} is a file, not a "
            "directory; choose a path whose parents are directories."
        )
    try:
        os.makedirs(parent, exist_ok=True)
        # A directory made and removed: whether the new checkpoint can be written here at
        # all, before orbax's writer threads start (on an error they never end).
        os.rmdir(tempfile.mkdtemp(prefix=os.path.basename(path) + _PROBE, dir=parent))
    except OSError as error:
        raise EscaleError(
            f"directory: cannot write the checkpoint {path!r}: {error.strerror or error} "
            f"({error.filename or parent!r}); give a directory on a writable file system."
        ) from None


def _shown(names: list[str]) -> str:
    return ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")


def _listing(folder: str, doing: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as error:
        raise EscaleError(
            f"{doing} {folder!r}: {error.strerror or error}; make it readable, or give another "
            "directory."
        ) from None


def _contents(folder: str) -> list[str]:
    """Every file and directory below ``folder``, by its path relative to it."""
    found = []
    for parent, dirs, files in os.walk(folder):
        where = os.path.relpath(parent, folder)
        found += [os.path.normpath(os.path.join(where, name)) for name in dirs + files]
    return found


# What orbax and a save write at the top of a checkpoint, for one saved before the record
# listed its files (or by orbax directly).
_WRITTEN = re.compile(
    r"_CHECKPOINT_METADATA|_METADATA|_sharding|commit_success\.txt|manifest\.ocdbt"
    r"|ocdbt\.process_\d+|array_metadatas|d|descriptor|" + re.escape(_CHECKSUMS)
)


def _not_written_by_a_save(path: str, names: list[str]) -> list[str]:
    """What the checkpoint at ``path`` holds that no save wrote (topmost entries only)."""
    try:
        record = read_record(path)
    except (OSError, ValueError):
        record = None  # then what orbax and a save write at the top is all that is known
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list):
        return [name for name in names if not _WRITTEN.fullmatch(name)]
    written = set(files)
    foreign = {name for name in _contents(path) if name not in written}
    return sorted(name for name in foreign if os.path.dirname(name) not in foreign)


def recover(path: str) -> None:
    """Puts the directories an interrupted save left back to one whole checkpoint at ``path``.

    A save swaps by renaming ``path`` to ``<path>.flax-escale-old``, then the complete
    ``<path>.flax-escale-tmp`` to ``path``. Killed between the two, ``path`` is missing and the
    old checkpoint is renamed back; any other leftover is incomplete or superseded and deleted.
    """
    old = path + OLD
    if not os.path.exists(path) and os.path.isdir(old):
        os.rename(old, path)
    for leftover in _leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)


def readable_checkpoint(path: str) -> str:
    """The directory holding the whole checkpoint saved at ``path``, or a clear error."""
    base = os.path.basename(path)
    if TMP in base or _ORBAX_TMP in base:
        raise EscaleError(
            f"incomplete checkpoint, left by an interrupted save at {path!r}; restore the "
            "checkpoint it was saving to instead (the next save deletes this directory)."
        )
    if not os.path.exists(path) and os.path.isdir(path + OLD):
        path += OLD  # killed between the two renames of a swap: the old checkpoint is whole
    if not os.path.exists(path):
        leftovers = _leftovers(path)
        found = f"; an interrupted save left only {leftovers} (incomplete)" if leftovers else ""
        raise EscaleError(f"no checkpoint at {path!r}: the directory does not exist{found}.")
    if not os.path.isdir(path):
        raise EscaleError(f"not a checkpoint: {path!r} is a file, not a checkpoint directory.")
    names = _listing(path, "directory: cannot read the checkpoint")
    if not names:
        raise EscaleError(f"not a checkpoint: {path!r} is an empty directory.")
    if not any(marker in names for marker in _MARKERS):
        raise EscaleError(
            f"not a checkpoint: {path!r} holds no checkpoint metadata ({', '.join(_MARKERS)}); "
            "give the directory save_checkpoint wrote."
        )
    return path


def write_record(directory: str, sums: dict[str, int | None]) -> None:
    # The checksums, and every file and directory the save wrote: force=True deletes nothing
    # else.
    files = sorted([*_contents(directory), _CHECKSUMS])
    with open(os.path.join(directory, _CHECKSUMS), "w") as file:
        json.dump({"algorithm": ALGORITHM, "leaves": sums, "files": files}, file)


def read_record(path: str) -> Any:
    """What :func:`write_record` wrote in ``path``; ``None`` where it wrote nothing.

    Raises:
        OSError, ValueError: If the record is unreadable.
    """
    try:
        with open(os.path.join(path, _CHECKSUMS)) as file:
            return json.load(file)
    except FileNotFoundError:
        return None  # saved before checksums were kept, or by orbax directly
