"""Context parallelism: attention over a sequence split across devices, balanced when causal.

:func:`context_attention` is the one attention entry point of a model whose sequence is split
over a context axis (``sp``, or whatever mesh axes the rules give ``query_sequence``): keys and
values are gathered, passed round a ring, or traded for heads (Ulysses), as ``strategy`` says
or, with ``"auto"``, as the formulas of :func:`choose_strategy` pick for the hardware.
:class:`SequenceLayout` reorders a batch once (tokens, labels, positions, segment ids) so that
a causal mask gives every device the same work; :func:`attention_work` counts that work.
"""

from flax_escale.context._attention import AttentionWork, attention_work, context_attention
from flax_escale.context._layout import BALANCES, ContextError, SequenceLayout
from flax_escale.context._plan import QUERY_AXES, ContextPlan, plan_attention
from flax_escale.context._strategy import (
    CONTEXT_STRATEGIES,
    AttentionShape,
    Choice,
    Cost,
    Link,
    choose_strategy,
)

__all__ = [
    "BALANCES",
    "CONTEXT_STRATEGIES",
    "QUERY_AXES",
    "AttentionShape",
    "AttentionWork",
    "Choice",
    "ContextError",
    "ContextPlan",
    "Cost",
    "Link",
    "SequenceLayout",
    "attention_work",
    "choose_strategy",
    "context_attention",
    "plan_attention",
]
