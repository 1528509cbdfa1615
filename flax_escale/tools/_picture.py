"""The picture of a layout: which block of an array each device holds.

``layout_picture`` draws one array (of a plan, before anything exists, or a live array) as a
grid over the mesh. It is data first (``LayoutPicture.devices``), with a ``rich`` rendering for
the terminal, plain text for logs and a treescope node for notebooks; the blocks come from
:func:`~flax_escale.sharding._measure.device_blocks`, the one place that places them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from rich.console import Group
from rich.text import Text
from treescope import rendering_parts

from flax_escale import _checks as check
from flax_escale._specs import mesh_text
from flax_escale._tables import FittedTable
from flax_escale._units import format_bytes
from flax_escale.errors import EscaleError, EscaleTypeError, NoMeshError
from flax_escale.plan import PlanEntry, ShardingPlan
from flax_escale.sharding._measure import device_blocks, device_ids
from flax_escale.tools._blocks import DeviceBlock, blocks_part

__all__ = ["LayoutPicture", "layout_picture", "picture_part"]

# Replicas share a block and so a colour; distinct blocks cycle through these.
_PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


@dataclasses.dataclass(frozen=True)
class LayoutPicture:
    """Which block of one array each device of a mesh holds.

    Print it with ``rich`` for a grid over the mesh axes (devices holding the same block share
    a colour), ``str()`` it for plain text; in a notebook treescope draws it (see
    :func:`~flax_escale.tools.register_treescope`).

    Attributes:
        path: The array's path in its plan, or ``None``.
        shape: The array's shape.
        dtype: Its dtype.
        spec: Its ``PartitionSpec``.
        mesh_shape: ``{axis: size}`` of the mesh.
        devices: One :class:`DeviceBlock` per device, in mesh order.
    """

    path: str | None
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: PartitionSpec
    mesh_shape: dict[str, int]
    devices: tuple[DeviceBlock, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def max_device_bytes(self) -> int:
        """Bytes of the fullest device's block."""
        return max(d.nbytes for d in self.devices)

    @property
    def ideal_device_bytes(self) -> float:
        """The whole array over the devices, what each would hold if it were split evenly."""
        return self.nbytes / len(self.devices)

    def title(self) -> str:
        """One line: path, dtype, shape, spec and mesh."""
        dims = ", ".join(map(str, self.shape))
        name = f"{self.path}: " if self.path is not None else ""
        return f"{name}{self.dtype}[{dims}] {self.spec} on mesh ({mesh_text(self.mesh_shape)})"

    def share_text(self) -> str:
        """The bytes per device against the whole array and the ideal share."""
        ideal = self.ideal_device_bytes
        ratio = self.max_device_bytes / ideal if ideal else 1.0
        return (
            f"{format_bytes(self.max_device_bytes)} per device of {format_bytes(self.nbytes)} "
            f"({ratio:.2f}x the ideal share, {format_bytes(ideal)})"
        )

    def replica_groups(self) -> list[tuple[int, ...]]:
        """The ids of the devices holding each distinct block, blocks in mesh order.

        One group of every device for a replicated array; one device per group for an array
        split over every mesh axis.
        """
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for d in self.devices:
            groups.setdefault(d.block, []).append(d.device_id)
        return [tuple(ids) for ids in groups.values()]

    def position_text(self, device: DeviceBlock) -> str:
        """``device``'s place on the mesh axes of size above 1 (``fsdp=2 tp=1``)."""
        return " ".join(f"{a}={device.coords[a]}" for a in self._split_axes()) or "-"

    def describe(self) -> str:
        """Plain text for logs: the title, the share, then one line per device.

        Example:
            >>> import numpy as np
            >>> from jax.sharding import NamedSharding, PartitionSpec
            >>> import jax
            >>> import flax_escale as fe
            >>> from flax_escale.tools import layout_picture
            >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
            >>> x = jax.ShapeDtypeStruct((8, 6), np.float32,
            ...     sharding=NamedSharding(mesh, PartitionSpec(None, "tp")))
            >>> print(layout_picture(x).describe())  # doctest: +NORMALIZE_WHITESPACE
            float32[8, 6] P(None, 'tp') on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)
            96 B per device of 192 B (4.00x the ideal share, 24 B)
            device  position     block    bytes
            0       fsdp=0 tp=0  [:, 0:3]  96 B
            1       fsdp=0 tp=1  [:, 3:6]  96 B
            2       fsdp=1 tp=0  [:, 0:3]  96 B
            3       fsdp=1 tp=1  [:, 3:6]  96 B
            4       fsdp=2 tp=0  [:, 0:3]  96 B
            5       fsdp=2 tp=1  [:, 3:6]  96 B
            6       fsdp=3 tp=0  [:, 0:3]  96 B
            7       fsdp=3 tp=1  [:, 3:6]  96 B
        """
        return "\n".join([self.title(), self.share_text(), self._device_lines()])

    def _device_lines(self) -> str:
        # One line per device: its id, place on the mesh, block and bytes.
        rows = [("device", "position", "block", "bytes")]
        rows += [
            (
                str(d.device_id),
                self.position_text(d),
                d.block_text(self.shape),
                format_bytes(d.nbytes),
            )
            for d in self.devices
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            "  ".join([*(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)), row[3]])
            for row in rows
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def table(self) -> FittedTable:
        """The grid as a ``rich`` table: rows and columns are mesh positions.

        The mesh axes of size above 1 are split in two: the first half numbers the rows, the
        rest the columns. Each cell shows the device id, its block and its bytes, coloured by
        block, so replicas share a colour. Where the grid is wider than the console, a line
        per device is printed instead, as :meth:`describe` gives them.
        """
        axes = self._split_axes()
        row_axes, column_axes = axes[: (len(axes) + 1) // 2], axes[(len(axes) + 1) // 2 :]
        rows: dict[tuple[int, ...], dict[tuple[int, ...], DeviceBlock]] = {}
        for d in self.devices:
            row = tuple(d.coords[a] for a in row_axes)
            rows.setdefault(row, {})[tuple(d.coords[a] for a in column_axes)] = d
        columns = sorted({key for cells in rows.values() for key in cells})
        colours = {
            device: _PALETTE[i % len(_PALETTE)]
            for i, group in enumerate(self.replica_groups())
            for device in group
        }
        table = FittedTable(show_lines=True, plain=self._device_lines)
        table.add_column(" ".join(row_axes), wrap=False)
        for key in columns:
            table.add_column(_position(column_axes, key) or "devices", justify="center", wrap=False)
        for row_key in sorted(rows):
            cells = [
                Text(
                    f"{d.device_id}\n{d.block_text(self.shape)}\n{format_bytes(d.nbytes)}",
                    style=colours[d.device_id],
                )
                for d in (rows[row_key][key] for key in columns)
            ]
            table.add_row(_position(row_axes, row_key), *cells)
        return table

    def __rich__(self) -> Group:
        return Group(Text(self.title()), self.table(), Text(self.share_text()))

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        del subtree_renderer
        return picture_part(self, path)

    def _split_axes(self) -> list[str]:
        return [axis for axis, size in self.mesh_shape.items() if size > 1]


def picture_part(picture: LayoutPicture, path: str | None, expand_state: Any = None) -> Any:
    """A :class:`LayoutPicture` as a treescope node: its title, treescope's drawing, its text.

    The drawing is treescope's ``render_array_sharding``, fed the picture's blocks; it is left
    out where it cannot apply (blocks of unequal length, from padding; a scalar).
    """
    lines = picture.describe().splitlines()
    drawing = blocks_part(picture.shape, picture.devices)
    children = [rendering_parts.text(lines[1]), *([drawing] if drawing is not None else [])]
    children += [rendering_parts.text(line) for line in lines[2:]]
    return rendering_parts.build_custom_foldable_tree_node(
        label=rendering_parts.abbreviation_color(rendering_parts.text(lines[0])),
        contents=rendering_parts.fold_condition(
            expanded=rendering_parts.indented_children(children)
        ),
        path=path,
        expand_state=expand_state or rendering_parts.ExpandState.EXPANDED,
    )


def _position(axes: list[str], key: tuple[int, ...]) -> str:
    return " ".join(f"{a}={i}" for a, i in zip(axes, key, strict=True))


def layout_picture(
    x: Any, mesh: Mesh | AbstractMesh | None = None, *, path: str | None = None
) -> LayoutPicture:
    """Which block of an array each device holds, as data, a ``rich`` grid and plain text.

    Nothing needs to exist: a plan's array (``plan_sharding`` only traces the model) is drawn
    from its shape and spec. Any rank, a spec that does not divide its dimension (the last
    blocks are short, as XLA pads them) and replicated arrays are drawn as laid out.

    Args:
        x: A :class:`~flax_escale.ShardingPlan` (with ``path``), one of its
            :class:`~flax_escale.plan.PlanEntry`, a ``jax.Array`` or a ``jax.ShapeDtypeStruct``
            (either with a ``NamedSharding``, or with ``mesh`` given: replicated on it).
        mesh: The mesh; defaults to the plan's or the sharding's. Needed for a plan entry.
        path: The array of the plan to draw.

    Returns:
        A :class:`LayoutPicture`.

    Raises:
        EscaleTypeError: If ``x`` is none of these, ``mesh`` is not a mesh or ``path`` not a
            string.
        EscaleError: If ``path`` is missing for a plan, not in it (close paths are listed) or
            given for anything else, or the spec cannot exist on ``mesh``.
        NoMeshError: If ``x`` carries no ``NamedSharding`` and no ``mesh`` is given.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> from jax.sharding import NamedSharding, PartitionSpec
        >>> import flax_escale as fe
        >>> from flax_escale.tools import layout_picture
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
        >>> x = jax.ShapeDtypeStruct((10, 4), np.float32,
        ...     sharding=NamedSharding(mesh, PartitionSpec("fsdp")))
        >>> picture = layout_picture(x)
        >>> [(d.device_id, d.block_text(picture.shape), d.nbytes) for d in picture.devices[::2]]
        [(0, '[0:3, :]', 48), (2, '[3:6, :]', 48), (4, '[6:9, :]', 48), (6, '[9:10, :]', 16)]
    """
    mesh = check.optional_mesh(mesh)
    if path is not None and not isinstance(path, str):
        raise EscaleTypeError(
            f"layout_picture: path must be a string, got {check.describe(path)}; pass one of "
            "[e.path for e in plan], e.g. 'params/kernel'."
        )
    if isinstance(x, ShardingPlan):
        entry = _entry_at(x, path)
        return _picture(entry.path, entry.shape, entry.dtype, entry.spec, mesh or x.mesh)
    if path is not None:
        raise EscaleError(
            f"layout_picture: path={path!r} picks an array of a ShardingPlan, but x is "
            f"{check.describe(x)}; drop path=, or pass the plan."
        )
    if isinstance(x, PlanEntry):
        if mesh is None:
            raise NoMeshError(
                f"layout_picture: the plan entry {x.path!r} carries no mesh; pass mesh=plan.mesh, "
                "or pass the plan itself with path=."
            )
        return _picture(x.path, x.shape, x.dtype, x.spec, mesh)
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        raise EscaleTypeError(
            f"layout_picture: x must be a ShardingPlan (with path=), a PlanEntry, a jax.Array or "
            f"a jax.ShapeDtypeStruct, got {check.describe(x)}; pass e.g. "
            "layout_picture(plan, path='params/kernel')."
        )
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec, mesh = sharding.spec, mesh or sharding.mesh
    elif mesh is not None:
        spec = PartitionSpec()
    else:
        raise NoMeshError(
            f"layout_picture: x ({check.describe(x)}) has no NamedSharding (it has "
            f"{check.describe(sharding)}) and no mesh was given; pass mesh= to draw it "
            "replicated, or place it with jax.device_put(x, NamedSharding(mesh, spec))."
        )
    return _picture(None, tuple(x.shape), np.dtype(x.dtype), spec, mesh)


def _entry_at(plan: ShardingPlan, path: str | None) -> PlanEntry:
    paths = [e.path for e in plan]
    if path is None:
        raise EscaleError(
            f"layout_picture: x is a plan of {len(paths)} arrays; pass path= to pick one, "
            f"e.g. {paths[:3]}."
        )
    for entry in plan:
        if entry.path == path:
            return entry
    close = difflib.get_close_matches(path, paths, n=5, cutoff=0.5) or paths[:5]
    raise EscaleError(
        f"layout_picture: path={path!r} is not in the plan; close paths: {close} (the plan has "
        f"{len(paths)} arrays; [e.path for e in plan] lists them)."
    )


def _picture(
    path: str | None,
    shape: tuple[int, ...],
    dtype: Any,
    spec: PartitionSpec,
    mesh: Mesh | AbstractMesh,
) -> LayoutPicture:
    check.spec_on(mesh, spec, "layout_picture: the spec")
    if len(spec) > len(shape):
        raise EscaleError(
            f"layout_picture: the spec {spec} has {len(spec)} entries for the {len(shape)} "
            f"dimensions of shape {shape}; give at most one entry per dimension."
        )
    ids = device_ids(mesh)
    names = list(mesh.axis_names)
    coords = {
        int(ids[at]): dict(zip(names, map(int, at), strict=True)) for at in np.ndindex(ids.shape)
    }
    itemsize = np.dtype(dtype).itemsize
    devices = tuple(
        DeviceBlock(
            device_id=device,
            coords=coords[device],
            block=block,
            nbytes=math.prod(stop - start for start, stop in block) * itemsize,
        )
        for device, block in device_blocks(shape, spec, mesh)
    )
    return LayoutPicture(path, shape, np.dtype(dtype), spec, dict(mesh.shape), devices)
