"""Plans of hand-written trees of abstract arrays through ``build_plan``, for the plan's tests."""

import warnings

import jax
import jax.numpy as jnp

from flax_escale.plan import build_plan

HM = ("hidden_state", "mlp_intermediate")


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def plan_of(mesh, tree, annotations, **kwargs):
    """Plans ``tree`` (nested dicts of ShapeDtypeStruct); ``annotations`` maps paths."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    items = []
    for keys, leaf in flat:
        path = "/".join(str(k.key) for k in keys)
        items.append((path, leaf, annotations.get(path)))
    return build_plan(treedef, items, mesh, **kwargs)


def quiet_plan(mesh, tree, annotations, **kwargs):
    """:func:`plan_of`, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return plan_of(mesh, tree, annotations, **kwargs)
