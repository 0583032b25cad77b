"""Names a spec chooses for generated code: validated identifiers and class names."""

from __future__ import annotations

import builtins
import keyword
import re

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class UnsafeName(ValueError):
    """A name that cannot appear in generated code (never reached by a validated spec)."""


def identifier(name: str) -> str:
    """Return ``name`` if it is a safe Python identifier for generated code.

    ASCII, matching ``^[A-Za-z_][A-Za-z0-9_]*$``, not a keyword, soft keyword or builtin.
    """
    if not _IDENTIFIER.match(name) or not name.isascii():
        raise UnsafeName(f"{name!r} is not an ASCII identifier")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or hasattr(builtins, name):
        raise UnsafeName(f"{name!r} is a Python keyword or builtin")
    return name


def class_name_for(module_name: str) -> str:
    """``rope_gptj`` → ``RopeGptj``; a leading digit part keeps its case (``t5`` → ``T5``)."""
    parts = [part for part in module_name.split("_") if part]
    return identifier("".join(part[:1].upper() + part[1:] for part in parts))
