"""The declaration mechanics shared by both front ends' ``sharded_module`` and mixins.

A front end supplies ``install(cls, patterns)``, which records the patterns on the class
and hooks whatever that Flax API needs; this module handles the three ways of declaring
(decorator with a mapping, bare decorator with a ``patterns`` class attribute, mixin) and
makes subclasses of a decorated class decorated too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from flax_escale._frontend._patterns import AxesPatterns

__all__ = ["DeclaringMixin", "Install", "declarations_version", "declare", "record"]

Install = Callable[[type, Mapping[str, Sequence[str | None]] | None], None]

# Marks the __init_subclass__ a declaration installs, so that declaring a class twice wraps once.
_INSTALLS = "__escale_installs__"


def declare(
    cls: Any,
    patterns: Mapping[str, Sequence[str | None]] | None,
    *,
    install: Install,
    mixin: type,
    decorator: Callable[..., Any],
) -> Any:
    """Applies a ``sharded_module`` call: returns a decorator, or the decorated class.

    Args:
        cls: The class, the mapping (``@sharded_module({...})``) or ``None``
            (``@sharded_module(patterns={...})``).
        patterns: The mapping given by keyword.
        install: The front end's installer.
        mixin: The front end's mixin class (its subclasses are already installed).
        decorator: The front end's ``sharded_module``, returned partially applied.
    """
    if cls is None or isinstance(cls, Mapping):
        declared = cls if patterns is None else patterns
        # Checked now, so that a malformed mapping is refused at the call, not when (or if)
        # the decorator is applied to a class.
        AxesPatterns.compile("sharded_module patterns", declared)
        return functools.partial(decorator, patterns=declared)
    if patterns is None and isinstance(cls, type) and issubclass(cls, mixin):
        return cls
    declared = cls.__dict__.get("patterns") if patterns is None else patterns
    install(cls, declared)
    own = cls.__dict__.get("__init_subclass__")
    if not issubclass(cls, mixin) and not hasattr(own, _INSTALLS):
        cls.__init_subclass__ = _installing_subclasses(cls, own, install)
    return cls


def _installing_subclasses(cls: type, own: Any, install: Install) -> classmethod:
    # Subclasses of a decorated class are decorated too; a class's own __init_subclass__ (a
    # classmethod in its __dict__) still runs first, and without one the parents' does.
    def init_subclass(sub: type, **kwargs: Any) -> None:
        if own is None:
            super(cls, sub).__init_subclass__(**kwargs)
        else:
            own.__get__(None, sub)(**kwargs)
        install(sub, sub.__dict__.get("patterns"))

    wrapper = classmethod(init_subclass)
    setattr(wrapper, _INSTALLS, True)
    return wrapper


_version = itertools.count()
_current = [next(_version)]


def record(cls: type, patterns: Mapping[str, Sequence[str | None]] | None, attribute: str) -> None:
    """Compiles ``patterns`` onto ``cls`` as its ``attribute``, before those it inherits."""
    compiled = AxesPatterns.compile(cls.__qualname__, patterns)
    inherited = getattr(cls, attribute, None)
    setattr(cls, attribute, compiled if inherited is None else compiled.then(inherited))
    # A subclass that declares nothing changes no class's declarations: nn.scan makes one of
    # a decorated layer at every trace, which must not make every kept program stale.
    if patterns:
        _current[0] = next(_version)


def declarations_version() -> int:
    """A number that changes whenever a class is declared: what a compiled init depends on."""
    return _current[0]


class DeclaringMixin:
    """Base of the front ends' mixins: each subclass's ``patterns`` is installed with it.

    A front end's mixin sets ``install`` (as a ``staticmethod``); its own subclasses then get
    their declaration installed as they are created.
    """

    patterns: ClassVar[Mapping[str, Sequence[str | None]]] = {}
    install: ClassVar[Install]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "install" not in cls.__dict__:  # not the front end's mixin itself
            cls.install(cls, cls.__dict__.get("patterns"))
