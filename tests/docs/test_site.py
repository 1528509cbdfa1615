"""The documentation site builds with warnings as errors and documents every public name."""

import importlib
import importlib.util
import re
import runpy
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from bs4 import BeautifulSoup
from sphinx.util.inventory import InventoryFile
from support import ROOT
from support.browser import browse
from support.docs import DOCS

sys.path.insert(0, str(DOCS / "_ext"))
from api_pages import GROUPS, NAMESPACES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as CI and the README build it: ``sphinx-build -W``, no network."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return out


def test_the_reference_covers_every_public_namespace():
    # tests/test_public_api.py pins the namespaces and their names: the reference follows it.
    spec = importlib.util.spec_from_file_location("public_api", ROOT / "tests/test_public_api.py")
    public_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(public_api)
    assert sorted(NAMESPACES) == sorted(public_api.EXPECTED)


def test_every_public_name_has_an_entry_in_the_reference(site):
    with (site / "objects.inv").open("rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    documented = {name for entries in inventory.values() for name in entries}
    missing = [
        f"{namespace}.{name}"
        for namespace in NAMESPACES
        for name in importlib.import_module(namespace).__all__
        if f"{namespace}.{name}" not in documented
    ]
    assert not missing
    assert "flax_escale.eformer.with_sharding_constraint" in inventory["py:function"]


def test_every_page_is_built(site):
    for page in DOCS.rglob("*.md"):
        relative = page.relative_to(DOCS).with_suffix(".html")
        assert (site / relative).is_file(), relative
    assert "init_sharded" in (site / "api" / "core.html").read_text()


@pytest.mark.browser
def test_a_built_page_renders_offline_in_a_browser(site, chromium, tmp_path):
    page = site / "guides" / "getting_started.html"
    dom = browse(chromium, page, tmp_path, "--dump-dom")
    assert "Getting started" in dom
    assert "init_sharded" in dom
    shot = tmp_path / "page.png"
    browse(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1200,900")
    width, height = struct.unpack(">II", shot.read_bytes()[16:24])  # the PNG's IHDR chunk
    assert (width, height) == (1200, 900)


def test_the_committed_inventories_are_what_their_script_writes():
    # docs/_inventories/make_inventories.py is their source: an edit there must be rerun.
    script = runpy.run_path(str(DOCS / "_inventories" / "make_inventories.py"))
    for site in script["ENTRIES"]:
        committed = (DOCS / "_inventories" / f"{site}.inv").read_bytes()
        assert committed == script["inventory"](site), site


def _visible_text(page: Path) -> str:
    """What a reader sees of a built page: its text without scripts, whitespace collapsed."""
    soup = BeautifulSoup(page.read_text(), "html.parser")
    for hidden in soup(["script", "style"]):
        hidden.decompose()
    return re.sub(r"\s+", " ", soup.get_text(" "))


def _api_pages(site: Path) -> list[Path]:
    return sorted((site / "api").glob("*.html"))


def test_the_api_pages_show_public_paths_only(site):
    # Type hints, bases and tracebacks name our objects by their public namespace.
    private = re.compile(r"flax_escale(\.\w+)*\._\w+")
    shown = {
        page.name: sorted({match.group() for match in private.finditer(_visible_text(page))})
        for page in _api_pages(site)
    }
    assert {name: paths for name, paths in shown.items() if paths} == {}
    # MemoryEstimate's field, defined in flax_escale.tools._reshardings.
    core = _visible_text(site / "api" / "core.html")
    assert "reshardings ( tuple [ Resharding , ... ] | None )" in core


def test_no_class_is_said_to_derive_from_object(site):
    for page in _api_pages(site):
        assert "Bases: object" not in _visible_text(page), page.name
    assert "Bases: EscaleError" in _visible_text(site / "api" / "core.html")


def test_an_api_page_opens_with_a_summary_table_of_each_kind_of_name(site):
    soup = BeautifulSoup((site / "api" / "core.html").read_text(), "html.parser")
    summary = soup.find("section", id="summary")
    rubrics = [rubric.get_text() for rubric in summary.find_all(class_="rubric")]
    assert rubrics == ["Functions", "Classes", "Errors and warnings"]  # no constants in the core
    assert set(rubrics) <= set(GROUPS.values())
    functions = summary.find("table")
    first = functions.find("tr")
    assert first.find("a")["href"] == "#flax_escale.sharded_module"
    assert "Declares the logical axes" in first.get_text()
    # The entries follow in the same order: the errors last.
    sections = [section["id"] for section in soup.find_all("section") if section.get("id")]
    assert sections[-3:] == ["functions", "classes", "errors-and-warnings"]


def test_a_dataclass_lists_its_fields_once(site):
    soup = BeautifulSoup((site / "api" / "core.html").read_text(), "html.parser")
    report = soup.find(id="flax_escale.ShardingReport").parent
    fields = report.find("dd").find(class_="field-list", recursive=False)
    names = [term.get_text(strip=True) for term in fields.find_all("dt")]
    assert names == ["Variables:"]
    # A dataclass of many fields not described one by one: a short signature and their table.
    axis = soup.find(id="flax_escale.PartitionAxis")
    assert "(**fields)" in axis.get_text()
    table = axis.parent.find("table")
    assert "tensor_parallel_axis" in table.get_text()
    assert "Ellipsis" not in axis.parent.get_text()


def test_the_site_links_to_the_repository_and_to_the_source(site):
    page = (site / "guides" / "getting_started.html").read_text()
    assert 'href="https://github.com/flax-escale/flax-escale"' in page
    core = (site / "api" / "core.html").read_text()
    assert 'href="../_modules/flax_escale/_api.html#init_sharded"' in core
    assert (site / "_modules" / "flax_escale" / "_api.html").is_file()
    assert "copybutton.js" in core


@pytest.mark.browser
def test_a_code_line_of_the_repository_width_shows_whole_at_1280_pixels(site, chromium, tmp_path):
    # A copy of a built page with a 100-character line in a code block, measured by the page.
    line = "x = " + "1" * 96
    probe = (
        '<div class="highlight-python notranslate"><div class="highlight">'
        f'<pre data-probe="yes"><span></span>{line}\n</pre></div></div>'
    )
    measure = (
        "<script>addEventListener('load', () => { const pre = "
        "document.querySelector('pre[data-probe]'); document.title = 'MEASURED ' + "
        "pre.scrollWidth + ' ' + pre.clientWidth; });</script>"
    )
    source = site / "guides" / "getting_started.html"
    text = source.read_text().replace("</h1>", "</h1>" + probe, 1)
    copy = source.with_name("probe.html")
    copy.write_text(text.replace("</body>", measure + "</body>"))
    dom = browse(chromium, copy, tmp_path, "--dump-dom", "--window-size=1280,900")
    scroll, client = map(int, re.search(r"MEASURED (\d+) (\d+)", dom).groups())
    assert len(line) == 100
    assert scroll <= client
