"""The sharding report as a web page: its data, its writing, its command line, and the page as a
real browser draws it (Debian's headless Chromium, offline).

Browser tests are marked ``browser``: without Chromium they are skipped on a workstation and
fail under ``CI`` (CI installs it), so that CI cannot pass without having run them.
"""

import dataclasses
import functools
import html.parser
import json
import os
import re
import struct
import urllib.parse
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from support import EXAMPLES
from support.browser import browse
from support.example_modules import load
from support.permissions import permission_bits_apply

import flax_escale as fe
from flax_escale.__main__ import main
from flax_escale._specs import mesh_axes_of
from flax_escale.sharding._measure import device_blocks
from flax_escale.sizing import Workload
from flax_escale.sizing._programs import step_state
from flax_escale.sizing._state_plan import train_state_plan
from flax_escale.tools import memory_by_device
from flax_escale.tools._html import MARKER, page_data, render_html, write_html

MESH = (1, 4, 1, 2, 1)
HOSTILE = "</script><img src=x onerror=\"document.title='owned'\">'&<!--"


@functools.cache
def _nnx_plan():
    mesh = fe.create_mesh(MESH)
    return train_state_plan(load("nnx_llama").workload(), mesh)


@functools.cache
def _gpt2_xl_plan():
    # GPT-2-XL's shapes (Hugging Face's Flax module, 48 layers) with Adam: ~1,700 arrays,
    # traced only. The model carries no logical names; overrides give its matrices theirs.
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule

    config = GPT2Config(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257)
    ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    workload = Workload(
        FlaxGPT2LMHeadModule(config),
        jax.random.key(0),
        (ids, ids, ids),  # input ids, attention mask, positions
        tx=optax.adam(1e-4),
        overrides={
            "wte/embedding": ("vocab", "hidden_state"),
            "c_attn/kernel": ("mlp_intermediate", "hidden_state"),
            "c_fc/kernel": ("mlp_intermediate", "hidden_state"),
            "c_proj/kernel": ("hidden_state", "mlp_intermediate"),
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fe.ShardingCorrectionWarning)
        return train_state_plan(workload, fe.create_mesh(MESH))


def _hostile_plan():
    mesh = fe.create_mesh(MESH)
    x = jax.ShapeDtypeStruct((10, 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    return fe.sharding_report({HOSTILE: x, "plain": x}, show=False).plan


def _embedded(page: str) -> dict:
    found = re.findall(r'<script type="application/json" id="plan-data">(.*?)</script>', page, re.S)
    assert len(found) == 1
    return json.loads(found[0])


def _block_text(block, shape) -> str:
    dims = [":" if (a, b) == (0, n) else f"{a}:{b}" for (a, b), n in zip(block, shape, strict=True)]
    return "[" + ", ".join(dims) + "]"


# --- the page's data ------------------------------------------------------------------------


def test_the_embedded_data_round_trips_the_plan():
    plan = _nnx_plan()
    data = _embedded(render_html(plan))
    report = fe.sharding_report(plan, show=False)
    mesh = plan.mesh
    order = [int(d.id) for d in mesh.devices.flat]
    assert data["mesh"] == {"axes": list(mesh.axis_names), "sizes": list(MESH), "devices": order}
    assert [a["path"] for a in data["arrays"]] == [e.path for e in plan]
    held = memory_by_device(plan)
    assert [(d["id"], d["params"], d["opt"]) for d in data["devices"]] == [
        (d, *held[d]) for d in order
    ]
    assert {d["id"]: d["params"] + d["opt"] for d in data["devices"]} == report.bytes_per_device
    assert sum(d["opt"] for d in data["devices"]) > 0  # Adam's moments count as optimizer state
    assert data["ideal"] == plan.nbytes / 8
    for array, entry in zip(data["arrays"], plan, strict=True):
        assert array["shape"] == list(entry.shape)
        assert array["dtype"] == str(entry.dtype)
        assert array["spec"] == str(entry.spec)
        assert array["opt"] == ("opt_state" in entry.path.split("/"))
        assert array["explain"] == plan.explain(entry.path)
        layout = data["layouts"][array["layout"]]
        blocks = [layout["blocks"][i] for i in layout["of"]]
        expected = dict(device_blocks(entry.shape, entry.spec, mesh))
        assert blocks == [[list(dim) for dim in expected[d]] for d in order]
        sizes = [np.prod([b - a for a, b in block]) * entry.dtype.itemsize for block in blocks]
        assert array["bytes"] == max(sizes)
    # Arrays laid out alike share one layout (Adam's moments share their parameter's).
    assert len(data["layouts"]) == len({(e.shape, e.spec) for e in plan}) < len(plan)
    annotated = data["arrays"][[e.path for e in plan].index("embed/embedding")]
    assert annotated["axes"] == "('vocab', 'hidden_state')"
    assert annotated["source"] == plan["embed/embedding"].annotation.source


def test_corrections_and_idle_axes_are_the_arrays_notes():
    plan = _gpt2_xl_plan()
    arrays = {a["path"]: a for a in page_data(plan)["arrays"]}
    for path, correction in plan.corrections:
        assert f"dim {correction.dim}: {correction.detail}" in arrays[path]["notes"]
    for path, completion in plan.completions:
        assert completion.detail in arrays[path]["notes"]
    assert plan.completions  # (the embedding gets fsdp beside tp)
    unannotated = arrays["params/transformer/h/0/ln_1/scale"]
    assert (unannotated["axes"], unannotated["source"]) == ("-", "none (replicated)")


def test_paths_titles_and_notes_are_escaped():
    page = render_html(_hostile_plan(), title=HOSTILE)
    # The template's two scripts are the only ones; nothing of the data ends them or opens tags.
    assert page.count("</script") == 2
    assert page.count("<script") == 2
    assert "<img" not in page
    assert "<!--" not in page
    assert f"<title>{HOSTILE.replace('&', '&amp;').replace('<', '&lt;')}" in page.replace(
        "&gt;", ">"
    ).replace("&quot;", '"').replace("&#x27;", "'")
    data = _embedded(page)
    assert data["title"] == HOSTILE
    assert [a["path"] for a in data["arrays"]] == [HOSTILE, "plain"]


def test_the_page_fetches_nothing():
    page = render_html(_nnx_plan(), baseline=_nnx_plan())
    assert "http://" not in page
    assert "https://" not in page
    assert not re.search(r"\b(src|href)\s*=", page)
    assert not re.search(r"<(link|img|iframe|object|embed)\b", page)
    assert page.count(MARKER) == 1


def test_a_baseline_lists_what_changed():
    after = _nnx_plan()
    before = train_state_plan(load("nnx_llama").workload(), fe.create_mesh((1, 8, 1, 1, 1)))
    diff = _embedded(render_html(after, baseline=before))["diff"]
    expected = before.diff(after)
    assert diff["summary"] == expected.summary()
    assert diff["rows"] == [list(row) for row in expected.rows()]
    assert "lm_head/kernel" in [row[0] for row in diff["rows"]]
    assert _embedded(render_html(after))["diff"] is None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"plan": "plan"}, fe.EscaleTypeError, r"plan must be a ShardingPlan, got str"),
        ({"baseline": 3}, fe.EscaleTypeError, r"baseline must be a ShardingPlan, got int 3"),
        ({"title": 3}, fe.EscaleTypeError, r"title must be a string such as 'GPT-2 on 8"),
    ],
)
def test_render_html_refuses_what_it_cannot_draw(kwargs, error, message):
    arguments = {"plan": _nnx_plan(), **kwargs}
    with pytest.raises(error, match=message):
        render_html(arguments.pop("plan"), **arguments)


