"""Names a spec chooses for generated code: validated identifiers and class names.

A spec's name becomes a module name (``rope_gptj``) and a class name (``RopeGptj``).
Neither may be a name that generated code already defines or imports, or the class
would hide it (``f`` gives class ``F``, which hides ``torch.nn.functional as F``).
``generated_names`` computes that set from the templates themselves, so it follows
them: the runtime is parsed with ``ast``, the module templates are read for their
top-level definitions. The spec layer never imports ``posgen.codegen``; it finds the
templates folder the same way the renderer does.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import re
from functools import cache
from pathlib import Path

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # fullmatch

RUNTIME_SOURCE = "runtime"
"""The runtime's folder in the templates folder: each ``_NAME.py`` in it is copied to
``generated/_NAME.py``, a module of the shared runtime beside the generated modules."""

# Top-level definitions in a template: ``NAME = ...``, ``NAME: type = ...``, ``def``, ``class``
# (a name made of Jinja expressions, such as the class of the spec, does not match).
_TEMPLATE_DEFINITION = re.compile(
    r"^(?:(?:def|class)\s+([A-Za-z_]\w*)\b|([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=))", re.M
)
_HELPERS_MACRO = re.compile(r"\{%-?\s*macro\s+helpers\b.*?%\}(.*?)\{%-?\s*endmacro", re.S)


class UnsafeName(ValueError):
    """A name that cannot appear in generated code (never reached by a validated spec)."""


def identifier(name: str) -> str:
    """Return ``name`` if it is a safe Python identifier for generated code.

    ASCII, matching ``^[A-Za-z_][A-Za-z0-9_]*$``, not a keyword, soft keyword or builtin.
    """
    if not _IDENTIFIER.fullmatch(name) or not name.isascii():
        raise UnsafeName(f"{name!r} is not an ASCII identifier")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or hasattr(builtins, name):
        raise UnsafeName(f"{name!r} is a Python keyword or builtin")
    return name


def class_name_for(module_name: str) -> str:
    """``rope_gptj`` → ``RopeGptj``; a leading digit part keeps its case (``t5`` → ``T5``)."""
    return identifier(class_name_text(module_name))


def class_name_text(module_name: str) -> str:
    """The class name ``class_name_for`` gives, before it is checked as an identifier."""
    parts = [part for part in module_name.split("_") if part]
    return "".join(part[:1].upper() + part[1:] for part in parts)


def templates_dir() -> Path:
    """The templates folder: packaged as posgen/_templates, or the repository's.

    The same lookup as ``posgen.codegen.render.templates_dir`` (a test keeps them equal).
    """
    package = Path(__file__).resolve().parent.parent
    packaged = package / "_templates"
    if packaged.is_dir():
        return packaged
    return package.parent / "templates"


@cache
def generated_names() -> dict[str, str]:
    """Every name that generated code defines or imports at module level, with its origin.

    - the runtime's imports and top-level definitions (``templates/runtime/*.py``,
      parsed with ``ast``): ``math``, ``torch``, ``F``, ``Tensor``, ``nn``, ``Any``,
      ``annotations``, ``BACKENDS``, ``PositionalAttention``, ...;
    - the module-level names the module and registry templates write (``SPEC_FILE``,
      ``SPEC_SHA256``, ``__all__``, ``ENCODINGS``) and those the building blocks'
      ``helpers`` macros write (``ROTARY_BASE``, ``BUCKETS``, ...);
    - the runtime's module names, ``_attention``, ``_masks``, ...
    """
    folder = templates_dir()
    names: dict[str, str] = {}
    runtime_files = sorted((folder / RUNTIME_SOURCE).glob("_*.py"))
    found = [
        (name, imported, f"templates/{RUNTIME_SOURCE}/{runtime.name}")
        for runtime in runtime_files
        for name, imported in _python_names(runtime.read_text(encoding="utf-8"))
    ]
    for name, imported, where in sorted(found, key=lambda entry: entry[1]):  # definitions first
        origin = "imported by generated code" if imported else "defined by the runtime"
        names.setdefault(name, f"{origin}, {where}")
    for template in sorted(folder.rglob("*.jinja")):
        where = template.relative_to(folder).as_posix()
        for name in _template_names(template.read_text(encoding="utf-8"), where):
            names.setdefault(name, f"written by templates/{where}")
    for runtime in runtime_files:
        names.setdefault(runtime.stem, "a runtime module beside the generated modules")
    return names


def _python_names(source: str) -> list[tuple[str, bool]]:
    """(name, whether it is imported) for each top-level binding of a Python module."""
    found: list[tuple[str, bool]] = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((a.asname or a.name.split(".")[0], True) for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.name, False))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.extend((t.id, False) for t in targets if isinstance(t, ast.Name))
    return found


def _template_names(text: str, where: str) -> list[str]:
    """Top-level names a template writes: a block's ``helpers`` macro, or a whole module.

    Block templates (``blocks/``) reach module level only through ``helpers``; their
    other macros write the class body and docstrings.
    """
    if where.startswith("blocks/"):
        sources = _HELPERS_MACRO.findall(text)
    else:
        sources = [_outside_docstrings(text)]
    return [
        match.group(1) or match.group(2)
        for source in sources
        for match in _TEMPLATE_DEFINITION.finditer(source)
    ]


def _outside_docstrings(text: str) -> str:
    """The lines of ``text`` that are not inside a triple-quoted string."""
    kept: list[str] = []
    inside = False
    for line in text.splitlines():
        if not inside:
            kept.append(line)
        if line.count('"""') % 2:
            inside = not inside
    return "\n".join(kept)


def reserved_name_problem(module_name: str) -> str | None:
    """Why ``module_name`` (or the class it gives) would clash in generated code, or None.

    The class name must be a safe identifier (``none`` would give ``None``), and neither
    it nor the module name may be a name generated code defines or imports.
    """
    class_name = class_name_text(module_name)
    try:
        identifier(class_name)
    except UnsafeName:
        return (
            f"'{module_name}' would give class '{class_name}', a Python keyword or builtin "
            "name; choose another name"
        )
    taken = generated_names()
    if class_name in taken:
        return (
            f"'{module_name}' would give class '{class_name}', a name generated code already "
            f"uses ({taken[class_name]}): the class would hide it; choose another name"
        )
    if module_name in taken:
        return (
            f"'{module_name}' is a name generated code already uses ({taken[module_name]}); "
            "choose another name"
        )
    return None
