"""What a release ships: the sdist and the wheel as `python -m build` makes them, installed.

The build tests are slow: they build in an isolated environment, which pip fills from the
index (setuptools), and the last one installs the wheel with its dependencies into a fresh
virtual environment, as a user of the library would, and runs the README's examples there.
The README is also the page PyPI shows (the wheel's long description): its links must work
there too.
"""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from support import ROOT
from support.docs import page_program

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
HOMEPAGE = PROJECT["urls"]["Homepage"]
# Where the README's links may point inside the repository: GitHub's pages of its main branch,
# and the raw files (images).
REPOSITORY_LINK = re.compile(
    re.escape(HOMEPAGE) + r"/(?:blob|tree)/main/(?P<path>[^#?]*)"
    r"|https://raw\.githubusercontent\.com/"
    + re.escape(HOMEPAGE.removeprefix("https://github.com/"))
    + r"/main/(?P<raw>[^#?]*)"
)
# Markdown links and images ([text](target), ![alt](target)), reference definitions
# ([label]: target) and HTML attributes (src="...", href="...").
LINK = re.compile(
    r"\]\((?P<inline>[^)\s]+)[^)]*\)|^\[[^\]]+\]:\s*(?P<reference>\S+)"
    r"|(?:src|href)=\"(?P<html>[^\"]+)\"",
    flags=re.M,
)


def readme_links(text: str) -> list[str]:
    """Every link target of a Markdown page, outside its code blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [next(group for group in match.groups() if group) for match in LINK.finditer(prose)]


def test_readme_links_are_absolute_and_name_files_of_the_repository():
    links = readme_links((ROOT / "README.md").read_text())
    assert links, "the README links to the docs"
    for link in links:
        # PyPI renders the README away from the repository: a relative link or an anchor of
        # GitHub's rendering leads nowhere there.
        assert link.startswith("https://"), f"{link!r}: link with an absolute https:// URL"
        inside = REPOSITORY_LINK.match(link)
        if inside:
            path = inside["path"] if inside["path"] is not None else inside["raw"]
            assert (ROOT / path).exists(), f"{link!r} names {path}, which is not in the repository"


def test_readme_links_finds_every_kind_of_link():
    text = (
        "See [a](docs/a.md) and ![b](https://x/b.png 'title').\n\n"
        '[c]: #anchor\n<img src="docs/d.png">\n\n```python\nx = [1](2)\n```\n'
    )
    assert readme_links(text) == ["docs/a.md", "https://x/b.png", "#anchor", "docs/d.png"]


# --- the built distributions ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, the wheel built from the sdist (build's default), as a release."""
    out = tmp_path_factory.mktemp("dist")
    # Built from a copy of the repository's files, as a release checkout holds them: the test
    # suite's other workers write into the working tree (bytecode, build metadata) while
    # setuptools copies it, and a file that changes under the copy fails the build.
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    return {"sdist": next(out.glob("*.tar.gz")), "wheel": next(out.glob("*.whl"))}


def _package_files() -> set[str]:
    """The package's files in the source tree, as the distributions must carry them."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "flax_escale").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.mark.slow
def test_the_sdist_holds_the_package_its_metadata_and_no_tests(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = [member.name.split("/", 1)[1] for member in sdist if member.isfile()]
    files = {name for name in names if not name.startswith("flax_escale.egg-info/")}
    top = {name for name in files if "/" not in name}
    assert top == {
        "CHANGELOG.md",
        "LICENSE",
        "MANIFEST.in",
        "PKG-INFO",
        "README.md",
        "pyproject.toml",
        "setup.cfg",
    }
    # Tests whole or not at all: not at all (they need the docs and examples beside them).
    assert not [name for name in names if name.startswith("tests")]
    assert files - top == _package_files()


@pytest.mark.slow
def test_the_wheel_holds_the_package_and_the_license(dists):
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = f"flax_escale-{PROJECT['version']}.dist-info"
        license_text = wheel.read(f"{info}/licenses/LICENSE").decode()
        metadata = wheel.read(f"{info}/METADATA").decode()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in license_text
    assert "License-Expression: Apache-2.0" in metadata
    assert "License-File: LICENSE" in metadata
    assert {name for name in names if not name.startswith(info)} == _package_files()


@pytest.mark.slow
def test_the_license_text_is_the_sdists_too(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        member = sdist.extractfile(f"flax_escale-{PROJECT['version']}/LICENSE")
        assert member.read().decode() == (ROOT / "LICENSE").read_text()


@pytest.mark.slow
def test_a_fresh_venv_with_the_wheel_runs_the_readme(dists, tmp_path):
    # A user's environment: a new venv, the wheel and its dependencies from the index, run from
    # a folder outside the repository with none of the test run's variables (no PYTHONPATH, no
    # shared compilation cache), so that what is imported is the installed package.
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "PYTHONPATH" and not name.startswith(("JAX_", "XLA_", "VIRTUAL_ENV"))
    }
    env["JAX_PLATFORMS"] = "cpu"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", dists["wheel"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]

    run = tmp_path / "run"
    run.mkdir()
    check = (
        "import importlib.metadata as m, flax_escale as fe\n"
        "print(fe.__file__)\nprint(fe.__version__)\n"
        "print(*(f for f in m.files('flax-escale') if f.name == 'LICENSE'))\n"
    )
    where = subprocess.run(
        [python, "-c", check], cwd=run, env=env, capture_output=True, text=True, check=True
    )
    module, version, license_file = where.stdout.splitlines()
    assert Path(module).is_relative_to(venv), module
    assert version == PROJECT["version"]
    assert license_file.endswith(".dist-info/licenses/LICENSE")

    program = page_program(ROOT / "README.md")
    assert program.strip(), "the README shows Python examples"
    (run / "readme.py").write_text(program)
    result = subprocess.run(
        [python, "-W", "error", "readme.py"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    # The traceback's line numbers are the README's.
    assert result.returncode == 0, f"README.md in a fresh venv:\n{result.stderr[-6000:]}"
