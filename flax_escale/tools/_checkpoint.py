"""Checkpoints saved from, and restored straight into, a sharded layout (orbax-checkpoint).

Saving writes, from each process, the shards its devices hold. Restoring reads, on each process,
only the stored chunks that overlap the shards its devices hold in the target layout, which may
be on a mesh of another shape than the one saved from. The stored chunks are the shards as
saved, so a target that cuts across them (columns of an array saved by rows, say) reads whole
chunks and keeps the part it needs. Nothing is gathered whole on one device either way.

Under ``jax.distributed`` every process calls :func:`save_checkpoint` and
:func:`restore_checkpoint` at the same point, with the same tree and the same directory, which
all processes must see (a shared file system or object store): orbax synchronizes the processes
inside each call, and the checkpoint is complete only once every process wrote its part.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from flax.core import meta
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError, MeshError
from flax_escale.mesh import peer_loss_as_mesh_error
from flax_escale.plan._paths import is_box, path_of
from flax_escale.tools._checksum import ALGORITHM, checksums

__all__ = ["restore_checkpoint", "save_checkpoint"]


def save_checkpoint(directory: str | os.PathLike, tree: Any, *, force: bool = False) -> None:
    """Saves a tree of (sharded) arrays, such as a train state, to ``directory``.

    The checkpoint is written beside ``directory`` (in ``<directory>.flax-escale-tmp``) and
    moved into place only once complete, so a save killed at any instant leaves either the
    previous checkpoint or the new one: :func:`restore_checkpoint` reads whichever is whole,
    and the next save clears what the interrupted one left.

    Nothing but a checkpoint is ever replaced, and only the directories a save of
    ``directory`` creates beside it (``<directory>.flax-escale-tmp``, its orbax temporary, and
    ``<directory>.flax-escale-old``) are ever deleted; names ending like them are reserved.
    Where the checkpoint could not be written or swapped in, the save is refused before
    anything is written.

    Args:
        directory: Where to write; must not exist unless ``force`` (its parents are created).
        tree: The arrays: a Flax ``TrainState``, ``nnx.state(model)``, any pytree.
        force: Overwrite an existing checkpoint (or an empty directory), and nothing else.

    Raises:
        EscaleError: If ``directory`` exists and ``force`` is false; if it is a file, or a
            directory that holds something other than a checkpoint; if its name is reserved
            or holds a NUL character;
            or if it cannot be written (a read-only or missing file system, a parent that is
            a file) or replaced (a read-only checkpoint).
            If writing fails (a full disk, say), or an array of ``tree`` was deleted (donated
            to a jitted step).
        EscaleTypeError: If ``directory`` is not a path, ``tree`` holds no array or an
            abstract one (``jax.ShapeDtypeStruct``), or ``force`` is not a bool.
    """
    path = os.path.abspath(check.path(directory, "directory"))
    check.tree_of_arrays(tree, "tree")
    force = check.flag(force, "force")
    _check_savable(tree)
    _refuse_reserved(path)
    _sync("flax_escale_save_start")  # every process has checked what is there before it changes
    if jax.process_index() == 0:
        _recover(path)
    _sync("flax_escale_save_recovered")
    _check_destination(path, force)
    tmp, old = path + _TMP, path + _OLD
    checkpointer = _orbax().StandardCheckpointer()
    try:
        with peer_loss_as_mesh_error(f"saving the checkpoint {path!r}"):
            sums = checksums(tree)  # every process: the arrays are global
            checkpointer.save(tmp, tree, force=True)
            checkpointer.wait_until_finished()
            if jax.process_index() == 0:
                _write_checksums(tmp, sums)
            _sync("flax_escale_save_written")  # the new checkpoint is complete on every process
    except MeshError:  # a lost peer process, said as such
        raise
    except Exception as err:  # orbax and tensorstore raise bare exceptions (a full disk, say)
        first = (str(err).strip().splitlines() or [""])[0][:240]
        raise EscaleError(
            f"could not write the checkpoint {path!r}: {type(err).__name__}: {first}. Nothing "
            f"was swapped in: the previous checkpoint there, if any, is whole (the next save "
            f"deletes the partial {os.path.basename(tmp)!r})."
        ) from None
    if jax.process_index() == 0:
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    _sync("flax_escale_save_swapped")


def restore_checkpoint(
    directory: str | os.PathLike, target: Any, *, shardings: Any = None, cast: bool = False
) -> Any:
    """Restores a checkpoint directly into the layout of ``target``.

    Args:
        directory: What :func:`save_checkpoint` wrote.
        target: A tree shaped like the saved one whose leaves are arrays or
            ``jax.ShapeDtypeStruct`` carrying the shardings to restore into (for example the
            state ``init_train_state`` or ``nnx.state(init_sharded(...))`` gives on the new mesh,
            or ``jax.eval_shape`` of it with shardings).
        shardings: A tree of ``NamedSharding`` shaped like ``target`` (for example
            ``plan.shardings()`` of a ``ShardingPlan``), or one ``NamedSharding`` for every
            leaf, that replaces the target's own shardings.
        cast: Convert saved arrays whose dtype differs from the target's, within one kind
            (float32 into bfloat16, say); without it such a leaf is an error, and a conversion
            between kinds (float into int) always is.

    Returns:
        The restored tree, every array in its target sharding.

    Raises:
        EscaleError: If ``directory`` holds a NUL character, there is no complete checkpoint
            at it, the target's structure, shapes or (without ``cast``) dtypes differ from the
            saved ones, or a target leaf has no sharding, or ``shardings`` is not shaped like
            ``target``.
        EscaleTypeError: If ``directory`` is not a path, ``target`` holds no array, a
            ``shardings`` leaf is not a ``NamedSharding``, or ``cast`` is not a bool.

    Example:
        >>> import os
        >>> import tempfile
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> from flax_escale import create_mesh, restore_checkpoint, save_checkpoint
        >>> saved_on = create_mesh((1, 8, 1, 1, 1))
        >>> rows = NamedSharding(saved_on, PartitionSpec("fsdp"))
        >>> w = jax.device_put(np.arange(64.0).reshape(8, 8), rows)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> save_checkpoint(path, {"w": w})
        >>> serve = create_mesh((2, 4), ("dp", "tp"))
        >>> columns = NamedSharding(serve, PartitionSpec(None, "tp"))
        >>> target = {"w": jax.ShapeDtypeStruct((8, 8), w.dtype, sharding=columns)}
        >>> restored = restore_checkpoint(path, target)["w"]
        >>> restored.sharding.spec, bool((restored == w).all())
        (P(None, 'tp'), True)
    """
    path = os.path.abspath(check.path(directory, "directory"))
    check.tree_of_arrays(target, "target")
    cast = check.flag(cast, "cast")
    if shardings is not None:
        target = _with_shardings(target, shardings)
    path = _readable_checkpoint(path)
    abstract = jax.tree.map(_abstract, target)
    checkpointer = _orbax().StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path).item_metadata.tree
    except Exception as err:  # orbax and tensorstore raise bare exceptions
        raise EscaleError(_damaged(path, err)) from None
    _check_against_saved(path, abstract, saved, cast=cast)
    _check_divisible(path, abstract)
    try:
        with peer_loss_as_mesh_error(f"restoring the checkpoint {path!r}"):
            restored = checkpointer.restore(path, abstract)
            _verify_checksums(path, restored, skip=_converted(abstract, saved))
            return restored
    except (MeshError, EscaleError):  # a lost peer process, or data that is not what was saved
        raise
    except Exception as err:  # orbax and tensorstore raise bare exceptions
        difference = _container_difference(abstract, saved)
        if difference is not None:
            raise EscaleError(
                f"restore_checkpoint: the target's containers do not match the checkpoint at "
                f"{path!r}: {difference}; restore into a tree of the kind that was saved."
            ) from None
        raise EscaleError(_damaged(path, err)) from None


def _with_shardings(target: Any, shardings: Any) -> Any:
    leaves, treedef = jax.tree.flatten(target, is_leaf=is_box)
    if isinstance(shardings, NamedSharding):
        given = [shardings] * len(leaves)
    else:
        given = check.structure_like(shardings, target, "shardings", "target", is_leaf=is_box)
    for sharding in given:
        if not isinstance(sharding, NamedSharding):
            check.named_sharding(sharding, "shardings")
    return treedef.unflatten(
        [
            _rebox(leaf, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
            for leaf, sharding in zip(leaves, given, strict=True)
        ]
    )


def _rebox(leaf: Any, value: jax.ShapeDtypeStruct) -> Any:
    # The box stays: its kind is part of the tree that was saved (an NNX state saves each
    # variable's value under ".../value"), so only the array inside it is replaced.
    if not is_box(leaf):
        return value
    if isinstance(leaf, meta.AxisMetadata):
        return leaf.replace_boxed(value)
    return leaf.replace(value)


_TMP = ".flax-escale-tmp"  # the new checkpoint while it is written
_OLD = ".flax-escale-old"  # the previous one between the two renames of a swap
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's own directory while it writes
_PROBE = ".flax-escale-probe-"  # made and removed at once: is the destination writable?
_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")
_CHECKSUMS = "flax_escale_checksums.json"  # the saved arrays' checksums, by leaf path


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _leftovers(path: str) -> list[str]:
    """What interrupted saves of ``path`` left beside it: the very directories a save makes."""
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # Exactly the names a save makes: a sibling that merely begins like them is not ours.
    ours = re.compile(
        "|".join(
            [
                re.escape(base + _TMP),
                re.escape(base + _OLD),
                re.escape(base + _TMP + _ORBAX_TMP) + r"(-\d+)?",
                re.escape(base + _PROBE) + r"[a-z0-9_]{8}",  # tempfile's random suffix
            ]
        )
    )
    return sorted(os.path.join(parent, n) for n in names if ours.fullmatch(n))


def _check_savable(tree: Any) -> None:
    """Refuses a tree with nothing to save, or whose arrays hold no values to save."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if not leaves:
        raise EscaleTypeError(
            f"tree: {check.describe(tree)} holds no array, so nothing would be saved; pass the "
            "state itself (a TrainState, nnx.state(model), a dict of arrays)."
        )
    for key_path, leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise EscaleTypeError(
                f"tree: the leaf {path_of(key_path)!r} is a jax.ShapeDtypeStruct {leaf.dtype}"
                f"{list(leaf.shape)}, which holds no values; save the arrays themselves (the "
                "state init_train_state or a step returns, not jax.eval_shape of it)."
            )
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise EscaleError(
                f"tree: the array at {path_of(key_path)!r} was deleted (donated to a jitted step, "
                "which reuses its memory); save the state the step returned instead."
            )


