"""What both front ends share: declaring parameters' logical axes on module classes.

``flax_escale.linen`` and ``flax_escale.nnx`` each hook their Flax API; the patterns a
``sharded_module`` declaration holds, the three ways of declaring (decorator with a mapping,
bare decorator with a ``logical_axes`` class attribute, mixin) and the inheritance of
declarations are the same for both and live here.
"""

from flax_escale.frontend._declare import DeclaringMixin, Install, declare, record
from flax_escale.frontend._options import InitOptions
from flax_escale.frontend._overrides import Overrides, apply_overrides
from flax_escale.frontend._patterns import AxesPatterns, unused_pattern_note

__all__ = [
    "AxesPatterns",
    "DeclaringMixin",
    "InitOptions",
    "Install",
    "Overrides",
    "apply_overrides",
    "declare",
    "record",
    "unused_pattern_note",
]
