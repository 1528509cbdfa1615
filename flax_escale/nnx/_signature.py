"""How an NNX constructor or factory would be called, checked before it is called.

``inspect.signature`` of an NNX module class says ``(*args, **kwargs)``: Flax's metaclass
defines ``__call__``, which hides ``__init__``. Without reading ``__init__`` a missing argument
would only show up as Python's own error from inside a traced constructor.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

__all__ = ["binding_error", "shown", "signature"]


def signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature ``fn`` is called with: an NNX module class's ``__init__`` less ``self``.

    Raises:
        ValueError: If there is none to read (some builtins), as ``inspect.signature`` does.
        TypeError: If ``fn`` is not callable.
    """
    if isinstance(fn, type) and issubclass(fn, nnx.Module):
        init = inspect.signature(fn.__init__)
        return init.replace(parameters=tuple(init.parameters.values())[1:])
    return inspect.signature(fn)


def binding_error(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> TypeError | None:
    """Why ``fn(*args, **kwargs)`` cannot be called, or ``None`` (also when nothing says).

    A ``functools.partial`` is seen through, so that one of a module class is checked too.
    """
    if isinstance(fn, functools.partial):
        return binding_error(fn.func, (*fn.args, *args), {**fn.keywords, **kwargs})
    try:
        signature(fn).bind(*args, **kwargs)
    except TypeError as error:
        return error
    except ValueError:  # no signature to read: the call itself will say what is wrong
        pass
    return None


def shown(fn: Callable[..., Any]) -> str:
    """``fn`` as messages show it: its name and parameters (a partial as its repr), shortened.

    Annotations are left out, as they make a Flax layer's signature run for lines.
    """
    if isinstance(fn, functools.partial):
        text = repr(fn)
    else:
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            parameters = signature(fn).parameters.values()
        except (TypeError, ValueError):
            text = name
        else:
            plain = [p.replace(annotation=inspect.Parameter.empty) for p in parameters]
            text = f"{name}{inspect.Signature(plain)}"
    return text if len(text) <= 100 else text[:97] + "..."
