"""Writes the intersphinx inventories of the sites our API reference links out to.

The build reads the committed ``*.inv`` files beside this script and fetches nothing, and the
real ``objects.inv`` of those sites cannot be downloaded where the docs are built. So each
inventory lists only the names our docstrings and type hints reference, with the page and
anchor that site documents them at. When a reference to a new outside name appears (the
build, with ``nitpicky``, fails on it), add a row to ``ENTRIES`` and run::

    python docs/_inventories/make_inventories.py          # rewrites the .inv files
    python docs/_inventories/make_inventories.py --list   # prints every full URL, to check

Each URI is relative to that site's base URL in ``docs/conf.py`` (``_SITES``).
"""

from __future__ import annotations

import runpy
import sys
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Site: (project, version) for the inventory header.
PROJECTS = {
    "python": ("Python", "3"),
    "numpy": ("NumPy", "stable"),
    "jax": ("JAX", "latest"),
    "flax": ("Flax", "latest"),
    "flax_linen": ("Flax Linen", "latest"),
    "optax": ("Optax", "latest"),
    "rich": ("Rich", "latest"),
}

_ABC = "library/collections.abc.html#collections.abc."
_JAX_SHARDING = "jax.sharding.html#jax.sharding."
_JAX_STAGES = "jax.stages.html#jax.stages."
_NNX = "api_reference/flax.nnx/"

# Site: (name, domain:role, URI relative to the site's base URL).
ENTRIES: dict[str, list[tuple[str, str, str]]] = {
    "python": [
        ("None", "py:data", "library/constants.html#None"),
        ("bool", "py:class", "library/functions.html#bool"),
        ("float", "py:class", "library/functions.html#float"),
        ("int", "py:class", "library/functions.html#int"),
        ("object", "py:class", "library/functions.html#object"),
        ("slice", "py:class", "library/functions.html#slice"),
        ("dict", "py:class", "library/stdtypes.html#dict"),
        ("list", "py:class", "library/stdtypes.html#list"),
        ("str", "py:class", "library/stdtypes.html#str"),
        ("tuple", "py:class", "library/stdtypes.html#tuple"),
        ("AssertionError", "py:exception", "library/exceptions.html#AssertionError"),
        ("KeyError", "py:exception", "library/exceptions.html#KeyError"),
        ("TypeError", "py:exception", "library/exceptions.html#TypeError"),
        ("ValueError", "py:exception", "library/exceptions.html#ValueError"),
        ("UserWarning", "py:exception", "library/exceptions.html#UserWarning"),
        ("collections.abc.Callable", "py:class", _ABC + "Callable"),
        ("collections.abc.Collection", "py:class", _ABC + "Collection"),
        ("collections.abc.Iterator", "py:class", _ABC + "Iterator"),
        ("collections.abc.Mapping", "py:class", _ABC + "Mapping"),
        ("collections.abc.Sequence", "py:class", _ABC + "Sequence"),
        (
            "contextlib.AbstractContextManager",
            "py:class",
            "library/contextlib.html#contextlib.AbstractContextManager",
        ),
        ("os.PathLike", "py:class", "library/os.html#os.PathLike"),
        ("subprocess", "py:module", "library/subprocess.html#module-subprocess"),
        ("typing.Any", "py:data", "library/typing.html#typing.Any"),
        ("typing.IO", "py:class", "library/typing.html#typing.IO"),
        ("typing.Literal", "py:data", "library/typing.html#typing.Literal"),
        ("typing.NamedTuple", "py:class", "library/typing.html#typing.NamedTuple"),
    ],
    "numpy": [
        ("numpy.dtype", "py:class", "reference/generated/numpy.dtype.html#numpy.dtype"),
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#numpy.ndarray"),
    ],
    "jax": [
        ("jax.Array", "py:class", "_autosummary/jax.Array.html#jax.Array"),
        ("jax.Device", "py:class", "_autosummary/jax.Device.html#jax.Device"),
        (
            "jax.ShapeDtypeStruct",
            "py:class",
            "_autosummary/jax.ShapeDtypeStruct.html#jax.ShapeDtypeStruct",
        ),
        ("jax.sharding.Mesh", "py:class", _JAX_SHARDING + "Mesh"),
        ("jax.sharding.NamedSharding", "py:class", _JAX_SHARDING + "NamedSharding"),
        ("jax.sharding.PartitionSpec", "py:class", _JAX_SHARDING + "PartitionSpec"),
        ("jax.stages.Compiled", "py:class", _JAX_STAGES + "Compiled"),
        ("jax.stages.Lowered", "py:class", _JAX_STAGES + "Lowered"),
    ],
    "flax": [
        ("flax.nnx.Module", "py:class", _NNX + "module.html#flax.nnx.Module"),
        ("flax.nnx.Rngs", "py:class", _NNX + "rnglib.html#flax.nnx.Rngs"),
        (
            "flax.nnx.optimizer.Optimizer",
            "py:class",
            _NNX + "training/optimizer.html#flax.nnx.optimizer.Optimizer",
        ),
        (
            "flax.training.train_state.TrainState",
            "py:class",
            "api_reference/flax.training.html#flax.training.train_state.TrainState",
        ),
    ],
    "flax_linen": [
        ("flax.linen.Module", "py:class", "api_reference/flax.linen/module.html#flax.linen.Module"),
    ],
    "optax": [
        (
            "optax.GradientTransformation",
            "py:class",
            "api/generated/optax.GradientTransformation.html#optax.GradientTransformation",
        ),
    ],
    "rich": [
        ("rich.console.Console", "py:class", "reference/console.html#rich.console.Console"),
        ("rich.table.Table", "py:class", "reference/table.html#rich.table.Table"),
    ],
}


def inventory(site: str) -> bytes:
    """One site's inventory, in Sphinx's version 2 format (a header, then zlib-compressed lines)."""
    project, version = PROJECTS[site]
    header = (
        "# Sphinx inventory version 2\n"
        f"# Project: {project}\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    # name domain:role priority uri dispname ("-": the name itself); modules rank below objects.
    lines = "".join(
        f"{name} {role} {0 if role == 'py:module' else 1} {uri} -\n"
        for name, role, uri in sorted(ENTRIES[site])
    )
    return header.encode() + zlib.compress(lines.encode(), 9)


def main(argv: list[str]) -> None:
    """Writes every site's ``<site>.inv``, or with ``--list`` prints every full URL."""
    sites = runpy.run_path(str(HERE.parent / "conf.py"))["_SITES"]
    for site in ENTRIES:
        if "--list" in argv:
            for name, role, uri in ENTRIES[site]:
                print(f"{name:40} {role:13} {sites[site]}{uri}")
        else:
            (HERE / f"{site}.inv").write_bytes(inventory(site))


if __name__ == "__main__":
    main(sys.argv[1:])