# --- writing the page -----------------------------------------------------------------------


def test_sharding_report_writes_the_page_and_prints_the_diff(tmp_path):
    plan = _nnx_plan()
    before = train_state_plan(load("nnx_llama").workload(), fe.create_mesh((1, 8, 1, 1, 1)))
    console = Console(record=True, width=200)
    target = tmp_path / "report.html"
    report = fe.sharding_report(plan, console=console, html=target, baseline=before)
    page = target.read_text()
    assert page == render_html(plan, baseline=before)
    assert report.plan is plan
    text = console.export_text()
    assert "sharding plan on mesh" in text
    assert before.diff(plan).summary() in text
    # Its own page is replaced; a str path works as a PathLike does.
    fe.sharding_report(_hostile_plan(), show=False, html=str(target))
    assert _embedded(target.read_text())["arrays"][0]["path"] == HOSTILE
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no partial file left


def test_a_file_the_library_did_not_write_is_never_overwritten(tmp_path):
    notes = tmp_path / "notes.html"
    notes.write_text("<html>my notes</html>")
    with pytest.raises(
        fe.EscaleError,
        match=r"html='.*notes.html' exists and is not a sharding report written by flax_escale "
        r".*never overwrites a file it did not create: choose another path",
    ):
        fe.sharding_report(_nnx_plan(), show=False, html=notes)
    assert notes.read_text() == "<html>my notes</html>"
    # Even a page that only mentions the marker further down than a head is not ours.
    late = tmp_path / "late.html"
    late.write_text("x" * 5000 + MARKER)
    with pytest.raises(fe.EscaleError, match="is not a sharding report"):
        write_html(late, "new")
    assert late.read_text() == "x" * 5000 + MARKER


