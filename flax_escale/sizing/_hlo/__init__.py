"""Reading a compiled HLO program: its collectives, loops, FLOPs and the rewrites XLA made.

One reader, :func:`program_costs`, in five modules: :mod:`._text` reads the program's text into
computations of instructions; :mod:`._loops` says how many times each ``while`` loop runs;
:mod:`._flops` counts a matrix multiplication's or convolution's FLOPs; :mod:`._rewrites`
recognises collectives a compiler writes in another form than the textbook's; and
:mod:`._reader` puts them together into a program's :class:`ProgramCosts`. Everything outside
this package imports from here.
"""

from flax_escale.sizing._hlo._pipeline import PipelineFigures, Reduction, pipeline_figures
from flax_escale.sizing._hlo._reader import (
    COLLECTIVE_KINDS,
    READER_VERSION,
    CollectiveCost,
    ProgramCosts,
    Rewrite,
    collective_bytes,
    program_costs,
)
from flax_escale.sizing._hlo._rewrites import SLICED, WINDOWED
from flax_escale.sizing._hlo._text import array_bytes

__all__ = [
    "COLLECTIVE_KINDS",
    "READER_VERSION",
    "SLICED",
    "WINDOWED",
    "CollectiveCost",
    "PipelineFigures",
    "ProgramCosts",
    "Reduction",
    "Rewrite",
    "array_bytes",
    "collective_bytes",
    "pipeline_figures",
    "program_costs",
]
