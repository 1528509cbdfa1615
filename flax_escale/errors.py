"""Exceptions raised by flax_escale.

Every error is a :class:`ValueError` subclass, so code that already guards sharding calls with
``except ValueError`` keeps working, while code that wants to tell flax_escale's errors apart can
catch :class:`EscaleError` or one of its subclasses.
"""

from __future__ import annotations

__all__ = ["EscaleError", "EscaleTypeError", "MeshError", "NoMeshError"]


class EscaleError(ValueError):
    """Base class of every error flax_escale raises."""


class EscaleTypeError(EscaleError, TypeError):
    """An argument has the wrong type; also a :class:`TypeError`."""


class MeshError(EscaleError):
    """A mesh cannot be built, parsed or queried as asked."""


class NoMeshError(MeshError):
    """A function needs a mesh, none was passed and none is set in the current context."""
