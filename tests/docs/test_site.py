"""The documentation site builds with warnings as errors and documents every public name."""

import importlib
import importlib.util
import runpy
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from sphinx.util.inventory import InventoryFile
from support import ROOT
from support.browser import browse
from support.docs import DOCS

sys.path.insert(0, str(DOCS / "_ext"))
from api_pages import NAMESPACES

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
