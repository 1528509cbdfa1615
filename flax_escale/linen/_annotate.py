"""``sharded_module`` for Linen: logical names kept beside the parameters, out of the model's sight.

A decorated class declares ``{path pattern: logical axes}``. While a model initializes, a Flax
method interceptor looks at each module's parameters right after the module's method ran and
records, for every unannotated one that a pattern of an enclosing decorated module matches
(innermost declaring module first), its logical names on the side: the parameter stays the plain
array it was, so what the model's own code reads (a tied embedding's ``.T``, a child's variables
in ``setup``) is what it reads without the library. The names go onto the parameters
(``nn.LogicallyPartitioned``) only where no model code looks any more: when the outermost call
of the model returns, so ``model.init`` returns them boxed; and when a Flax lifted transform
(``nn.scan``, ``nn.vmap``, ``nn.remat``, ...) takes a body's variables out, in a private box
that lets ``nn.scan`` and ``nn.vmap`` name their stacked axis and then comes out as the plain
array again. And ``model.init`` of a decorated class takes a last look at what it returns, so
that a parameter is annotated whatever runs the model's calls: a ``nn.jit`` around the model's
own ``__call__`` (which Flax's interceptors never see, and whose kept trace replays without
running the model's code), a method Flax does not wrap. Outside initialization nothing runs
at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import flax.linen as nn

from flax_escale._frontend import DeclaringMixin, declare, record
from flax_escale.errors import EscaleTypeError
from flax_escale.linen._annotator import PATTERNS, annotating
from flax_escale.linen._boxes import active, without_declared

__all__ = ["ShardedMixin", "sharded_module"]

M = TypeVar("M", bound=type[nn.Module])

_WRAPPED = "__escale_wrapped__"


def _annotating_method(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if active() is not None or not _initializing(self):
            return method(self, *args, **kwargs)
        with annotating():
            return method(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _finishing_init(method: Callable[..., Any]) -> Callable[..., Any]:
    # Module.init_with_output (which init and lazy_init call): the class's patterns own the
    # root however the model runs its calls, and the returned parameters get a last look.
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with annotating() as annotator:
            annotator.expect(type(self))
            out, variables = method(self, *args, **kwargs)
            if isinstance(variables, Mapping) and "params" in variables:
                params = annotator.finish(variables["params"], variables.get("params_axes", {}))
                variables = type(variables)({**variables, "params": params})
            return out, variables

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _given_plain(method: Callable[..., Any]) -> Callable[..., Any]:
    # Module.apply / Module.bind, whose variables may be what model.init returned: the boxes
    # the declaration put on are taken off, so the model reads what it reads undecorated (the
    # model's own boxes stay, as Flax hands them).
    @functools.wraps(method)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if "variables" in kwargs:
            kwargs["variables"] = without_declared(kwargs["variables"])
        elif args:
            args = (without_declared(args[0]), *args[1:])
        return method(self, *args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _initializing(module: nn.Module) -> bool:
    return module.scope is not None and module.is_initializing()


def _install(cls: type[nn.Module], patterns: Mapping[str, Sequence[str | None]] | None) -> None:
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise EscaleTypeError(
            f"flax_escale.sharded_module decorates flax.linen.Module classes, got {cls!r}."
        )
    record(cls, patterns, PATTERNS)
    for name in dir(cls):
        method = getattr(cls, name, None)
        if getattr(method, "method_handler_wrapped", False) and not hasattr(method, _WRAPPED):
            setattr(cls, name, _annotating_method(method))
    for name, wrap in (
        ("apply", _given_plain),
        ("bind", _given_plain),
        ("init_with_output", _finishing_init),
    ):
        method = getattr(cls, name)
        if not hasattr(method, _WRAPPED):
            setattr(cls, name, wrap(method))


class ShardedMixin(DeclaringMixin):
    """Inherit it (before ``nn.Module``) to declare parameters' logical axes as a class attribute.

    ``patterns`` has the form :func:`~flax_escale.sharded_module` takes. Subclasses inherit the
    patterns of their parents and may add their own, which are tried first.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale.linen import ShardedMixin
        >>> class MLP(ShardedMixin, nn.Module):
        ...     patterns = {"wi/kernel": ("hidden_state", "mlp_intermediate"),
        ...                     "wo/kernel": ("mlp_intermediate", "hidden_state")}
        ...
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(4, name="wo")(nn.Dense(16, name="wi")(x))
        >>> params = MLP().init(jax.random.key(0), jnp.ones((2, 4)))["params"]
        >>> params["wi"]["kernel"].names
        ('hidden_state', 'mlp_intermediate')
    """

    install = staticmethod(_install)


def sharded_module(
    cls: M | Mapping[str, Sequence[str | None]] | None = None,
    /,
    patterns: Mapping[str, Sequence[str | None]] | None = None,
) -> Any:
    """:func:`flax_escale.sharded_module` for Linen modules, where the declaration is described.

    Linen specifics: the model's own code never sees the declaration: during ``model.init``
    every parameter it reads (``self.variables``, a child's variables, ``self.param``) is the
    plain array, as without the decorator. ``model.init`` returns the matched parameters boxed
    in ``nn.LogicallyPartitioned``, so everything that understands Flax's logical partitioning
    understands them; at any other time nothing runs, so the module works with no mesh. The
    boxes go on when the outermost decorated call returns: an undecorated module that calls a
    decorated one during ``model.init`` and then reads that one's variables sees them boxed
    (decorate the outer module too, with no patterns if it needs none), and a module that
    reads the variables of a child it ran through ``nn.remat`` or ``nn.jit`` sees them plain
    from its next module call on. ``apply`` and ``bind`` of a decorated class take what
    ``model.init`` returned and hand the model plain arrays too. Parameters Flax
    already annotates (``nn.with_logical_partitioning``, ``nn.with_partitioning``,
    ``param_with_axes``) keep their annotation. The class's patterns reach its parameters
    however its calls run (``setup`` or compact, a ``__call__`` under ``nn.jit`` or other
    decorators): ``model.init`` matches them once more against what it returns, and a pattern
    that matches nothing is reported by ``init_sharded`` and ``plan_sharding`` with the
    parameters seen (a warning, an error when ``strict``). Inside ``nn.scan`` or ``nn.vmap`` give
    ``metadata_params={nn.PARTITION_NAME: "layers"}``: the stacked axis is named ``layers``,
    unsharded by the default rules.

    Use it as ``@sharded_module({...})``, ``@sharded_module(patterns={...})``, or bare on a
    :class:`ShardedMixin`-style class that sets a ``patterns`` class attribute.

    Args:
        cls: The class (bare use), or the ``patterns`` mapping.
        patterns: ``{pattern: logical axes}``.

    Returns:
        The class itself, decorated (or a decorator when called with the mapping).

    Raises:
        EscaleTypeError: If the class is not a Linen module or the mapping is malformed.
        EscaleError: During ``model.init``, if a pattern's logical axes do not name every
            dimension of a parameter it matches, or ``nn.scan`` / ``nn.vmap`` stacks a matched
            parameter with no ``metadata_params`` naming the new axis.

    Example:
        >>> import flax.linen as nn
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax_escale import sharded_module
        >>> @sharded_module({"kernel": ("hidden_state", "vocab"), "bias": ("vocab",)})
        ... class Head(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(32)(x)
        >>> params = Head().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
        >>> params["Dense_0"]["kernel"].names, params["Dense_0"]["bias"].names
        (('hidden_state', 'vocab'), ('vocab',))
    """
    return declare(cls, patterns, install=_install, mixin=ShardedMixin, decorator=sharded_module)
