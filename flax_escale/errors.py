"""Exceptions raised by flax_escale.

Every error is a :class:`ValueError` subclass, so code that already guards sharding calls with
``except ValueError`` keeps working, while code that wants to tell flax_escale's errors apart can
catch :class:`EscaleError` or one of its subclasses.
"""

from __future__ import annotations

__all__ = [
    "EscaleError",
    "EscaleTypeError",
    "MeshError",
    "NoMeshError",
    "ShardingCorrectionWarning",
    "ShardingResolutionError",
]


class EscaleError(ValueError):
    """Base class of every error flax_escale raises."""


class EscaleTypeError(EscaleError, TypeError):
    """An argument has the wrong type; also a :class:`TypeError`."""


class MeshError(EscaleError):
    """A mesh cannot be built, parsed or queried as asked."""


class NoMeshError(MeshError):
    """A function needs a mesh, none was passed and none is set in the current context."""


class ShardingResolutionError(EscaleError):
    """Logical axes cannot be resolved to a valid spec and strict resolution was asked for."""


class ShardingCorrectionWarning(UserWarning):
    """A sharding constraint was corrected to fit the array and mesh (some axes dropped).

    Turn it into an error with ``warnings.simplefilter("error", ShardingCorrectionWarning)``,
    or pass ``strict=True`` to the constraint.
    """
