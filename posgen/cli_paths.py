"""Paths on the command line: the default folders, spec files expanded and looked up.

A bad argument (no such file, no spec of that name, an empty directory) is a click usage
error; what is wrong inside a spec file is the loader's ``SpecError``. Both exit 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from posgen.spec.loader import LoadedSpec, expand_spec_paths, load_spec

DEFAULT_SPECS = Path("specs")
DEFAULT_OUT = Path("generated")


def spec_files(arguments: Sequence[Path]) -> list[Path]:
    """The spec files that ``arguments`` name (default: every spec in specs/)."""
    paths = expand_spec_paths(list(arguments) or [DEFAULT_SPECS])
    if not paths:
        shown = ", ".join(str(p) for p in arguments) or str(DEFAULT_SPECS)
        raise click.UsageError(f"no spec files (*.yaml) found in {shown}")
    for path in paths:
        if not path.exists():
            raise click.UsageError(f"no such spec file: {path}")
    return paths


def find_spec(name_or_path: str, spec_dir: Path) -> LoadedSpec:
    """Load a spec given as a file path, or by name from ``spec_dir``."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_spec(path)
    candidate = spec_dir / f"{name_or_path}.yaml"
    if not candidate.exists():
        known = sorted(p.stem for p in spec_dir.glob("*.yaml"))
        raise click.UsageError(
            f"no spec named {name_or_path!r} in {spec_dir}/ (known: {', '.join(known)})"
        )
    return load_spec(candidate)
