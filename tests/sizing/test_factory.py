"""``load_factory`` and the references a child process imports a workload's factory by."""

import sys

import pytest
from support.mistakes import MISTAKE, T, case, raises_a_library_error

import flax_escale as fe
from flax_escale import sizing
from flax_escale.sizing import load_factory
from flax_escale.sizing._factory import reference_of

DATACLASS_MODULE = """
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    width: int = 8


def workload():
    return Config()
"""


def test_a_file_reference_loads_a_module_that_defines_a_dataclass(tmp_path):
    path = tmp_path / "planning_file_reference_7731.py"
    path.write_text(DATACLASS_MODULE)
    try:
        factory = load_factory(f"{path}:workload")
        assert factory().width == 8
    finally:
        sys.modules.pop(path.stem, None)


def test_a_file_reference_never_replaces_another_module_of_its_name(tmp_path):
    import json

    path = tmp_path / "json.py"
    path.write_text("def workload():\n    return 'the file of the reference'\n")
    try:
        assert load_factory(f"{path}:workload")() == "the file of the reference"
        assert sys.modules["json"] is json
        assert sys.modules["flax_escale_plan_json"].__file__ == str(path)
    finally:
        sys.modules.pop("flax_escale_plan_json", None)


def module_level_workload():
    """A factory the child process could import by its reference (never called here)."""
    raise AssertionError("only its reference is taken")


def test_a_module_level_factory_is_referenced_for_the_child():
    assert reference_of(module_level_workload) == f"{__name__}:module_level_workload"


def test_a_module_that_raises_as_it_is_imported_is_one_library_error(tmp_path):
    module = tmp_path / "planning_raises_on_import_7731.py"
    module.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(
        fe.EscaleError,
        match=r"workload: importing '.*planning_raises_on_import_7731.py' of .* raised "
        r"RuntimeError: no GPU here; fix the module",
    ) as caught:
        sizing.load_factory(f"{module}:workload")
    assert isinstance(caught.value.__cause__, RuntimeError)


CASES = [
    # --- a factory's reference -------------------------------------------------------------
    case(
        lambda: sizing.load_factory(3),
        T,
        "workload",
        "int 3",
        r"MODULE:FUNCTION",
        id="load_factory-int",
    ),
]


@pytest.mark.parametrize(MISTAKE, CASES)
def test_mistake_raises_a_library_error_naming_argument_and_value(fn, exc, argument, shown, hint):
    raises_a_library_error(fn, exc, argument, shown, hint)
