"""The target a checkpoint is restored into, checked against what was saved.

A target leaf names the shape, dtype and sharding to restore into; here it is made abstract
(``jax.ShapeDtypeStruct`` with a ``NamedSharding`` on a concrete mesh), given other shardings
when the caller passes them, compared with the checkpoint's metadata leaf by leaf (structure,
shape, dtype, the kinds ``cast`` may convert between), read in the stored dtype and converted
after, so that the checksums see the bits that were saved.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax.core import meta
from jax.sharding import AbstractMesh, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from flax_escale import _checks as check
from flax_escale._paths import is_box, path_of, unbox
from flax_escale.errors import EscaleError, EscaleTypeError

__all__ = [
    "abstract_leaf",
    "as_stored",
    "cast_converted",
    "check_against_saved",
    "check_divisible",
    "container_difference",
    "converted_leaves",
    "describe_leaf",
    "stored_form",
    "with_shardings",
]


def abstract_leaf(key_path: Any, leaf: Any) -> Any:
    """A target leaf as the ``jax.ShapeDtypeStruct`` to restore into (others as they are)."""
    if not hasattr(leaf, "shape"):
        return leaf
    name, sharding = path_of(key_path), getattr(leaf, "sharding", None)
    if isinstance(sharding, SingleDeviceSharding):  # an array on one device: restored there
        sharding = NamedSharding(Mesh(np.array(list(sharding.device_set)), ("device",)), P())
    if not isinstance(sharding, NamedSharding):
        raise EscaleError(
            f"restore_checkpoint: the target leaf {name!r} of shape {leaf.shape} has sharding "
            f"{sharding!r}; give targets with NamedSharding (or pass shardings=)."
        )
    _concrete(sharding, "target", name)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _concrete(sharding: Any, argument: str, name: str) -> None:
    # An AbstractMesh names axes but no devices: there is nowhere to read the arrays into.
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
        raise EscaleTypeError(
            f"{argument}: the leaf {name!r} has a NamedSharding on an AbstractMesh "
            f"{dict(sharding.mesh.shape)}, which has no devices to restore onto; build the "
            "shardings on a concrete jax.sharding.Mesh (create_mesh(...)), e.g. "
            "plan_sharding(model, mesh, ...).shardings() with that mesh."
        )


def with_shardings(target: Any, shardings: Any) -> Any:
    """``target`` with its arrays' shardings replaced by ``shardings`` (boxes kept)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_box)
    leaves = [leaf for _, leaf in flat]
    if isinstance(shardings, NamedSharding):
        given = [shardings] * len(leaves)
    else:
        given = check.structure_like(shardings, target, "shardings", "target", is_leaf=is_box)
    for (key_path, leaf), sharding in zip(flat, given, strict=True):
        if not isinstance(sharding, NamedSharding):
            check.named_sharding(sharding, "shardings")
        name = path_of(key_path)
        _concrete(sharding, "shardings", name)
        shape = getattr(unbox(leaf), "shape", None)
        if shape is not None:
            check.sharding_fits(sharding, shape, f"shardings: the sharding of the leaf {name!r}")
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


def check_against_saved(path: str, abstract: Any, saved: Any, *, cast: bool) -> None:
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
                f"restore_checkpoint: leaf {name!r} is saved as {describe_leaf(have)} in {path!r} "
                f"but the target is {describe_leaf(want)}; shapes must match."
            )
        have_dtype = getattr(have, "dtype", None)
        if have_dtype is None or np.dtype(have_dtype) == np.dtype(want.dtype):
            continue
        if not cast:
            raise EscaleError(
                f"restore_checkpoint: leaf {name!r} is saved as {describe_leaf(have)} in {path!r} "
                f"but the target is {describe_leaf(want)}; pass cast=True to convert it."
            )
        if _kind(have_dtype) != _kind(want.dtype):
            raise EscaleError(
                f"restore_checkpoint: leaf {name!r} is saved as {describe_leaf(have)} in {path!r} "
                f"and the target is {describe_leaf(want)}: cast=True converts between types of "
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


def check_divisible(path: str, abstract: Any) -> None:
    """Names the first target leaf whose sharding does not fit its shape."""
    for name, leaf in _by_path(abstract).items():
        if isinstance(leaf, jax.ShapeDtypeStruct):
            check.sharding_fits(
                leaf.sharding, leaf.shape, f"restore_checkpoint: the target leaf {name!r}"
            )


def describe_leaf(leaf: Any) -> str:
    """``float32[8, 8]``: a leaf's dtype (or type) and shape, for messages."""
    return f"{getattr(leaf, 'dtype', type(leaf).__name__)}{list(getattr(leaf, 'shape', ()))}"


def container_difference(abstract: Any, saved: Any, where: str = "") -> str | None:
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
        found = container_difference(want[key], have[key], f"{where}/{key}".lstrip("/"))
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


def _by_path(tree: Any) -> dict[str, Any]:
    return {path_of(keys): leaf for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def converted_leaves(abstract: Any, saved: Any) -> set[str]:
    # The leaves cast converts (a converted leaf holds other bits than were saved).
    stored = _by_path(saved)
    return {
        name
        for name, want in _by_path(abstract).items()
        if getattr(stored.get(name), "dtype", None) is not None
        and hasattr(want, "dtype")
        and np.dtype(stored[name].dtype) != np.dtype(want.dtype)
    }


def stored_form(abstract: Any) -> Any:
    """The shapes and dtypes the files hold for ``abstract``: a PRNG key as its key data."""

    def stored(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key
        ):
            return jax.eval_shape(jax.random.key_data, leaf)
        return leaf

    return jax.tree.map(stored, abstract)


def as_stored(abstract: Any, saved: Any, converted: set[str]) -> Any:
    """``abstract`` with the saved dtype where ``cast`` converts: what the files hold."""
    stored = _by_path(saved)

    def as_saved(key_path: Any, leaf: Any) -> Any:
        name = path_of(key_path)
        if name not in converted:
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, stored[name].dtype, sharding=leaf.sharding)

    return jax.tree_util.tree_map_with_path(as_saved, abstract)


def cast_converted(restored: Any, abstract: Any, converted: set[str]) -> Any:
    """The leaves of ``restored`` named in ``converted``, in the target's dtype and sharding."""
    if not converted:
        return restored
    targets = _by_path(abstract)

    def convert(key_path: Any, leaf: Any) -> Any:
        name = path_of(key_path)
        if name not in converted:
            return leaf
        value = _astype(leaf, np.dtype(targets[name].dtype))
        leaf.delete()  # one leaf at a time: the saved dtype's copy goes as soon as it is cast
        return value

    return jax.tree_util.tree_map_with_path(convert, restored)


@functools.partial(jax.jit, static_argnums=1)
def _astype(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x.astype(dtype)  # elementwise: the result keeps x's sharding
