"""Runs the examples in every docstring of the package as doctests.

Examples run in an empty namespace: each one imports what it uses, so it runs exactly as a user
would paste it. ``PartitionSpec(...)`` and ``P(...)`` compare equal in outputs: jax changed the
repr between the supported versions.
"""

import doctest
import importlib
import pkgutil

import pytest

import flax_escale

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(flax_escale.__path__, prefix="flax_escale.")
    if not info.name.endswith("__main__")
)


def test_modules_were_found():
    assert "flax_escale.mesh._creation" in MODULES


class _SpecReprChecker(doctest.OutputChecker):
    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return super().check_output(
            want.replace("PartitionSpec(", "P("), got.replace("PartitionSpec(", "P("), optionflags
        )


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(
        checker=_SpecReprChecker(),
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    # Each example gets a fresh, empty namespace: no module names, no injected imports.
    for test in finder.find(module, module_name, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in {module_name}"
