"""A dataclass's fields, listed once on its entry.

Most of our dataclasses describe their fields in an ``Attributes:`` section (the entry's
"Variables"); conf.py's ``autodoc_typehints_description_target`` keeps autodoc from listing
them again as parameters. A dataclass with many fields and no such section (``PartitionAxis``)
gets a short signature, ``(**fields)``, and a table of its fields and their defaults instead of
a signature of thirty-odd parameters. A default of ``...`` (derived from other fields) reads
``...``, not ``Ellipsis``.
"""

from __future__ import annotations

import dataclasses
import inspect

from sphinx.application import Sphinx

# Above this many fields, an undescribed dataclass's signature gives way to a table.
MAX_SIGNATURE_FIELDS = 8


def _tabled(obj: object) -> bool:
    """Whether a class's fields go in a table rather than its signature."""
    if not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)):
        return False
    described = "Attributes:" in (inspect.getdoc(obj) or "")
    fields = [field for field in dataclasses.fields(obj) if field.init]
    return not described and len(fields) > MAX_SIGNATURE_FIELDS


def _default(field: dataclasses.Field) -> str:
    """A field's default as the table shows it."""
    if field.default is not dataclasses.MISSING:
        return "``...``" if field.default is Ellipsis else f"``{field.default!r}``"
    if field.default_factory is not dataclasses.MISSING:
        return f"``{field.default_factory.__name__}()``"
    return "(required)"


def _signature(app, what, name, obj, options, signature, return_annotation):
    """The short signature of a tabled dataclass; ``...`` for Ellipsis defaults elsewhere."""
    if what == "class" and _tabled(obj):
        return "(**fields)", return_annotation
    if signature:
        return signature.replace("=Ellipsis", "=..."), return_annotation
    return None


def _fields_table(app, what, name, obj, options, lines) -> None:
    """Appends the field table to a tabled dataclass's docstring."""
    if what != "class" or not _tabled(obj):
        return
    lines += [
        "",
        ".. list-table:: Fields",
        "   :header-rows: 1",
        "",
        "   * - field",
        "     - default",
    ]
    for field in dataclasses.fields(obj):
        if field.init:
            lines += [f"   * - ``{field.name}``", f"     - {_default(field)}"]
    lines.append("")


def setup(app: Sphinx) -> dict[str, object]:
    """Connects to autodoc's signature and docstring events."""
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-process-docstring", _fields_table)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