@pytest.mark.parametrize(
    ("where", "error", "message"),
    [
        (lambda tmp: tmp, fe.EscaleError, r"html='.*' is a folder; name a file in it, such as"),
        (
            lambda tmp: tmp / "missing" / "r.html",
            fe.EscaleError,
            r"the folder '.*missing' does not exist; create it first",
        ),
        (lambda tmp: 7, fe.EscaleTypeError, r"html must be a path \(a str or pathlib.Path\)"),
    ],
    ids=["folder", "missing folder", "not a path"],
)
def test_where_the_page_cannot_go(tmp_path, where, error, message):
    with pytest.raises(error, match=message):
        fe.sharding_report(_nnx_plan(), show=False, html=where(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_is_named(tmp_path, request):
    if not permission_bits_apply(request):
        return
    folder = tmp_path / "reports"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert not os.access(folder, os.W_OK)  # the bits apply to this process
        target = folder / "r.html"
        with pytest.raises(
            fe.EscaleError,
            match=re.escape(f"html={str(target)!r}: cannot write the report: Permission denied"),
        ):
            fe.sharding_report(_nnx_plan(), show=False, html=target)
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)
    # A page that cannot be read is not known to be ours: the same error, not "not ours".
    page = folder / "r.html"
    page.write_text("<html>unreadable</html>")
    page.chmod(0o200)
    with pytest.raises(
        fe.EscaleError,
        match=re.escape(f"html={str(page)!r}: cannot write the report: Permission denied"),
    ):
        fe.sharding_report(_nnx_plan(), show=False, html=page)


def test_sharding_report_refuses_a_baseline_that_is_not_a_plan():
    with pytest.raises(fe.EscaleTypeError, match=r"baseline must be a ShardingPlan, got dict"):
        fe.sharding_report(_nnx_plan(), show=False, baseline={})


# --- the train state's plan -----------------------------------------------------------------


@pytest.mark.parametrize("example", ["nnx_llama", "linen_gpt"])
def test_the_train_state_plan_is_the_parameters_then_the_optimizer_state(example):
    workload = load(example).workload()
    mesh = fe.create_mesh(MESH)
    plan = train_state_plan(workload, mesh)
    params = workload.plan(mesh)
    assert plan.entries[: len(params)] == params.entries
    rest = {e.path: e for e in plan.entries[len(params) :]}
    assert rest["step"].spec == P()
    for entry in params:
        name = entry.path.removeprefix("params/")
        for moment in ("mu", "nu"):  # AdamW's moments are sharded like their parameter
            assert rest[f"opt_state/0/{moment}/{name}"].spec == entry.spec
    assert len(plan) == len(params) + len(rest)
    assert fe.sharding_report(plan, show=False).total_bytes == plan.nbytes


def test_the_optimizer_state_is_planned_as_the_step_holds_it():
    # ZeRO-1: the step splits Adam's state over dp too; the plan shows that, not the names.
    workload = dataclasses.replace(load("linen_gpt").workload(), shard_over=("dp",))
    mesh = fe.create_mesh((2, 2, 1, 2, 1))
    plan = train_state_plan(workload, mesh)
    state, _ = step_state(workload, mesh, workload.plan(mesh))
    mu = state.opt_state[0].mu
    assert plan["opt_state/0/mu/token/embedding"].spec == mu["token"]["embedding"].sharding.spec
    assert "dp" in _axes(plan["opt_state/0/mu/token/embedding"].spec)
    assert "dp" not in _axes(plan["params/token/embedding"].spec)


def _axes(spec):
    return {axis for entry in spec for axis in mesh_axes_of(entry)}


# --- the command line -----------------------------------------------------------------------


@pytest.fixture
def examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    # The command sizes JAX's simulated devices to its mesh where the backend has not started
    # yet; in this process the suite's 8 devices stand, whichever test a worker runs first.
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")


def test_the_command_line_prints_the_report_and_writes_the_page(
    examples_importable, tmp_path, capsys, monkeypatch
):
    # A log that names no width gets 160 columns, where every path of this model fits unfolded.
    monkeypatch.delenv("COLUMNS", raising=False)
    target = tmp_path / "out.html"
    argv = ["report", "nnx_llama:workload", "--mesh", "dp:1,fsdp:4,tp:2", "--html", str(target)]
    code = main([*argv, "--baseline-mesh", "fsdp:8"])
    out = capsys.readouterr().out
    assert code == 0
    assert "sharding plan on mesh (dp=1, fsdp=4, ep=1, tp=2, sp=1)" in out
    assert "opt_state/0/mu/embed/embedding" in out
    assert "array(s) differ" in out
    assert f"wrote {target}" in out
    data = _embedded(target.read_text())
    mesh = fe.create_mesh((1, 4, 2, 1, 1), ("dp", "fsdp", "tp", "ep", "sp"))
    expected = train_state_plan(load("nnx_llama").workload(), mesh)
    assert [a["path"] for a in data["arrays"]] == [e.path for e in expected]
    assert [a["spec"] for a in data["arrays"]] == [str(e.spec) for e in expected]
    assert data["diff"]["rows"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "fsdp:3,tp:2"], "multiply to 6, but the mesh has 8 devices"),
        (["--mesh", "fsdp:4,mp:2"], "unknown axis name 'mp' in token 'mp:2'"),
        (["--mesh", "1,8,1,1,1", "--baseline-mesh", "fsdp:x"], "size 'x' in token 'fsdp:x'"),
        (
            ["--mesh", "fsdp=4"],
            "--mesh 'fsdp=4': size 'fsdp=4' in token 'fsdp=4' is not an integer (write fsdp:4, "
            "with a colon); write 'name:size,...' such as 'dp:2,tp:4', or one size per axis",
        ),
        (
            ["--mesh", "fsdp:0"],
            "--mesh 'fsdp:0': size 0 in token 'fsdp:0' is not a positive integer; every axis has "
            "at least one device (an unused axis has size 1)",
        ),
        (["--mesh", "fsdp:-1,tp:-1"], "--mesh 'fsdp:-1,tp:-1' gives 2 sizes of -1"),
        (["--mesh", "fsdp:-2"], "--mesh 'fsdp:-2': size -2 in token 'fsdp:-2' is not a positive"),
        (["--mesh", ""], "--mesh '' is empty; write 'name:size,...'"),
        (
            ["--mesh", "fsdp:8", "--baseline-mesh", "fsdp=8"],
            "--baseline-mesh 'fsdp=8': size 'fsdp=8' in token 'fsdp=8' is not an integer (write "
            "fsdp:8, with a colon)",
        ),
        (
            ["--mesh", "fsdp:8", "--baseline-mesh", "mp:8"],
            "--baseline-mesh 'mp:8': unknown axis name 'mp'",
        ),
        (
            ["--mesh", "fsdp:8", "--baseline-mesh", "fsdp:3"],
            "--baseline-mesh: axis_dims (1, 3, 1, 1, 1) multiply to 3, but the mesh has 8",
        ),
    ],
    ids=[
        "wrong size",
        "unknown axis",
        "bad baseline",
        "= form",
        "size 0",
        "two -1",
        "size -2",
        "empty",
        "baseline = form",
        "baseline unknown axis",
        "baseline wrong size",
    ],
)
def test_the_command_line_exits_2_on_a_bad_mesh(examples_importable, argv, message, capsys):
    code = main(["report", "nnx_llama:workload", *argv])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("python -m flax_escale report: ")
    assert message in captured.err
    assert captured.out == ""