def _refuse_reserved(path: str) -> None:
    base = os.path.basename(path)
    if base.endswith((_TMP, _OLD)) or _ORBAX_TMP in base:
        raise EscaleError(
            f"directory: {path!r} is named like the temporary directories a save makes "
            f"(names ending in {_TMP!r} or {_OLD!r}, or holding {_ORBAX_TMP!r}), which the "
            "next save beside it would delete; choose another name."
        )


def _check_destination(path: str, force: bool) -> None:
    """Refuses, before anything is written, a save that could not end with a checkpoint."""
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise EscaleError(
                f"directory: {path!r} is a file, not a checkpoint directory; save_checkpoint "
                "writes a directory and never replaces a file: choose another path."
            )
        names = os.listdir(path)
        if not force:
            raise EscaleError(
                f"checkpoint directory {path!r} exists; pass force=True to overwrite."
            )
        if names and not any(marker in names for marker in _MARKERS):
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise EscaleError(
                f"directory: {path!r} is not a checkpoint (it holds {shown}), and force=True "
                "replaces only a checkpoint; choose another path, or move its contents away "
                "yourself."
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


def _recover(path: str) -> None:
    """Puts the directories an interrupted save left back to one whole checkpoint at ``path``.

    A save swaps by renaming ``path`` to ``<path>.flax-escale-old``, then the complete
    ``<path>.flax-escale-tmp`` to ``path``. Killed between the two, ``path`` is missing and the
    old checkpoint is renamed back; any other leftover is incomplete or superseded and deleted.
    """
    old = path + _OLD
    if not os.path.exists(path) and os.path.isdir(old):
        os.rename(old, path)
    for leftover in _leftovers(path):
        shutil.rmtree(leftover, ignore_errors=True)


def _readable_checkpoint(path: str) -> str:
    """The directory holding the whole checkpoint saved at ``path``, or a clear error."""
    base = os.path.basename(path)
    if _TMP in base or _ORBAX_TMP in base:
        raise EscaleError(
            f"incomplete checkpoint, left by an interrupted save at {path!r}; restore the "
            "checkpoint it was saving to instead (the next save deletes this directory)."
        )
    if not os.path.exists(path) and os.path.isdir(path + _OLD):
        path += _OLD  # killed between the two renames of a swap: the old checkpoint is whole
    if not os.path.exists(path):
        leftovers = _leftovers(path)
        found = f"; an interrupted save left only {leftovers} (incomplete)" if leftovers else ""
        raise EscaleError(f"no checkpoint at {path!r}: the directory does not exist{found}.")
    if not os.path.isdir(path):
        raise EscaleError(f"not a checkpoint: {path!r} is a file, not a checkpoint directory.")
    names = os.listdir(path)
    if not names:
        raise EscaleError(f"not a checkpoint: {path!r} is an empty directory.")
    if not any(marker in names for marker in _MARKERS):
        raise EscaleError(
            f"not a checkpoint: {path!r} holds no checkpoint metadata ({', '.join(_MARKERS)}); "
            "give the directory save_checkpoint wrote."
        )
    return path


def _damaged(path: str, err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if len(first) > 240:
        first = first[:240] + "..."
    return (
        f"incomplete or damaged checkpoint at {path!r} (files missing or unreadable): "
        f"{type(err).__name__}: {first}"
    )


def _by_path(tree: Any) -> dict[str, Any]:
    return {path_of(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _container_difference(abstract: Any, saved: Any, where: str = "") -> str | None:
    """Where the target's containers first differ from the saved ones, in words."""
    kinds = [_container(x) for x in (abstract, saved)]
    if kinds[0] is None or kinds[1] is None:
        return None
    (want_kind, want), (have_kind, have) = kinds
    at = f"at {where!r}" if where else "at the top"
    if want_kind != have_kind or list(want) != list(have):
        return (
            f"{at} the checkpoint holds a {have_kind} of {list(have)} where the target has a "
            f"{want_kind} of {list(want)}"
        )
    for key in want:
        found = _container_difference(want[key], have[key], f"{where}/{key}".lstrip("/"))
        if found:
            return found
    return None


def _container(node: Any) -> tuple[str, dict[str, Any]] | None:
    # A list or tuple by position, anything else JAX flattens by key: (kind, children by key).
    if isinstance(node, (list, tuple)):
        return "list", {str(i): child for i, child in enumerate(node)}
    if isinstance(node, dict):
        return "dict", {str(k): child for k, child in node.items()}
    return None


def _write_checksums(directory: str, sums: dict[str, int | None]) -> None:
    with open(os.path.join(directory, _CHECKSUMS), "w") as file:
        json.dump({"algorithm": ALGORITHM, "leaves": sums}, file)


def _converted(abstract: Any, saved: Any) -> set[str]:
    # The leaves cast converts (a converted leaf holds other bits than were saved).
    stored = _by_path(saved)
    return {
        name
        for name, want in _by_path(abstract).items()
        if getattr(stored.get(name), "dtype", None) is not None
        and hasattr(want, "dtype")
        and np.dtype(stored[name].dtype) != np.dtype(want.dtype)
    }


def _verify_checksums(path: str, restored: Any, *, skip: set[str]) -> None:
    """Names the leaves whose restored values are not the ones saved (when sums were kept)."""
    try:
        with open(os.path.join(path, _CHECKSUMS)) as file:
            stored = json.load(file)
    except FileNotFoundError:
        return  # saved before checksums were kept, or by orbax directly: nothing to compare
    except (OSError, ValueError) as err:
        raise EscaleError(
            f"restore_checkpoint: the checksums saved with {path!r} are unreadable ({err}); the "
            "checkpoint's files were changed after the save: restore an earlier checkpoint."
        ) from None
    if not isinstance(stored, dict) or stored.get("algorithm") != ALGORITHM:
        return  # another version's sums: not comparable
    expected = stored.get("leaves") or {}
    found = checksums(restored)
    wrong = [
        name
        for name, sums in found.items()
        if sums is not None and expected.get(name) not in (None, sums) and name not in skip
    ]
    if wrong:
        raise EscaleError(
            f"restore_checkpoint: the values restored for {wrong[:5]} from {path!r} differ "
            "from the ones saved (their checksums do not match): the checkpoint's data files "
            "were changed or damaged after the save (a flipped bit on disk, an incomplete "
            "copy). Restore an earlier checkpoint."
        )


def _check_divisible(path: str, abstract: Any) -> None:
    """Names the first target leaf whose sharding does not fit its shape."""
    for name, leaf in _by_path(abstract).items():
        if isinstance(leaf, jax.ShapeDtypeStruct):
            check.sharding_fits(
                leaf.sharding, leaf.shape, f"restore_checkpoint: the target leaf {name!r}"
            )


def _describe(leaf: Any) -> str:
    return f"{getattr(leaf, 'dtype', type(leaf).__name__)}{list(getattr(leaf, 'shape', ()))}"


def _check_against_saved(path: str, abstract: Any, saved: Any, *, cast: bool) -> None:
    """Names the tree path of the first leaf whose structure, shape or dtype disagrees."""
    targets, stored = _by_path(abstract), _by_path(saved)
    missing = [p for p in targets if p not in stored]
    extra = [p for p in stored if p not in targets]
    if missing or extra:
        raise EscaleError(
            f"restore_checkpoint: the target's tree does not match the checkpoint at {path!r}: "
            f"target leaves not saved: {missing[:5]}; saved leaves not in the target: "
            f"{extra[:5]}."
        )
    for name, want in targets.items():
        have = stored[name]
        if not hasattr(want, "shape") or getattr(have, "shape", None) is None:
            continue
        if tuple(want.shape) != tuple(have.shape):
            raise EscaleError(
                f"restore_checkpoint: leaf {name!r} is saved as {_describe(have)} in {path!r} "
                f"but the target is {_describe(want)}; shapes must match."
            )
        have_dtype = getattr(have, "dtype", None)
        if have_dtype is None or np.dtype(have_dtype) == np.dtype(want.dtype):
            continue
        if not cast:
            raise EscaleError(
                f"restore_checkpoint: leaf {name!r} is saved as {_describe(have)} in {path!r} "
                f"but the target is {_describe(want)}; pass cast=True to convert it."
            )
        if _kind(have_dtype) != _kind(want.dtype):
            raise EscaleError(
                f"restore_checkpoint: leaf {name!r} is saved as {_describe(have)} in {path!r} "
                f"and the target is {_describe(want)}: cast=True converts between types of "
                f"one kind (float32 into bfloat16, int32 into int8), and {_kind(have_dtype)} "
                f"into {_kind(want.dtype)} would change the values themselves (truncated, or "
                "the imaginary part dropped); restore it as saved and convert it yourself."
            )


def _kind(dtype: Any) -> str:
    # What cast may convert between: types of one kind (bfloat16 is numpy's "V" kind).
    found = np.dtype(dtype)
    if found.kind in "fV":
        return "floating point"
    return {"c": "complex", "b": "bool"}.get(found.kind, "integer")


def _abstract(leaf: Any) -> Any:
    if not hasattr(leaf, "shape"):
        return leaf
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise EscaleError(
            f"restore_checkpoint: a target leaf of shape {leaf.shape} has sharding {sharding!r}; "
            "give targets with NamedSharding (or pass shardings=)."
        )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _orbax() -> Any:
    # orbax.checkpoint imports about 230 modules; imported here, on the first save or restore,
    # so that `import flax_escale` costs none of them.
    import orbax.checkpoint

    return orbax.checkpoint
