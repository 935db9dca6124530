"""The documentation of every config field: the string under its declaration in
``pipetrain.config.schema``, read from the source with ``ast`` (Python keeps no such
strings at run time). ``pipetrain train --help`` lists the fields with it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

from pipetrain.config.schema import TrainConfig

__all__ = ["FieldDoc", "config_fields", "field_docs"]


@dataclass(frozen=True)
class FieldDoc:
    """One config field: its key, its default and what it means."""

    key: str
    """``section.field``, as ``--set`` takes it."""
    default: Any
    """The value a run gets when nothing sets it."""
    doc: str
    """The string under the field's declaration, on one line ("" if it has none)."""


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after its annotated declaration in ``cls``,
    with its lines joined into one; fields without one are left out."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped: the help lists the fields bare
        return {}
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for declared, after in itertools.pairwise(body):
        if (
            isinstance(declared, ast.AnnAssign)
            and isinstance(declared.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[declared.target.id] = " ".join(after.value.value.split())
    return docs


def config_fields() -> list[FieldDoc]:
    """Every field of every section, in the order of the TOML file."""
    fields: list[FieldDoc] = []
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory  # each section is built by its class
        assert isinstance(cls, type)
        docs = field_docs(cls)
        fields.extend(
            FieldDoc(f"{section.name}.{f.name}", f.default, docs.get(f.name, ""))
            for f in dataclasses.fields(cls)
        )
    return fields
