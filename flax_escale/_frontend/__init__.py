"""What both front ends share: declaring logical axes, and the one init pipeline.

``flax_escale.linen`` and ``flax_escale.nnx`` each implement the pipeline's
:class:`~flax_escale._frontend._pipeline.FrontEnd` protocol for their Flax API (tracing, the
initializer, the finish). The rest is the same for both and lives here: the patterns a
``sharded_module`` declaration holds, the three ways of declaring (decorator with a mapping,
bare decorator with a ``patterns`` class attribute, mixin), the inheritance of declarations,
``overrides=``, the options every entry point takes (:class:`InitOptions`) and the entry points
themselves.
"""

from flax_escale._frontend._declare import DeclaringMixin, Install, declare, record
from flax_escale._frontend._options import InitOptions
from flax_escale._frontend._overrides import Overrides, apply_overrides
from flax_escale._frontend._patterns import AxesPatterns, unused_pattern_note

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
