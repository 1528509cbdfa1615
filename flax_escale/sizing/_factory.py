"""The workload's factory: a ``MODULE:FACTORY`` reference loaded, and the workload it builds.

:func:`~flax_escale.sizing.plan_mesh` takes a :class:`~flax_escale.sizing.Workload`, a function
returning one, or the reference of such a function (``"module:function"`` or
``"path/to/file.py:function"``), which a child process can import; this module turns each into
the workload, and a function into the reference the child imports it by.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from flax_escale import _checks as check
from flax_escale.errors import EscaleError, EscaleTypeError
from flax_escale.sizing._workload import Workload

__all__ = ["Factory", "build_workload", "load_factory", "reference_of"]

Factory = Callable[[], Workload]


def load_factory(reference: str) -> Factory:
    """The function a ``"module:function"`` or ``"path/to/file.py:function"`` reference names.

    Raises:
        EscaleTypeError: If the reference is not a string or is malformed, or the module or
            function is missing.
        EscaleError: If the module raises as it is imported (the message names the module
            and the exception, which is its cause).
    """
    if not isinstance(reference, str):
        raise EscaleTypeError(
            f"workload: the reference must be a string, got {check.describe(reference)}; write "
            "it MODULE:FUNCTION, such as 'my_models:workload' or 'path/to/train.py:workload'."
        )
    module_name, sep, attribute = reference.rpartition(":")
    if not sep or not module_name or not attribute:
        raise EscaleTypeError(
            f"workload: {reference!r} is not a reference; write it MODULE:FUNCTION, such as "
            "'my_models:workload' or 'path/to/train.py:workload'."
        )
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except SyntaxError as error:
        raise EscaleTypeError(
            f"workload: {module_name!r} of {reference!r} has a syntax error: {error.msg} "
            f"({error.filename}, line {error.lineno}); fix it, then plan again."
        ) from error
    except (ImportError, OSError) as error:
        raise EscaleTypeError(
            f"workload: cannot import {module_name!r} of {reference!r} ({error}); run from the "
            "directory that holds it, or add that directory to PYTHONPATH."
        ) from error
    except Exception as error:  # the user's module: said in one line, with its cause
        raise EscaleError(
            f"workload: importing {module_name!r} of {reference!r} raised "
            f"{type(error).__name__}: {error}; fix the module so that it imports (its traceback "
            "is this error's cause), then plan again."
        ) from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise EscaleTypeError(
            f"workload: {module_name!r} has no function {attribute!r} (of {reference!r}); "
            "name a function without arguments that returns a flax_escale.sizing.Workload."
        )
    return factory


def _module_from_file(path: Path) -> Any:
    loaded = sys.modules.get(path.stem)
    file = getattr(loaded, "__file__", None)
    if file and Path(file).resolve() == path.resolve():
        return loaded
    # Never in place of another module of the same name (an installed package, say).
    name = path.stem if loaded is None else f"flax_escale_plan_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no such file {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses look their module up there.
    sys.modules[spec.name] = module
    # Its neighbours importable while it runs, as when it runs as a script.
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    finally:
        sys.path.remove(folder)
    return module


def build_workload(workload: Workload | Factory | str) -> Workload:
    """The workload itself, or the one its factory (or the factory's reference) builds.

    Raises:
        EscaleError: If the factory raises (its exception is the cause), or as
            :func:`load_factory`.
        EscaleTypeError: If what is given or built is not a ``Workload``, or as
            :func:`load_factory`.
    """
    given = workload
    if isinstance(workload, str):
        workload = load_factory(workload)
    if callable(workload) and not isinstance(workload, Workload):
        factory = workload
        name = given if isinstance(given, str) else getattr(factory, "__qualname__", factory)
        try:
            workload = factory()
        except Exception as error:  # the user's function: said in one line, with its cause
            raise EscaleError(
                f"workload: the factory {name!r} raised {type(error).__name__}: {error}; it "
                "must build the Workload when called without arguments."
            ) from error
        if not isinstance(workload, Workload):
            raise EscaleTypeError(
                f"workload: the factory {name!r} returned {check.describe(workload)}, not a "
                "flax_escale.sizing.Workload; return Workload(model, rng, batch, tx=...)."
            )
    if not isinstance(workload, Workload):
        raise EscaleTypeError(
            f"workload must be a flax_escale.sizing.Workload (or a function returning one), "
            f"got {check.describe(workload)}."
        )
    return workload


def reference_of(workload: Workload | Factory | str) -> str:
    """The ``MODULE:FACTORY`` reference a child process imports the workload's factory by.

    Raises:
        EscaleTypeError: If the workload is not a reference or a module-level function (a
            ``Workload`` object, a lambda), or as :func:`load_factory`.
    """
    if isinstance(workload, str):
        load_factory(workload)  # a clear error here rather than in the child
        return workload
    module = getattr(workload, "__module__", None)
    name = getattr(workload, "__qualname__", "")
    if callable(workload) and not isinstance(workload, Workload) and module and "<" not in name:
        file = getattr(sys.modules.get(module), "__file__", None)
        if module != "__main__" and (file is None or _importable(module, file)):
            return f"{module}:{name}"
        # A script, or a module loaded from a file under a name that does not import it.
        if file:
            return f"{file}:{name}"
    raise EscaleTypeError(
        f"workload: planning more devices than this process has ({len(jax.devices('cpu'))} "
        "CPU devices), or a TPU target beside an accelerator, compiles in a child process, "
        "which has to build the workload itself; "
        "pass a module-level function returning the Workload, or its 'module:function' "
        f"reference, rather than {check.describe(workload)}."
    )


def _importable(module: str, file: str) -> bool:
    # Whether importing the name afresh gives the module of this file, as in the child (whose
    # path is ours): looked up on the path, not in sys.modules, where a module loaded from a
    # file under any name sits.
    package, _, name = module.rpartition(".")
    try:
        search = importlib.import_module(package).__path__ if package else sys.path
        spec = importlib.machinery.PathFinder.find_spec(name, search)
    except (ImportError, AttributeError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    return origin is not None and Path(origin).resolve() == Path(file).resolve()
