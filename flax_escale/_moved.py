"""Public names that moved: still found at their old place for one release, with a warning.

A package whose names moved sets ``__getattr__ = moved_names(__name__, {...})``. Python calls a
module's ``__getattr__`` only for names the module does not have, so the moved names are out
of the package's namespace and ``__all__``, and its own names cost nothing. The new module is
imported when an old name is asked for, not before, so a core package does not import a
compatibility namespace by naming what moved there.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(package: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """Returns a module ``__getattr__`` that finds each moved name at its new place.

    Args:
        package: The old package's name (its ``__name__``).
        moved: Old name to ``"new.module.new_name"``, optionally followed by ``"; "`` and a
            note for the warning (a change of signature, say).

    Returns:
        The ``__getattr__``. Asking it for a moved name warns with a ``DeprecationWarning``
        naming the new place and returns the object there; any other name raises
        ``AttributeError``.

    Example:
        >>> import warnings
        >>> from flax_escale._moved import moved_names
        >>> getattr_ = moved_names("old.place", {"sqrt": "math.sqrt; same function"})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     getattr_("sqrt")(4.0)
        2.0
        >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
        old.place.sqrt is deprecated and will be removed in the next release:
        use math.sqrt (same function).
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target, _, note = moved[name].partition("; ")
        module, _, new_name = target.rpartition(".")
        warnings.warn(
            f"{package}.{name} is deprecated and will be removed in the next release: use "
            f"{target}" + (f" ({note})." if note else "."),
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new_name)

    return __getattr__