def test_the_command_line_refuses_more_devices_than_one_host_simulates_before_jax(
    examples_importable, monkeypatch, capsys
):
    # Asked of JAX, 100,000 simulated devices take the process down before anything is planned.
    asked = []
    monkeypatch.setattr(jax.config, "update", lambda *args: asked.append(args))
    code = main(["report", "nnx_llama:workload", "--mesh", "fsdp:100000"])
    assert code == 2
    assert capsys.readouterr().err == (
        "python -m flax_escale report: --mesh 'fsdp:100000' asks for 100000 devices, more than "
        "the 4096 one host simulates for a report; give a mesh of at most 4096 devices.\n"
    )
    assert asked == []
    code = main(["report", "nnx_llama:workload", "--mesh", "fsdp:8", "--baseline-mesh", "tp:8192"])
    assert code == 2
    assert "--baseline-mesh 'tp:8192' asks for 8192 devices" in capsys.readouterr().err
    assert asked == []


def test_the_command_line_says_in_one_line_that_a_module_raised_on_import(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "report_raises_on_import_3317.py").write_text("raise RuntimeError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["report", "report_raises_on_import_3317:workload", "--mesh", "fsdp:8"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == (
        "python -m flax_escale report: workload: importing 'report_raises_on_import_3317' of "
        "'report_raises_on_import_3317:workload' raised RuntimeError: no GPU; fix the module so "
        "that it imports (its traceback is this error's cause), then plan again.\n"
    )
    assert captured.out == ""


