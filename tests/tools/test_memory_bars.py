"""Tests of ``memory_by_device`` and ``memory_bars`` (``flax_escale/tools/_memory_bars.py``)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from support.pictures import Up, dense, optimizer_plan, render
from support.wide_tables import WIDTHS, assert_readable, header_cells, rendered, transformer_plan

import flax_escale as fe
from flax_escale._units import format_bytes
from flax_escale.sharding._measure import device_blocks
from flax_escale.tools import memory_bars, memory_by_device


def test_memory_per_device_splits_parameters_from_optimizer_state():
    plan = optimizer_plan()
    held = memory_by_device(plan)
    report = fe.sharding_report(plan, show=False)
    assert {d: p + o for d, (p, o) in held.items()} == report.bytes_per_device
    expected = dict.fromkeys(range(8), 0)
    for entry in plan:
        if "opt_state" not in entry.path.split("/"):
            for device, block in device_blocks(entry.shape, entry.spec, plan.mesh):
                expected[device] += int(np.prod([b - a for a, b in block])) * 4
    assert {d: p for d, (p, _) in held.items()} == expected
    # Adam keeps two moments per parameter, sharded like it; its count is the step's size.
    params, opt = held[0]
    assert params == 64 * 256 * 4 // 8 + 256 * 4 + 4
    assert opt == 2 * (params - 4) + 4


def test_memory_bars_show_each_device_against_the_ideal_share():
    plan = optimizer_plan()
    bars = memory_bars(plan, width=20)
    assert bars.by_device == memory_by_device(plan)
    assert bars.ideal_device_bytes == plan.nbytes / 8
    lines = str(bars).splitlines()
    assert lines[0].startswith(f"{format_bytes(plan.nbytes)} over 8 devices on mesh")
    bar = re.match(r"device 0 ([#=| ]+) ", lines[1]).group(1)
    params, opt = bars.by_device[0]
    scale = 20 / (params + opt)  # balanced: every device holds the ideal share
    assert bar.count("#") + bar.count("=") + bar.count("|") == 20
    assert abs(bar.count("#") - params * scale) <= 1
    assert bar.index("|") == round(bars.ideal_device_bytes * scale)
    text = render(bars, width=120)
    assert "memory per device" in text
    for glyph in "█▒│":
        assert glyph in text
    assert f"{format_bytes(opt)} " in text


def test_memory_bars_mark_an_ideal_share_above_the_bars():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    plan = fe.plan_sharding(dense(), mesh, 0, jnp.ones((2, 8)))
    bars = memory_bars(plan, width=10)
    assert bars.by_device[0] == (48, 0)
    assert "device 0 ######|###  48 B (params 48 B, optimizer state 0 B)" in str(bars)


def test_memory_errors():
    with pytest.raises(fe.EscaleTypeError, match=r"plan must be a ShardingPlan, got dict"):
        memory_by_device({})
    plan = fe.plan_sharding(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    with pytest.raises(fe.EscaleError, match=r"width"):
        memory_bars(plan, width=0)


@pytest.mark.parametrize("width", WIDTHS)
def test_memory_bars_read_at_every_width_in_a_log(width):
    bars = memory_bars(transformer_plan())
    text = rendered(bars, width)
    assert_readable(text, width, [str(device) for device in bars.by_device])
    shown = header_cells(text)
    assert shown[:2] == ["device", "█ parameters ▒ optimizer state │ ideal"]
    # The parameters' and optimizer state's bytes give way together, then the totals.
    assert ("params" in shown) == ("opt" in shown) == (width >= 100)


def test_memory_bars_of_no_optimizer_state_leave_its_column_out():
    plan = fe.plan_sharding(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    text = rendered(memory_bars(plan), 120)
    assert header_cells(text) == ["device", "█ parameters │ ideal", "total", "params"]
    assert "▒" not in text
    assert "device 0" in rendered(memory_bars(plan), 40)  # the plain lines
