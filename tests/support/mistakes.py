"""The table of mistakes users make with the public entry points: its machinery and helpers.

Every case is a call a user could plausibly write, against the top level and the ``linen``,
``nnx``, ``mesh``, ``sharding``, ``t5x`` and ``eformer`` namespaces: a string where a sequence
of names is expected; ``None`` or a wrong type where a mesh, a spec, a ``NamedSharding``,
rules, a tree, a function, an optimizer, an rng, a device, a path or a shape is expected;
malformed rules and rule patterns; a spec naming a mesh axis twice or one the mesh lacks (which
JAX itself reports with errors that name no argument); negative, zero or non-int sizes and
counts; a string where ``True`` or ``False`` is expected (``"no"`` would silently be true).
Each must raise one of the library's errors (a subclass of :class:`flax_escale.EscaleError`,
hence a ``ValueError``; :class:`flax_escale.EscaleTypeError` is also a ``TypeError``) whose
message names the argument, shows the value and says what to pass instead: never a raw
``AttributeError`` or an error from inside JAX, Flax or Orbax, and never a silent result. No
case touches the file system: the checkpoint cases are refused before anything is read or
written.

The table is split by module: the test file of the module whose function a case calls
(``tests/mesh/test_creation.py``, ``tests/t5x/test_partitioner.py``, ...; the checkers themselves
in ``tests/test_checks.py``) holds a ``CASES`` list of :func:`case` and one test::

    @pytest.mark.parametrize(MISTAKE, CASES)
    def test_mistake_raises_a_library_error_naming_argument_and_value(
        fn, exc, argument, shown, hint
    ):
        raises_a_library_error(fn, exc, argument, shown, hint)

:func:`all_cases` gathers the parts, for the checks on the table as a whole.
"""

import importlib.util
import os
import re
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_escale as fe
from flax_escale import t5x

TESTS = Path(__file__).resolve().parents[1]


def mesh_dp_tp():
    return fe.create_mesh((2, 4), ("dp", "tp"))


def mesh5():
    return fe.create_mesh((1, 4, 1, 2, 1))


def dp_batch():
    return NamedSharding(mesh_dp_tp(), P("dp"))


def partitioner():
    return t5x.Partitioner(mesh=fe.create_mesh((2, 4, 1, 1, 1)))


# Every checkpoint mistake is refused before anything is read or written here.
CKPT = os.path.join(tempfile.gettempdir(), "flax-escale-mistakes-never-written")


def params():
    mesh = mesh_dp_tp()
    return {"w": jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("tp")))}


def dense():
    init = nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("hidden_state", "mlp_intermediate")
    )
    return nn.Dense(8, use_bias=False, kernel_init=init)


# Named with an underscore, as the messages of the cases that pass the class show it.
class _Up(nnx.Module):
    def __init__(self, rngs):
        self.wi = nnx.Linear(4, 8, use_bias=False, rngs=rngs)


def enter(context):
    with context:
        pass


X = np.ones((8, 4), np.float32)
TX = optax.adam(1e-3)


def case(fn, exc, argument, shown, hint, id):
    """One mistake: calling ``fn`` raises ``exc``, naming ``argument``, showing ``shown``.

    ``hint`` is a regex for what the message tells the user to pass.
    """
    return pytest.param(fn, exc, argument, shown, hint, id=id)


T = fe.EscaleTypeError

# The parameters of every part's test, as pytest.mark.parametrize takes them.
MISTAKE = ("fn", "exc", "argument", "shown", "hint")


def raises_a_library_error(fn, exc, argument, shown, hint):
    """Calling ``fn`` raises ``exc``, a library error whose message names, shows and hints."""
    assert issubclass(exc, fe.EscaleError)
    with pytest.raises(exc) as caught:
        fn()
    assert isinstance(caught.value, fe.EscaleError)
    message = str(caught.value)
    assert argument in message, f"the message does not name {argument!r}: {message}"
    assert shown in message, f"the message does not show {shown!r}: {message}"
    assert re.search(hint, message), f"the message does not say {hint!r}: {message}"


def parts() -> list[Path]:
    """Every test file of the suite that holds a part of the table (a ``CASES`` list whose test
    calls :func:`raises_a_library_error`), each beside the module whose mistakes it lists."""
    return sorted(
        path
        for path in TESTS.glob("**/test_*.py")
        if "\nCASES = [" in (text := path.read_text(encoding="utf-8"))
        and "raises_a_library_error(" in text
    )


def all_cases() -> list:
    """The ``CASES`` of every part, in the order of :func:`parts`.

    Each part is loaded from its file under a name of its own, whatever pytest collected.
    """
    cases = []
    for path in parts():
        name = f"_mistakes_of_{path.parent.name}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cases.extend(module.CASES)
    return cases
