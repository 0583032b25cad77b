"""The import block of a generated file, written from the names the file uses.

Templates never write imports: the renderer parses the rendered code, collects the
names it loads, and imports exactly those from a fixed table, laid out as ruff's
isort and formatter would (sections stdlib, third party, local; ``import`` lines before
``from`` lines; names ordered constants, classes, then the rest).
"""

from __future__ import annotations

import ast
from collections.abc import Set
from dataclasses import dataclass

LINE_LENGTH = 100


@dataclass(frozen=True)
class Importable:
    """One name a generated file may use, and where it comes from."""

    name: str
    section: int  # 0 stdlib, 1 third party, 2 local
    module: str
    alias_of: str | None = None  # ``import torch.nn.functional as F``: F is torch.nn.functional
    from_import: bool = True


FIXED = (
    Importable("Callable", 0, "collections.abc"),
    Importable("Iterator", 0, "collections.abc"),
    Importable("contextlib", 0, "contextlib", from_import=False),
    Importable("functools", 0, "functools", from_import=False),
    Importable("math", 0, "math", from_import=False),
    Importable("Any", 0, "typing"),
    Importable("Literal", 0, "typing"),
    Importable("NamedTuple", 0, "typing"),
    Importable("Protocol", 0, "typing"),
    Importable("warnings", 0, "warnings", from_import=False),
    Importable("weakref", 0, "weakref", from_import=False),
    Importable("torch", 1, "torch", from_import=False),
    Importable("F", 1, "torch.nn.functional", alias_of="torch.nn.functional", from_import=False),
    Importable("Tensor", 1, "torch"),
    Importable("nn", 1, "torch"),
)


def loaded_names(source: str) -> set[str]:
    """Every bare name the code reads (calls, annotations, bases, expressions)."""
    return {
        node.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    }


def defined_names(source: str) -> list[str]:
    """Top-level public names of a module: functions, classes and assigned constants."""
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
    return [name for name in names if not name.startswith("_")]


def _type_order(name: str) -> tuple[int, str]:
    """isort's order-by-type: CONSTANTS, then Classes, then everything else."""
    if name.isupper() and len(name) > 1:
        return 0, name
    if name[:1].isupper():
        return 1, name
    return 2, name


def _from_line(module: str, names: list[str]) -> str:
    ordered = sorted(names, key=_type_order)
    line = f"from {module} import {', '.join(ordered)}"
    if len(line) <= LINE_LENGTH:
        return line
    body = "".join(f"    {name},\n" for name in ordered)
    return f"from {module} import (\n{body})"


def import_block(used: Set[str], runtime_names: dict[str, str]) -> str:
    """The import lines for ``used`` names, grouped and ordered as ruff would.

    ``runtime_names`` maps each name importable from the sibling runtime to its module
    (``"PositionalAttention": "_attention"``); an empty mapping means the runtime is
    inlined (standalone files).
    """
    available = list(FIXED) + [
        Importable(name, 2, f".{module}") for name, module in sorted(runtime_names.items())
    ]
    needed = [item for item in available if item.name in used]
    sections: list[str] = []
    for section in (0, 1, 2):
        items = [item for item in needed if item.section == section]
        plain = sorted(
            f"import {item.alias_of} as {item.name}" if item.alias_of else f"import {item.module}"
            for item in items
            if not item.from_import
        )
        froms_only = [item for item in items if item.from_import]
        froms = [
            _from_line(module, [item.name for item in froms_only if item.module == module])
            for module in sorted({item.module for item in froms_only})
        ]
        lines = plain + froms
        if lines:
            sections.append("\n".join(lines))
    return "\n\n".join(sections)
