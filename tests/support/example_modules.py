"""The example scripts of ``examples/``, imported as modules for tests."""

import importlib.util
import sys
from types import ModuleType

from support import EXAMPLES


def load(name: str) -> ModuleType:
    """Executes ``examples/<name>.py`` as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(EXAMPLES))  # the examples import each other, as scripts do
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLES))
    return module
