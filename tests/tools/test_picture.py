"""Tests of ``layout_picture`` and ``LayoutPicture`` (``flax_escale/tools/_picture.py``)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from support.pictures import Up, dense, render
from support.wide_tables import WIDTHS, rendered, transformer_plan

import flax_escale as fe
from flax_escale.tools import LayoutPicture, layout_picture


def _abstract(shape, mesh, spec, dtype=np.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _jax_blocks(array):
    # JAX's own answer, for layouts it can place: {device id: ((start, stop) per dim)}.
    return {
        device.id: tuple(s.indices(size)[:2] for s, size in zip(slices, array.shape, strict=True))
        for device, slices in array.sharding.devices_indices_map(array.shape).items()
    }


def _blocks(picture):
    return {d.device_id: d.block for d in picture.devices}


# --- blocks ---------------------------------------------------------------------------------


def test_a_3d_array_on_fsdp_and_tp_has_the_blocks_jax_places(mesh):
    array = jax.device_put(
        np.zeros((8, 3, 6), np.float32), NamedSharding(mesh, P("fsdp", None, "tp"))
    )
    picture = layout_picture(array)
    assert _blocks(picture) == _jax_blocks(array)
    assert picture.shape == (8, 3, 6)
    assert picture.dtype == np.float32
    assert picture.spec == P("fsdp", None, "tp")
    assert picture.mesh_shape == {"dp": 1, "fsdp": 4, "ep": 1, "tp": 2, "sp": 1}
    assert picture.path is None
    third = picture.devices[3]
    assert third.device_id == 3
    assert third.coords == {"dp": 0, "fsdp": 1, "ep": 0, "tp": 1, "sp": 0}
    assert third.block == ((2, 4), (0, 3), (3, 6))
    assert third.block_text(picture.shape) == "[2:4, :, 3:6]"
    assert {d.nbytes for d in picture.devices} == {2 * 3 * 3 * 4}
    assert picture.max_device_bytes == picture.ideal_device_bytes == 8 * 3 * 6 * 4 / 8
    assert picture.replica_groups() == [(i,) for i in range(8)]


def test_a_4d_array_over_two_axes_in_one_dimension_matches_jax():
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    spec = P(("dp", "fsdp"), None, "tp", None)
    array = jax.device_put(np.zeros((8, 2, 4, 3), np.float32), NamedSharding(mesh, spec))
    picture = layout_picture(array)
    assert _blocks(picture) == _jax_blocks(array)
    assert picture.devices[5].block_text(picture.shape) == "[4:6, :, 2:4, :]"


def test_a_replicated_array_is_whole_on_every_device(mesh):
    picture = layout_picture(_abstract((4, 6), mesh, P()))
    assert {d.block for d in picture.devices} == {((0, 4), (0, 6))}
    assert picture.devices[0].block_text(picture.shape) == "[:, :]"
    assert picture.replica_groups() == [tuple(range(8))]
    assert picture.max_device_bytes == 96
    assert "96 B per device of 96 B (8.00x the ideal share, 12 B)" in str(picture)


def test_a_padded_spec_leaves_the_last_block_short(mesh):
    picture = layout_picture(_abstract((10,), mesh, P("fsdp")))
    assert [d.block for d in picture.devices[::2]] == [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)]
    assert [d.nbytes for d in picture.devices[::2]] == [12, 12, 12, 4]
    # tp holds copies: devices 2k and 2k + 1 share a block.
    assert picture.replica_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # Padding that leaves a device nothing: 3 rows over 4 fsdp blocks of 1.
    empty = layout_picture(_abstract((3, 2), mesh, P("fsdp")))
    assert empty.devices[6].block == ((3, 3), (0, 2))
    assert empty.devices[6].nbytes == 0


def test_the_plain_text_of_a_small_padded_layout():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    picture = layout_picture(_abstract((10, 4), mesh, P("fsdp", "tp"), np.int8))
    assert picture.describe() == (
        "int8[10, 4] P('fsdp', 'tp') on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)\n"
        "6 B per device of 40 B (1.20x the ideal share, 5 B)\n"
        "device  position     block        bytes\n"
        "0       fsdp=0 tp=0  [0:3, 0:2]   6 B\n"
        "1       fsdp=0 tp=1  [0:3, 2:4]   6 B\n"
        "2       fsdp=1 tp=0  [3:6, 0:2]   6 B\n"
        "3       fsdp=1 tp=1  [3:6, 2:4]   6 B\n"
        "4       fsdp=2 tp=0  [6:9, 0:2]   6 B\n"
        "5       fsdp=2 tp=1  [6:9, 2:4]   6 B\n"
        "6       fsdp=3 tp=0  [9:10, 0:2]  2 B\n"
        "7       fsdp=3 tp=1  [9:10, 2:4]  2 B"
    )
    assert str(picture) == picture.describe()


def test_a_plan_array_is_pictured_before_anything_exists():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    plan = fe.plan_sharding(dense(), mesh, 0, jnp.ones((2, 8)))
    picture = layout_picture(plan, path="params/kernel")
    assert picture.path == "params/kernel"
    assert picture.spec == P(("fsdp", "sp"), "tp")
    assert picture == layout_picture(plan["params/kernel"], plan.mesh)
    assert picture.title().startswith("params/kernel: float32[8, 6] P(('fsdp', 'sp'), 'tp')")
    # The NNX front end, and a plan read back from JSON (an abstract mesh), alike.
    nnx_plan = fe.plan_sharding(Up, mesh, 0)
    kernel = layout_picture(nnx_plan, path="wi/kernel")
    assert kernel.devices[7].block == ((48, 64), (128, 256))
    loaded = fe.ShardingPlan.from_json(nnx_plan.to_json())
    assert _blocks(layout_picture(loaded, path="wi/kernel")) == _blocks(kernel)


def test_arrays_on_explicit_meshes_are_pictured_like_auto_ones():
    auto = fe.create_mesh((1, 4, 1, 2, 1))
    explicit = fe.create_mesh((1, 4, 1, 2, 1), axis_types="explicit")
    values = np.arange(48, dtype=np.float32).reshape(8, 6)
    on_auto = layout_picture(jax.device_put(values, NamedSharding(auto, P("fsdp", "tp"))))
    on_explicit = layout_picture(jax.device_put(values, NamedSharding(explicit, P("fsdp", "tp"))))
    assert on_auto.devices == on_explicit.devices


def test_mesh_draws_an_unsharded_value_replicated_or_the_spec_on_another_mesh(mesh):
    picture = layout_picture(jax.ShapeDtypeStruct((4,), np.float32), mesh)
    assert picture.replica_groups() == [tuple(range(8))]
    fsdp8 = fe.create_mesh((1, 8, 1, 1, 1))
    moved = layout_picture(_abstract((16,), mesh, P("fsdp")), fsdp8)
    assert moved.mesh_shape["fsdp"] == 8
    assert moved.devices[1].block == ((2, 4),)


# --- errors ---------------------------------------------------------------------------------


def test_a_plan_needs_a_path_it_holds():
    plan = fe.plan_sharding(Up, fe.create_mesh((1, 4, 1, 2, 1)), 0)
    with pytest.raises(fe.EscaleError, match=r"plan of 2 arrays; pass path= to pick one"):
        layout_picture(plan)
    with pytest.raises(
        fe.EscaleError, match=r"path='wi/kernal' is not in the plan; close paths: \['wi/kernel'"
    ):
        layout_picture(plan, path="wi/kernal")
    with pytest.raises(fe.EscaleTypeError, match=r"path must be a string, got int 3"):
        layout_picture(plan, path=3)


def test_wrong_kinds_of_x_are_refused(mesh):
    with pytest.raises(fe.EscaleTypeError, match=r"x must be a ShardingPlan .* got ndarray"):
        layout_picture(np.zeros((4, 4)), mesh)
    with pytest.raises(fe.EscaleTypeError, match=r"x must be a ShardingPlan .* got dict"):
        layout_picture({"w": 1})
    with pytest.raises(fe.EscaleError, match=r"path='w' picks an array of a ShardingPlan"):
        layout_picture(_abstract((4,), mesh, P()), path="w")
    with pytest.raises(fe.EscaleTypeError, match=r"mesh must be a jax.sharding.Mesh"):
        layout_picture(_abstract((4,), mesh, P()), "fsdp")


def test_no_mesh_anywhere_is_refused(mesh):
    with pytest.raises(fe.NoMeshError, match=r"has no NamedSharding .* pass mesh="):
        layout_picture(jax.ShapeDtypeStruct((4,), np.float32))
    with pytest.raises(fe.NoMeshError, match=r"SingleDeviceSharding"):
        layout_picture(jnp.zeros(4))
    plan = fe.plan_sharding(Up, mesh, 0)
    with pytest.raises(fe.NoMeshError, match=r"entry 'wi/kernel' carries no mesh; pass mesh="):
        layout_picture(plan["wi/kernel"])


def test_a_spec_the_mesh_cannot_hold_is_refused(mesh):
    plan = fe.plan_sharding(Up, mesh, 0)
    no_tp = fe.create_mesh((8,), ("fsdp",))
    with pytest.raises(fe.EscaleError, match=r"names mesh axis 'sp', which is not in the mesh"):
        layout_picture(plan["wi/kernel"], no_tp)
    # A hand-made entry whose spec is longer than its rank.
    short = dataclasses.replace(plan["wi/kernel"], shape=(64,))
    with pytest.raises(fe.EscaleError, match=r"2 entries for the 1 dimensions of shape \(64,\)"):
        layout_picture(short, mesh)


# --- rich and treescope ---------------------------------------------------------------------


def test_the_rich_grid_of_a_small_case():
    mesh = fe.create_mesh((1, 4, 1, 2, 1))
    text = render(layout_picture(_abstract((8, 4), mesh, P("fsdp", "tp"))), width=80)
    assert text == (
        "float32[8, 4] P('fsdp', 'tp') on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)\n"
        "┏━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━┓\n"
        "┃ fsdp   ┃    tp=0    ┃    tp=1    ┃\n"
        "┡━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━┩\n"
        "│ fsdp=0 │     0      │     1      │\n"
        "│        │ [0:2, 0:2] │ [0:2, 2:4] │\n"
        "│        │    16 B    │    16 B    │\n"
        "├────────┼────────────┼────────────┤\n"
        "│ fsdp=1 │     2      │     3      │\n"
        "│        │ [2:4, 0:2] │ [2:4, 2:4] │\n"
        "│        │    16 B    │    16 B    │\n"
        "├────────┼────────────┼────────────┤\n"
        "│ fsdp=2 │     4      │     5      │\n"
        "│        │ [4:6, 0:2] │ [4:6, 2:4] │\n"
        "│        │    16 B    │    16 B    │\n"
        "├────────┼────────────┼────────────┤\n"
        "│ fsdp=3 │     6      │     7      │\n"
        "│        │ [6:8, 0:2] │ [6:8, 2:4] │\n"
        "│        │    16 B    │    16 B    │\n"
        "└────────┴────────────┴────────────┘\n"
        "16 B per device of 128 B (1.00x the ideal share, 16 B)\n"
    )


def test_the_rich_grid_colours_replicas_alike(mesh):
    console = Console(record=True, width=100, color_system="standard", force_terminal=True)
    console.print(layout_picture(_abstract((8, 4), mesh, P("fsdp"))))
    text = console.export_text(styles=True)
    colour = {
        block: set(re.findall(r"(\x1b\[[0-9;]*m)" + re.escape(block), text))
        for block in ("[0:2, :]", "[2:4, :]", "[4:6, :]", "[6:8, :]")
    }
    # Both tp replicas of a block in one colour; four blocks, four colours.
    assert all(len(found) == 1 for found in colour.values()), colour
    assert len(set.union(*colour.values())) == 4
    assert text.count("[0:2, :]") == 2


def test_the_rich_grid_handles_one_split_axis_and_three():
    fsdp8 = fe.create_mesh((1, 8, 1, 1, 1))
    one_axis = render(layout_picture(_abstract((16,), fsdp8, P("fsdp"))))
    # One column of cells, a row per fsdp position.
    assert "┃ fsdp   ┃ devices ┃" in one_axis
    assert "│ fsdp=7 │    7    │\n│        │ [14:16] │\n│        │   8 B   │" in one_axis
    three = fe.create_mesh((2, 2, 1, 2, 1))
    grid = render(layout_picture(_abstract((8, 4, 2), three, P("fsdp", "tp", "dp"))), width=120)
    # dp and fsdp number the rows, tp the columns.
    assert re.search(r"│ dp=1 fsdp=0 │\s+4\s+│\s+5\s+│", grid)
    assert "[0:4, 2:4, 1:2]" in grid


def _html(value):
    return treescope.render_to_html(value, compressed=False)


def test_a_picture_renders_in_treescope_with_its_blocks(mesh):
    html = _html(layout_picture(_abstract((16, 8), mesh, P("fsdp", "tp"))))
    assert "float32[16, 8] P(&#x27;fsdp&#x27;, &#x27;tp&#x27;) on mesh (dp=1, fsdp=4," in html
    assert "3       fsdp=1 tp=1  [4:8, 4:8]    64 B" in html
    assert "64 B per device of 512 B" in html
    assert "renderOneDigitbox(parent" in html  # treescope's own sharding drawing
    # Padded blocks are beyond treescope's drawing: the text alone.
    padded = _html(layout_picture(_abstract((10,), mesh, P("fsdp"))))
    assert "6       fsdp=3 tp=0  [9:10]  4 B" in padded
    assert "renderOneDigitbox(parent" not in padded


def test_layout_picture_is_exported():
    assert fe.tools.LayoutPicture is LayoutPicture


@pytest.mark.parametrize("width", WIDTHS)
def test_the_picture_reads_at_every_width_in_a_log(width):
    # Four columns of 4-dimensional blocks: a grid at 120 columns, a line per device at 80.
    path = "opt_state/0/mu/blocks/attention/q_proj/kernel"
    picture = layout_picture(transformer_plan((1, 2, 1, 4, 1)), path=path)
    text = rendered(picture, width)
    assert max(map(len, text.splitlines())) <= width
    assert "…" not in text
    assert path in re.sub(r"\s", "", text)  # the title, wrapped at its spaces only
    for d in picture.devices:
        assert d.block_text(picture.shape) in text
    grid = any(line.startswith("┡") for line in text.splitlines())
    assert grid == (width >= 120)
    if not grid:
        assert picture.describe().splitlines()[2] in text.splitlines()  # the device lines
