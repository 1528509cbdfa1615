"""How a model's variables are planned: the options every entry point takes, checked once.

Every public entry point (``plan_sharding``, ``init_sharded``, ``lower_init``,
``init_train_state``, the mesh planner's ``Workload``, the t5x ``Partitioner``) takes the same
keywords. They are checked and frozen where they enter, into one :class:`InitOptions`, and
travel as that value; nothing below re-checks them, and each has one default.
"""

from __future__ import annotations

import dataclasses

from flax_escale import _checks as check
from flax_escale._frontend._overrides import Overrides
from flax_escale._frontend._patterns import AxesPatterns
from flax_escale.axes import LogicalRules
from flax_escale.plan import USE_IDLE_AXES
from flax_escale.resolve import RulesLike, as_logical_rules

__all__ = ["InitOptions"]


@dataclasses.dataclass(frozen=True)
class InitOptions:
    """The planning options of one call, checked and frozen.

    Attributes:
        rules: The logical-axis rules, as ``(name, mesh axes)`` pairs in priority order.
        strict: Raise instead of correcting.
        overrides: The compiled ``overrides=`` patterns, or ``None``.
        use_idle_axes: Put mesh axes the rules leave idle to use on large variables.
    """

    rules: LogicalRules
    strict: bool = False
    overrides: AxesPatterns | None = None
    use_idle_axes: bool = USE_IDLE_AXES

    @classmethod
    def create(
        cls,
        *,
        rules: RulesLike = None,
        strict: bool = False,
        overrides: Overrides | None = None,
        use_idle_axes: bool = USE_IDLE_AXES,
    ) -> InitOptions:
        """Checks the keywords as a user gave them and freezes them.

        ``rules=None`` takes Flax's rules context as it is now, then ``PartitionAxis()``'s.

        Raises:
            EscaleTypeError: If ``rules`` are malformed, ``strict`` or ``use_idle_axes`` is
                not a bool, or ``overrides`` is not a mapping of patterns to logical axes.
            EscaleError: If an override pattern is not a regular expression.

        Example:
            >>> from flax_escale._frontend import InitOptions
            >>> options = InitOptions.create(rules=[("embed", "fsdp")], strict=True)
            >>> options.rules, options.strict, options.use_idle_axes
            ((('embed', 'fsdp'),), True, True)
        """
        return cls(
            rules=as_logical_rules(rules),
            strict=check.flag(strict, "strict"),
            overrides=None if overrides is None else AxesPatterns.compile("overrides", overrides),
            use_idle_axes=check.flag(use_idle_axes, "use_idle_axes"),
        )
