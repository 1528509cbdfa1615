"""Runs the examples in every docstring of the package as doctests.

Examples see their own module's names, plus ``jax``, ``jnp``, ``np``, ``nn`` (Linen), ``nnx``,
``optax``, ``NamedSharding``, ``PartitionSpec`` and every name in
``flax_escale.__all__`` without importing them, as a user who did ``from flax_escale import *``
would. ``PartitionSpec(...)`` and ``P(...)`` compare equal in outputs: jax changed the repr
between the supported versions.
"""

import doctest
import importlib
import pkgutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import flax_escale

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(flax_escale.__path__, prefix="flax_escale.")
    if not info.name.endswith("__main__")
)


def test_modules_were_found():
    assert "flax_escale.mesh.creation" in MODULES


class _SpecReprChecker(doctest.OutputChecker):
    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return super().check_output(
            want.replace("PartitionSpec(", "P("), got.replace("PartitionSpec(", "P("), optionflags
        )


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    globs = {name: getattr(flax_escale, name) for name in flax_escale.__all__}
    globs.update(jax=jax, jnp=jnp, np=np, nn=nn, nnx=nnx, optax=optax)
    globs.update(NamedSharding=NamedSharding, PartitionSpec=PartitionSpec)
    globs.update(vars(module))
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(
        checker=_SpecReprChecker(),
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    for test in finder.find(module, module_name, globs=globs):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in {module_name}"
