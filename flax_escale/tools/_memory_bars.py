"""Memory bars: what every device holds of a whole plan, parameters apart from optimizer state.

``memory_by_device`` gives the figures, ``memory_bars`` draws them as one bar per device
against the ideal share, with a ``rich`` rendering for the terminal and plain text for logs;
the bytes come from :func:`~flax_escale.sharding._measure.elements_per_device`, which counts
the blocks that :func:`~flax_escale.sharding._measure.device_blocks` places.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from rich.console import Group
from rich.text import Text

from flax_escale import _checks as check
from flax_escale._specs import mesh_text
from flax_escale._tables import FittedTable
from flax_escale._units import format_bytes
from flax_escale.plan import ShardingPlan
from flax_escale.plan._leaves import _in_opt_state
from flax_escale.sharding._measure import device_ids, elements_per_device

__all__ = ["MemoryBars", "memory_bars", "memory_by_device"]


def memory_by_device(plan: ShardingPlan) -> dict[int, tuple[int, int]]:
    """What each device holds of ``plan``: ``{device id: (parameter bytes, optimizer bytes)}``.

    Optimizer state is every array under an ``opt_state`` path component; everything else
    counts as parameters. Blocks are exact (padding and replication included), so the sums
    are ``sharding_report(plan).bytes_per_device``.

    Raises:
        EscaleTypeError: If ``plan`` is not a ``ShardingPlan``.

    Example:
        >>> import jax
        >>> import numpy as np
        >>> import flax_escale as fe
        >>> from flax_escale.tools import memory_by_device
        >>> mesh = fe.create_mesh((1, 8, 1, 1, 1))
        >>> rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        >>> w = jax.ShapeDtypeStruct((8, 6), np.float32, sharding=rows)
        >>> state = {"params": {"w": w}, "opt_state": {"mu": w, "nu": w}}
        >>> memory_by_device(fe.sharding_report(state, show=False).plan)[0]  # a row of each
        (24, 48)
    """
    plan = check.instance(plan, ShardingPlan, "plan", "fe.plan_sharding(model, mesh, rng, x)")
    held = {int(device): [0, 0] for device in device_ids(plan.mesh).flat}
    for entry in plan:
        kind = 1 if _in_opt_state(entry.path) else 0
        itemsize = np.dtype(entry.dtype).itemsize
        for device, elements in elements_per_device(entry.path, entry.shape, entry.spec, plan.mesh):
            held[device][kind] += elements * itemsize
    return {device: (params, opt) for device, (params, opt) in held.items()}


@dataclasses.dataclass(frozen=True)
class MemoryBars:
    """What each device holds of a plan, as bars: parameters, optimizer state, the ideal share.

    Attributes:
        by_device: ``{device id: (parameter bytes, optimizer-state bytes)}``.
        total_bytes: Bytes of all arrays of the plan.
        mesh_shape: ``{axis: size}`` of the mesh.
        width: Characters of the longest bar.
    """

    by_device: dict[int, tuple[int, int]]
    total_bytes: int
    mesh_shape: dict[str, int]
    width: int = 40

    @property
    def ideal_device_bytes(self) -> float:
        """All arrays over the devices, what each would hold if everything were split evenly."""
        return self.total_bytes / len(self.by_device)

    def _bar(self, params: int, opt: int, glyphs: str, styles: tuple[str, ...]) -> Text:
        # One cell per width / (the fullest device or the ideal share, the larger) bytes: the
        # parameters' cells, the optimizer state's, blanks, and the ideal share's column over them.
        top = max([sum(held) for held in self.by_device.values()] + [self.ideal_device_bytes])
        scale = self.width / top if top else 0.0
        param_cells = round(params * scale)
        opt_cells = round((params + opt) * scale) - param_cells
        cells = [(glyphs[0], styles[0])] * param_cells + [(glyphs[1], styles[1])] * opt_cells
        cells += [(" ", "")] * (self.width + 1 - len(cells))
        cells[round(self.ideal_device_bytes * scale)] = (glyphs[2], styles[2])
        text = Text()
        for glyph, style in cells:
            text.append(glyph, style=style)
        return text

    def caption(self) -> str:
        """The totals and the ideal share."""
        return (
            f"{format_bytes(self.total_bytes)} over {len(self.by_device)} devices on mesh "
            f"({mesh_text(self.mesh_shape)}); ideal share {format_bytes(self.ideal_device_bytes)}"
        )

    def describe(self) -> str:
        """Plain text: ``#`` parameters, ``=`` optimizer state, ``|`` the ideal share.

        Example:
            >>> import numpy as np
            >>> import flax_escale as fe
            >>> from flax_escale.tools import memory_bars
            >>> w = np.zeros((32, 32), np.float32)  # replicated: each device holds it all
            >>> state = {"params": {"w": w}, "opt_state": {"mu": w, "nu": w}}
            >>> plan = fe.sharding_report(state, fe.create_mesh((1, 8, 1, 1, 1)), show=False).plan
            >>> print(memory_bars(plan, width=12).describe())  # doctest: +NORMALIZE_WHITESPACE
            12.00 KiB over 8 devices on mesh (dp=1, fsdp=8, ep=1, tp=1, sp=1); ideal share 1.50 KiB
            device 0 ##|#========  12.00 KiB (params 4.00 KiB, optimizer state 8.00 KiB)
            ...
            device 7 ##|#========  12.00 KiB (params 4.00 KiB, optimizer state 8.00 KiB)
        """
        return f"{self.caption()}\n{self._device_lines()}"

    def _device_lines(self) -> str:
        lines = []
        for device, (params, opt) in self.by_device.items():
            bar = self._bar(params, opt, "#=|", ("", "", "")).plain
            lines.append(
                f"device {device} {bar} {format_bytes(params + opt)} (params "
                f"{format_bytes(params)}, optimizer state {format_bytes(opt)})"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def table(self) -> FittedTable:
        """The bars as a ``rich`` table: parameters, optimizer state, the ideal share ``│``.

        It fits the width it is printed at: the optimizer state's column is left out when
        there is none; as the width shrinks, the parameters' and optimizer state's bytes give
        way, then the totals; where the bars do not fit, :meth:`describe`'s lines.
        """
        with_opt = any(opt for _, opt in self.by_device.values())
        legend = "█ parameters ▒ optimizer state │ ideal" if with_opt else "█ parameters │ ideal"
        table = FittedTable(title="memory per device", plain=self._device_lines)
        table.add_column("device", justify="right", wrap=False)
        table.add_column(legend, least=self.width + 1)
        table.add_column("total", justify="right", give_way=1, wrap=False)
        table.add_column("params", justify="right", give_way=2, wrap=False)
        table.add_column("opt", justify="right", give_way=2, wrap=False)
        for device, (params, opt) in self.by_device.items():
            bar = self._bar(params, opt, "█▒│", ("cyan", "magenta", "bold red"))
            sizes = (format_bytes(params + opt), format_bytes(params))
            table.add_row(str(device), bar, *sizes, format_bytes(opt) if with_opt else "-")
        return table

    def __rich__(self) -> Group:
        return Group(self.table(), Text(self.caption()))


def memory_bars(plan: ShardingPlan, *, width: int = 40) -> MemoryBars:
    """Bars of what each device holds of ``plan``, split into parameters and optimizer state.

    Args:
        plan: The plan (``plan_sharding``, or ``sharding_report(...).plan`` of a model with
            its optimizer).
        width: Characters of the longest bar (or of the ideal share, if larger).

    Returns:
        A :class:`MemoryBars`: ``rich`` prints it, ``str()`` gives plain text,
        ``by_device`` the figures (those of :func:`memory_by_device`).

    Raises:
        EscaleTypeError: If ``plan`` is not a ``ShardingPlan`` or ``width`` not an int
            (``EscaleError`` when below 1).

    Example:
        >>> import flax.linen as nn
        >>> import jax.numpy as jnp
        >>> import flax_escale as fe
        >>> from flax_escale.tools import memory_bars
        >>> mesh = fe.create_mesh((1, 4, 1, 2, 1))
        >>> kernel_init = nn.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate"))
        >>> bars = memory_bars(fe.plan_sharding(nn.Dense(6, kernel_init=kernel_init), mesh, 0,
        ...     jnp.ones((2, 8))))
        >>> bars.by_device[0], bars.ideal_device_bytes  # the bias is replicated: above the share
        ((48, 0), 27.0)
    """
    width = check.positive_int(width, "width")
    by_device = memory_by_device(plan)
    return MemoryBars(by_device, plan.nbytes, dict(plan.mesh.shape), width)
