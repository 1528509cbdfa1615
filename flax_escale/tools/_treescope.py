"""Layouts in notebooks through treescope: pictures, plans, and arrays on Explicit meshes.

treescope draws an array by slicing its edges under ``jax.jit``. On a mesh with ``Explicit``
axes the slice's type keeps the array's sharding, and JAX refuses a slice whose length the
mesh axes do not divide (``ShardingTypeError``): every array treescope does not summarize on
the host (on CPU from 100,000 elements) fails to render. The arrays are drawn here from an
``Auto`` view of the same buffers (no copy). A :class:`~flax_escale.tools.LayoutPicture` draws
itself (:func:`~flax_escale.tools._picture.picture_part`); plans and arrays are drawn here,
through treescope's registry, with one picture per array.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from treescope import rendering_parts, type_registries
from treescope.external import jax_support

from flax_escale._units import format_bytes
from flax_escale.mesh import with_auto_axes
from flax_escale.plan import ShardingPlan
from flax_escale.tools._memory_bars import memory_bars
from flax_escale.tools._picture import layout_picture, picture_part

__all__ = ["plan_part", "register_treescope"]


_CHARARRAY = "The chararray class is deprecated"


def register_treescope() -> None:
    """Makes treescope draw plans, and arrays on ``Explicit`` meshes, with their layout.

    After it, ``treescope.render_to_html`` (and treescope's notebook display, e.g. after
    ``treescope.basic_interactive_setup()``) draws a :class:`~flax_escale.ShardingPlan` as its
    memory bars and one picture per array, and a ``jax.Array`` as treescope does plus, when it
    is split over several devices, a folded picture of its blocks. Arrays on meshes with
    ``Explicit`` axes, which treescope alone fails to draw from 100,000 elements, are read
    through an ``Auto`` view of the same buffers. A :class:`~flax_escale.tools.LayoutPicture`
    needs no registration. Calling it again changes nothing.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> import treescope
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> import flax_escale as fe
        >>> from flax_escale.tools import register_treescope
        >>> register_treescope()
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1), axis_types="explicit")
        >>> w = jax.device_put(np.zeros((512, 512), np.float32),
        ...     NamedSharding(mesh, PartitionSpec("fsdp", "tp")))
        >>> html = treescope.render_to_html(w, compressed=False)
        >>> "[128:256, 0:256]" in html, "128.00 KiB" in html
        (True, True)
    """
    # treescope installs its JAX support lazily, at its first rendering; done now, it cannot
    # later replace what is registered here. (Doing so, treescope 0.1.10 reads every public
    # name of numpy, chararray included, which numpy 2.5 deprecates: not the user's concern.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _CHARARRAY, DeprecationWarning)
        type_registries.update_registries_for_imports()
    type_registries.TREESCOPE_HANDLER_REGISTRY[jax.Array] = _render_array
    type_registries.NDARRAY_ADAPTER_REGISTRY[jax.Array] = _AutoViewAdapter()
    type_registries.TREESCOPE_HANDLER_REGISTRY[ShardingPlan] = _render_plan


def _auto_view(array: Any) -> Any:
    """``array`` on the ``Auto`` twin of its mesh, sharing its buffers; others as they are."""
    if isinstance(array, jax.core.Tracer) or array.is_deleted():
        return array
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding) or AxisType.Explicit not in sharding.mesh.axis_types:
        return array
    auto = NamedSharding(with_auto_axes(sharding.mesh), sharding.spec)
    shards = [shard.data for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, auto, shards)


class _AutoViewAdapter(jax_support.JAXArrayAdapter):
    """treescope's adapter for JAX arrays, reading values through :func:`_auto_view`."""

    def get_array_data_with_truncation(
        self, array: Any, mask: Any, edge_items_per_axis: tuple[int | None, ...]
    ) -> tuple[np.ndarray, np.ndarray]:
        view = _auto_view(array)
        return super().get_array_data_with_truncation(view, mask, edge_items_per_axis)

    def get_array_summary(self, array: Any, fast: bool) -> Any:
        return super().get_array_summary(_auto_view(array), fast)


def _render_array(node: Any, path: str | None, subtree_renderer: Any) -> Any:
    rendered = jax_support.render_jax_arrays(_auto_view(node), path, subtree_renderer)
    sharding = getattr(node, "sharding", None)
    if (
        rendered is NotImplemented
        or not isinstance(sharding, NamedSharding)
        or len(sharding.device_set) < 2
    ):
        return rendered
    folded = picture_part(layout_picture(node), None, rendering_parts.ExpandState.COLLAPSED)
    return rendering_parts.siblings_with_annotations(rendered, " ", folded)


def _render_plan(node: ShardingPlan, path: str | None, subtree_renderer: Any) -> Any:
    del subtree_renderer
    return plan_part(node, path)


def plan_part(plan: ShardingPlan, path: str | None) -> Any:
    """A plan as a treescope node: its memory bars, then a folded picture per array."""
    bars = memory_bars(plan)
    pictures = [
        picture_part(layout_picture(plan, path=e.path), None, rendering_parts.ExpandState.COLLAPSED)
        for e in plan
    ]
    label = (
        f"ShardingPlan: {len(plan)} arrays, {format_bytes(plan.nbytes)}, "
        f"{format_bytes(max(map(sum, bars.by_device.values())))} on the fullest device"
    )
    lines = [rendering_parts.text(line) for line in bars.describe().splitlines()]
    return rendering_parts.build_custom_foldable_tree_node(
        label=rendering_parts.text(label),
        contents=rendering_parts.fold_condition(
            expanded=rendering_parts.indented_children([*lines, *pictures])
        ),
        path=path,
        expand_state=rendering_parts.ExpandState.EXPANDED,
    )
