"""Sphinx configuration of the flax_escale documentation site.

Build it with ``sphinx-build -W -b html docs docs/_build/html`` (the ``docs`` extra installs
Sphinx and MyST); nothing is fetched from the network: the inventories of JAX, Flax, optax and
orbax that cross-references link out to are files in ``docs/_inventories``.
"""

import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

project = "flax_escale"
author = "the flax_escale authors"
copyright = "2026, the flax_escale authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    # Source links: the highlighted source of every documented module, built from the
    # checkout (no network).
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "api_pages",
    "public_names",
    "fields",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Types join the parameters a docstring describes: a dataclass's fields, described as
# attributes, are not listed a second time as its parameters.
autodoc_typehints_description_target = "documented_params"
# A type reads as its name (`Mesh`, `ShardingPlan`); its link and tooltip give the full path.
python_use_unqualified_type_names = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become fields: autodoc's :members: describes the attributes themselves.
napoleon_use_ivar = True

# Links out to the projects our users already read. Their inventories are committed (this build
# needs no network); an inventory that is absent is left out rather than fetched.
# docs/_inventories/make_inventories.py writes them, from a table of the names we reference.
_SITES = {
    "python": "https://docs.python.org/3/",
    "numpy": "https://numpy.org/doc/stable/",
    "jax": "https://docs.jax.dev/en/latest/",
    "flax": "https://flax.readthedocs.io/en/latest/",
    "flax_linen": "https://flax-linen.readthedocs.io/en/latest/",
    "optax": "https://optax.readthedocs.io/en/latest/",
    "orbax": "https://orbax.readthedocs.io/en/latest/",
    "rich": "https://rich.readthedocs.io/en/latest/",
}
intersphinx_mapping = {
    name: (url, str(HERE / "_inventories" / f"{name}.inv"))
    for name, url in _SITES.items()
    if (HERE / "_inventories" / f"{name}.inv").exists()
}
# Python objects link out; pages and labels ("std") always stay on this site.
intersphinx_disabled_reftypes = ["std:*"]

# Every reference must resolve: a broken one fails the build (-W).
nitpicky = True
# A type hint names a class by the module that defines it, where its project documents it
# elsewhere; or, in a class's parameters (postponed annotations autodoc leaves as strings),
# by the name its module imported.
_PUBLIC_NAMES = {
    "Mesh": "jax.sharding.Mesh",
    "LogicalRules": "flax_escale.axes.LogicalRules",
    "jax._src.mesh.Mesh": "jax.sharding.Mesh",
    "jax._src.stages.Lowered": "jax.stages.Lowered",
    "jax._src.stages.Compiled": "jax.stages.Compiled",
    "jax.jaxlib._jax.Array": "jax.Array",
    "jaxlib._jax.Device": "jax.Device",
    "jax.P": "jax.sharding.PartitionSpec",
    "flax.linen.module.Module": "flax.linen.Module",
    "flax.nnx.module.Module": "flax.nnx.Module",
    "flax.nnx.rnglib.Rngs": "flax.nnx.Rngs",
    "flax.nnx.training.optimizer.Optimizer": "flax.nnx.optimizer.Optimizer",
    "optax._src.base.GradientTransformation": "optax.GradientTransformation",
}
nitpick_ignore = [
    # Public (jax.sharding.AbstractMesh, AxisType; flax.linen.spmd.RulesFallback), but their
    # projects' API references have no entry to link to.
    ("py:class", "jax._src.mesh.AbstractMesh"),
    ("py:class", "jax._src.mesh.AxisType"),
    ("py:class", "flax.linen.spmd.RulesFallback"),
]
# (Our own private paths are resolved to their public names by _ext/public_names.py.)

# The repository the site links to: pyproject's Homepage, stated once.
_PYPROJECT = tomllib.loads((HERE.parent / "pyproject.toml").read_text())
REPOSITORY = _PYPROJECT["project"]["urls"]["Homepage"]
# Furo: light and dark modes, the page's table of contents on the right, a link to each
# page's source in the repository; its fonts and scripts ship with it (offline).
html_theme = "furo"
html_title = "flax_escale"
html_static_path = ["_static"]
html_css_files = ["wide_code.css"]
html_theme_options = {
    "source_repository": f"{REPOSITORY}/",
    "source_branch": "main",
    "source_directory": "docs/",
    "top_of_page_buttons": ["view"],
}
# The repository link sits under the search box (_templates/sidebar/repository.html).
templates_path = ["_templates"]
html_context = {"repository": REPOSITORY}
html_sidebars = {
    "**": [
        "sidebar/brand.html",
        "sidebar/search.html",
        "sidebar/repository.html",
        "sidebar/scroll-start.html",
        "sidebar/navigation.html",
        "sidebar/scroll-end.html",
    ]
}
# The copy button leaves out prompts (>>> and ...) and output of console examples.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True


def _public_name(app, env, node, contnode):
    """Resolves a reference by the public name, here; else intersphinx looks that name up."""
    target = _PUBLIC_NAMES.get(node["reftarget"])
    if node.get("refdomain") != "py" or target is None:
        return None
    node["reftarget"] = target
    # "obj": a type alias such as LogicalRules is documented as data, not as a class.
    domain = env.domains["py"]
    return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", target, node, contnode)


def setup(app):
    """Renames before intersphinx (priority 500) looks the name up."""
    app.connect("missing-reference", _public_name, priority=400)
