"""Paths on the command line: the default folders, spec files expanded and looked up.

The default spec folder ``specs`` means ./specs when the working directory has one, and
otherwise the built-in catalogue shipped inside posgen (``catalogue_dir``), so ``list``,
``explain`` and ``check`` work from any directory; user specs are named by path.
``generate`` never falls back to the catalogue: with no SPECS and no ./specs it is a
usage error that names the catalogue's folder.

A bad argument (no such file, no spec of that name, an empty directory) is a click usage
error; what is wrong inside a spec file is the loader's ``SpecError``. Both exit 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from posgen.cli_output import UsageError
from posgen.codegen.render import catalogue_dir
from posgen.spec.loader import LoadedSpec, expand_spec_paths, load_spec

DEFAULT_SPECS = Path("specs")
DEFAULT_OUT = Path("generated")


def spec_folder(path: Path) -> Path:
    """``path``, except the default ``specs`` where the cwd has no such folder: the catalogue."""
    if path == DEFAULT_SPECS and not path.is_dir():
        return catalogue_dir()
    return path


def spec_files(arguments: Sequence[Path], catalogue: bool = True) -> list[Path]:
    """The spec files that ``arguments`` name (default: every spec in ./specs).

    With ``catalogue``, the default folder falls back to the built-in catalogue
    (``spec_folder``); without, a missing ./specs is a usage error.
    """
    if not arguments and not catalogue and not DEFAULT_SPECS.is_dir():
        raise UsageError(
            f"no ./{DEFAULT_SPECS} folder here ({Path.cwd()}): name spec files or a folder"
            f" of specs (the built-in catalogue is {catalogue_dir()})"
        )
    named = list(arguments) or [DEFAULT_SPECS]
    paths = expand_spec_paths([spec_folder(path) for path in named] if catalogue else named)
    if not paths:
        shown = ", ".join(str(p) for p in named)
        raise UsageError(f"no spec files (*.yaml) found in {shown}")
    for path in paths:
        if not path.exists():
            raise UsageError(f"no such spec file: {path}")
    return paths


def find_spec(name_or_path: str, spec_dir: Path) -> LoadedSpec:
    """Load a spec given as a file path, or by name from ``spec_dir``.

    The default ``spec_dir`` (``specs``) is ./specs, then the built-in catalogue.
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_spec(path)
    folders = [spec_folder(spec_dir)]
    if folders[0] == DEFAULT_SPECS:
        folders.append(catalogue_dir())
    for folder in folders:
        candidate = folder / f"{name_or_path}.yaml"
        if candidate.exists():
            return load_spec(candidate)
    known = sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})
    shown = " or ".join(f"{folder}/" for folder in folders)
    raise UsageError(f"no spec named {name_or_path!r} in {shown} (known: {', '.join(known)})")
