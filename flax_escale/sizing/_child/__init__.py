"""Planning in a child process: the protocol, the parent's side, and the child (``__main__``).

:func:`~flax_escale.sizing.plan_mesh` plans more simulated devices than its process has, or a
TPU target, in ``python -m flax_escale.sizing._child``: :mod:`._protocol` says what the child
is asked and how its events come back, :mod:`._parent` runs it and shows its events, and
``__main__`` is the child itself.
"""

from flax_escale.sizing._child._parent import Events, run_child
from flax_escale.sizing._child._protocol import (
    EVENT_PREFIX,
    Request,
    evaluate_request,
    frozen_rules,
)

__all__ = ["EVENT_PREFIX", "Events", "Request", "evaluate_request", "frozen_rules", "run_child"]
