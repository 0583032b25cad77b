"""``posgen generate --standalone NAME --out FILE.py``: one spec as one self-contained file."""

from __future__ import annotations

import sys
from pathlib import Path

from posgen.cli_output import UsageError, say
from posgen.cli_paths import DEFAULT_OUT
from posgen.codegen.render import render_standalone
from posgen.codegen.writing import NotOurs, plan_for, write_file
from posgen.spec.loader import LoadedSpec


def generate_standalone(loaded: list[LoadedSpec], name: str, out: Path, dry: bool) -> None:
    """Write (or, dry, compare: exit 0 up to date, 1 not) the module of the spec ``name``.

    The runtime is inlined. A file that posgen did not write is never overwritten.
    """
    chosen = [spec for spec in loaded if spec.spec.name == name]
    if not chosen:
        known = ", ".join(sorted(spec.spec.name for spec in loaded))
        raise UsageError(f"--standalone: no spec named {name!r}; known: {known}")
    if out == DEFAULT_OUT or out.is_dir() or out.suffix != ".py":
        raise UsageError(f"--standalone needs --out FILE.py (a file, not a folder), got {out}")
    source = render_standalone(plan_for(chosen[0]))
    if dry:
        same = out.is_file() and out.read_bytes() == source.encode("utf-8")
        say(f"{out}: {'up to date' if same else 'out of date'}.")
        sys.exit(0 if same else 1)
    try:
        written = write_file(out, source)
    except NotOurs:
        raise UsageError(f"{out} exists and was not written by posgen; not overwriting") from None
    say(f"{out}: {'written' if written else 'up to date'} (standalone {name}).")