def test_the_command_line_names_html_in_its_errors(examples_importable, tmp_path, capsys):
    missing = tmp_path / "missing" / "report.html"
    code = main(["report", "nnx_llama:workload", "--mesh", "fsdp:8", "--html", str(missing)])
    assert code == 2
    assert f"report: --html={str(missing)!r}: the folder" in capsys.readouterr().err


def test_the_command_line_never_overwrites_a_foreign_file(examples_importable, tmp_path, capsys):
    mine = tmp_path / "mine.html"
    mine.write_text("mine")
    code = main(["report", "nnx_llama:workload", "--mesh", "fsdp:8", "--html", str(mine)])
    assert code == 2
    assert "is not a sharding report written by flax_escale" in capsys.readouterr().err
    assert mine.read_text() == "mine"


def test_the_command_line_names_a_missing_factory(examples_importable, capsys):
    code = main(["report", "nnx_llama:no_such_factory", "--mesh", "fsdp:8"])
    assert code == 2
    assert "has no function 'no_such_factory'" in capsys.readouterr().err


# --- in a real browser ----------------------------------------------------------------------


class _Elements(html.parser.HTMLParser):
    """Every element's tag and attributes, with the text of the element it is in."""

    def __init__(self):
        super().__init__()
        self.elements = []
        self.open = []

    def handle_starttag(self, tag, attrs):
        element = {"tag": tag, **{name: value or "" for name, value in attrs}, "text": ""}
        self.elements.append(element)
        if tag not in {"meta", "input", "br", "img", "link"}:
            self.open.append(element)

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for element in self.open:
            element["text"] += data


def _dom(chromium, page_path, tmp_path, fragment=""):
    parser = _Elements()
    parser.feed(browse(chromium, page_path, tmp_path, "--dump-dom", fragment=fragment))
    elements = parser.elements
    body = next(e for e in elements if e["tag"] == "body")
    assert body.get("data-ready") == "1", "the page's script did not finish"
    return elements


def _rows(elements):
    return [e for e in elements if e["tag"] == "tr" and "data-bytes" in e]


