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

import os
import shutil
from typing import Any

import jax
from flax import linen, nnx
from jax.experimental import multihost_utils

from flax_escale import _checks as check
from flax_escale._paths import is_box, path_of, unbox
from flax_escale.errors import EscaleError, EscaleTypeError, MeshError
from flax_escale.mesh import peer_loss_as_mesh_error
from flax_escale.tools._checkpoint_dirs import (
    OLD,
    TMP,
    check_destination,
    read_record,
    readable_checkpoint,
    recover,
    refuse_inside_a_checkpoint,
    refuse_reserved,
    write_record,
)
from flax_escale.tools._checkpoint_target import (
    abstract_leaf,
    as_stored,
    cast_converted,
    check_against_saved,
    check_divisible,
    container_difference,
    converted_leaves,
    describe_leaf,
    stored_form,
    with_shardings,
)
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
    A save records every file it writes, and ``force=True`` refuses a checkpoint that holds
    anything else. A save inside a checkpoint (``run/step_2`` where ``run`` is one) is refused,
    since the next save of ``run`` would have to delete it. Where the checkpoint could not be
    written or swapped in, the save is refused before anything is written.

    The arrays may live on different sets of devices (a serving layout with some weights on a
    sub-mesh); their checksums are computed on each set apart.

    Args:
        directory: Where to write; must not exist unless ``force`` (its parents are created).
        tree: The arrays: a Flax ``TrainState``, ``nnx.state(model)`` (not the module), any
            pytree of them (not one array alone).
        force: Overwrite an existing checkpoint (or an empty directory), and nothing else.

    Raises:
        EscaleError: If ``directory`` exists and ``force`` is false; if it is a file, or a
            directory that holds something other than a checkpoint, or a checkpoint that also
            holds what no save wrote; if it is inside a checkpoint; if its name is reserved
            or holds a NUL character;
            or if it cannot be written (a read-only or missing file system, a parent that is
            a file) or replaced (a read-only checkpoint).
            If writing fails (a full disk, say), or an array of ``tree`` was deleted (donated
            to a jitted step).
        EscaleTypeError: If ``directory`` is not a path, ``tree`` is a module (NNX or Linen)
            or a single array, holds no array or an abstract one (``jax.ShapeDtypeStruct``),
            or ``force`` is not a bool.
    """
    path = os.path.abspath(check.path(directory, "directory"))
    _refuse_what_is_not_a_tree(
        tree, "tree", "save nnx.state(model) (restore it into nnx.state of a new one)"
    )
    check.tree_of_arrays(tree, "tree")
    force = check.flag(force, "force")
    _check_savable(tree)
    refuse_reserved(path)
    refuse_inside_a_checkpoint(path)
    _sync("flax_escale_save_start")  # every process has checked what is there before it changes
    if jax.process_index() == 0:
        recover(path)
    _sync("flax_escale_save_recovered")
    check_destination(path, force)
    tmp, old = path + TMP, path + OLD
    checkpointer = _orbax().StandardCheckpointer()
    try:
        with peer_loss_as_mesh_error(f"saving the checkpoint {path!r}"):
            sums = checksums(tree)  # every process: the arrays are global
            checkpointer.save(tmp, tree, force=True)
            checkpointer.wait_until_finished()
            if jax.process_index() == 0:
                write_record(tmp, sums)
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
            or ``jax.eval_shape`` of it with shardings). A ``NamedSharding`` must be on a
            concrete ``Mesh``; an array on one device restores onto that device.
        shardings: A tree of ``NamedSharding`` shaped like ``target`` (for example
            ``plan.shardings()`` of a ``ShardingPlan``), or one ``NamedSharding`` for every
            leaf, that replaces the target's own shardings.
        cast: Convert saved arrays whose dtype differs from the target's, within one kind
            (float32 into bfloat16, say); without it such a leaf is an error, and a conversion
            between kinds (float into int) always is. A converted leaf is read as saved,
            its checksum compared, and then converted.

    Returns:
        The restored tree, every array in its target sharding.

    Raises:
        EscaleError: If ``directory`` holds a NUL character, there is no complete checkpoint
            at it or it cannot be read, the target's structure, shapes or (without ``cast``)
            dtypes differ from the saved ones, a target leaf has no sharding, a sharding (the
            target's or from ``shardings``) does not fit its leaf's shape, ``shardings`` is not
            shaped like ``target``, or the restored values' checksums differ from the saved.
        EscaleTypeError: If ``directory`` is not a path, ``target`` is a module (NNX or Linen)
            or a single array or holds no array, a ``shardings`` leaf is not a
            ``NamedSharding``, a sharding is on an ``AbstractMesh``, or ``cast`` is not a bool.

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
    fix = "pass nnx.state(model), then put the result in with nnx.update(model, restored)"
    _refuse_what_is_not_a_tree(target, "target", fix)
    check.tree_of_arrays(target, "target")
    cast = check.flag(cast, "cast")
    if shardings is not None:
        target = with_shardings(target, shardings)
    path = readable_checkpoint(path)
    abstract = jax.tree_util.tree_map_with_path(abstract_leaf, target)
    checkpointer = _orbax().StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path).item_metadata.tree
    except Exception as err:  # orbax and tensorstore raise bare exceptions
        raise EscaleError(_damaged(path, err)) from None
    check_against_saved(path, stored_form(abstract), saved, cast=cast)
    check_divisible(path, abstract)
    converted = converted_leaves(stored_form(abstract), saved)
    try:
        with peer_loss_as_mesh_error(f"restoring the checkpoint {path!r}"):
            # Read as stored, so that the checksums see the saved bits; converted after.
            restored = checkpointer.restore(path, as_stored(abstract, saved, converted))
            _verify_checksums(path, restored)
    except (MeshError, EscaleError):  # a lost peer process, or data that is not what was saved
        raise
    except Exception as err:  # orbax and tensorstore raise bare exceptions
        difference = container_difference(abstract, saved)
        if difference is not None:
            raise EscaleError(
                f"restore_checkpoint: the target's containers do not match the checkpoint at "
                f"{path!r}: {difference}; restore into a tree of the kind that was saved."
            ) from None
        raise EscaleError(_damaged(path, err)) from None
    return cast_converted(restored, abstract, converted)


def _refuse_what_is_not_a_tree(value: Any, argument: str, fix: str) -> None:
    # A module is not its state: NNX modules flatten to another tree than nnx.state gives (a
    # checkpoint of one restores into neither), and a Linen module holds no arrays at all.
    # A lone array is not a tree either: orbax's standard checkpoints refuse one.
    if is_box(value) or hasattr(value, "shape"):
        raise EscaleTypeError(
            f"{argument}: got a single {'variable' if is_box(value) else 'array'} "
            f"{describe_leaf(unbox(value))}, where a checkpoint holds a tree of them; put it in a "
            "dict, e.g. {'w': " + argument + "}, to save and to restore alike."
        )
    if isinstance(value, nnx.Module):
        raise EscaleTypeError(
            f"{argument}: got the NNX module {type(value).__name__}, not its state; {fix}."
        )
    if isinstance(value, linen.Module):
        raise EscaleTypeError(
            f"{argument}: got the Linen module {type(value).__name__}, which holds no arrays; "
            "pass its variables (what model.init or init_sharded returned) or a TrainState."
        )


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


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


def _damaged(path: str, err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if len(first) > 240:
        first = first[:240] + "..."
    return (
        f"incomplete or damaged checkpoint at {path!r} (files missing or unreadable): "
        f"{type(err).__name__}: {first}"
    )


def _verify_checksums(path: str, restored: Any) -> None:
    """Names the leaves whose restored values are not the ones saved (when sums were kept)."""
    try:
        stored = read_record(path)
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
        if sums is not None and expected.get(name) not in (None, sums)
    ]
    if wrong:
        raise EscaleError(
            f"restore_checkpoint: the values restored for {wrong[:5]} from {path!r} differ "
            "from the ones saved (their checksums do not match): the checkpoint's data files "
            "were changed or damaged after the save (a flipped bit on disk, an incomplete "
            "copy). Restore an earlier checkpoint."
        )


def _orbax() -> Any:
    # orbax.checkpoint imports about 230 modules; imported here, on the first save or restore,
    # so that `import flax_escale` costs none of them.
    import orbax.checkpoint

    return orbax.checkpoint