def _screenshot(chromium, page_path, tmp_path, fragment=""):
    shot = tmp_path / "shot.png"
    browse(
        chromium,
        page_path,
        tmp_path,
        f"--screenshot={shot}",
        "--window-size=1400,1000",
        fragment=fragment,
    )
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1400, 1000)
    return data


def _check_page(chromium, plan, tmp_path):
    page_path = tmp_path / "report.html"
    fe.sharding_report(plan, show=False, html=page_path)
    elements = _dom(chromium, page_path, tmp_path)
    assert [e["data-path"] for e in _rows(elements)] == [e.path for e in plan]
    totals = {
        int(e["data-device"]): int(e["data-bytes"])
        for e in elements
        if "device-row" in e.get("class", "")
    }
    assert totals == fe.sharding_report(plan, show=False).bytes_per_device
    assert len(_screenshot(chromium, page_path, tmp_path)) > 10_000
    return page_path, elements


@pytest.mark.browser
def test_the_nnx_example_in_a_browser(chromium, tmp_path):
    plan = _nnx_plan()
    _, elements = _check_page(chromium, plan, tmp_path)
    shown = next(e for e in elements if e.get("id") == "shown")
    assert shown["text"] == f"{len(plan)} of {len(plan)} arrays"
    mesh_cells = [int(e["data-mesh-device"]) for e in elements if "data-mesh-device" in e]
    assert sorted(mesh_cells) == list(range(8))


@pytest.mark.browser
def test_gpt2_xl_with_adam_in_a_browser(chromium, tmp_path):
    plan = _gpt2_xl_plan()
    assert len(plan) > 1_700
    page_path, _ = _check_page(chromium, plan, tmp_path)
    assert page_path.stat().st_size < 3 * 2**20


@pytest.mark.browser
@pytest.mark.parametrize("path", ["blocks/mlp/up/kernel", "opt_state/0/nu/embed/embedding", "step"])
def test_the_address_opens_an_arrays_grid(chromium, tmp_path, path):
    plan = _nnx_plan()
    page_path = tmp_path / "report.html"
    page_path.write_text(render_html(plan))
    fragment = "#path=" + urllib.parse.quote(path, safe="")
    elements = _dom(chromium, page_path, tmp_path, fragment=fragment)
    grid = next(e for e in elements if e.get("id") == "grid")
    assert grid["data-path"] == path
    entry = plan[path]
    cells = [e for e in elements if e["tag"] == "td" and "data-block" in e]
    expected = [
        (device, _block_text(block, entry.shape), int(np.prod([b - a for a, b in block])) * 4)
        for device, block in device_blocks(entry.shape, entry.spec, plan.mesh)
    ]
    got = [(int(c["data-device"]), c["data-block"], int(c["data-bytes"])) for c in cells]
    assert sorted(got) == sorted(expected)
    selected = [e["data-path"] for e in _rows(elements) if "selected" in e.get("class", "")]
    assert selected == [path]
    explanation = next(e for e in elements if "explain" in e.get("class", "").split())
    assert explanation["text"] == plan.explain(path)


@pytest.mark.browser
def test_an_unknown_address_says_so(chromium, tmp_path):
    page_path = tmp_path / "report.html"
    page_path.write_text(render_html(_nnx_plan()))
    elements = _dom(chromium, page_path, tmp_path, fragment="#path=no%2Fsuch")
    missing = next(e for e in elements if e.get("id") == "missing")
    assert missing["text"] == 'No array at path "no/such" in this plan.'
    assert not [e for e in elements if e.get("id") == "grid"]


@pytest.mark.browser
def test_hostile_paths_stay_text_in_a_browser(chromium, tmp_path):
    page_path = tmp_path / "report.html"
    page_path.write_text(render_html(_hostile_plan(), title=HOSTILE))
    fragment = "#path=" + urllib.parse.quote(HOSTILE, safe="")
    elements = _dom(chromium, page_path, tmp_path, fragment=fragment)
    assert not [e for e in elements if e["tag"] == "img"]
    assert [e["data-path"] for e in _rows(elements)] == [HOSTILE, "plain"]
    title = next(e for e in elements if e["tag"] == "title")
    assert title["text"] == HOSTILE
    assert next(e for e in elements if e.get("id") == "grid")["data-path"] == HOSTILE
