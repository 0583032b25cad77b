"""Paths on the command line: the default folders, spec files expanded and looked up.

The default spec folder ``specs`` means ./specs when the working directory has one, and
otherwise the built-in catalogue shipped inside posgen (``catalogue_dir``), so ``list``,
``explain`` and ``check`` work from any directory; user specs are named by path.
``generate`` never falls back to the catalogue: with no SPECS and no ./specs it is a
usage error that names the catalogue's folder.

A spec argument of ``explain`` and ``new --from`` is a file path when it ends in .yaml
or .yml or holds a path separator (``./rope``), and otherwise a spec name
(``is_spec_path``), so that a file or folder ``rope`` in the working directory never
hides the catalogue's ``rope``.

A bad argument (no such file, no spec of that name, an empty directory) is a click usage
error; what is wrong inside a spec file is the loader's ``SpecError``. Both exit 2.

``check_replaceable`` guards the outputs that are not generated modules (``schema
--out``, ``plot``'s PNGs): a target is replaced only when it is absent or a regular file
that posgen recognises as its own, never a link, a folder or anyone else's file.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Sequence
from pathlib import Path, PurePath
from typing import Any

import click

from posgen.cli_output import UsageError
from posgen.codegen.render import catalogue_dir
from posgen.codegen.writing import OutputError
from posgen.spec.loader import (
    SPEC_SUFFIXES,
    LoadedSpec,
    expand_spec_paths,
    load_spec,
    specs_in,
)


class GivenPath(click.Path):
    """A path argument or option as a ``Path``; an empty string, which ``Path`` reads as
    the current folder (so ``--out ''`` would write, and prune, there), is a usage error."""

    def __init__(self) -> None:
        super().__init__(path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "":
            self.fail("an empty path; write . for the current folder", param, ctx)
        return super().convert(value, param, ctx)


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
        raise UsageError(f"no spec files (*.yaml or *.yml) found in {shown}")
    for path in paths:  # a dangling link is the loader's error, beside the other specs'
        if not path.exists() and not path.is_symlink():
            raise UsageError(f"no such spec file: {path}")
    return paths


def is_spec_path(argument: str) -> bool:
    """Whether a spec argument is a file path (it ends in .yaml or .yml, or holds a path
    separator) rather than a spec name."""
    path = PurePath(argument)
    return path.suffix in SPEC_SUFFIXES or path.name != argument


def find_spec(name_or_path: str, spec_dir: Path) -> LoadedSpec:
    """Load a spec given as a file path (``is_spec_path``), or by name from ``spec_dir``.

    The default ``spec_dir`` (``specs``) is ./specs, then the built-in catalogue.
    """
    return load_spec(spec_path(name_or_path, spec_dir))


def spec_path(name_or_path: str, spec_dir: Path) -> Path:
    """The file of a spec given as a file path (``is_spec_path``), or by name from
    ``spec_dir`` (the default ``specs``: ./specs, then the built-in catalogue)."""
    if not name_or_path:
        raise UsageError("an empty spec name or path: name a spec (rope) or a file (x.yaml)")
    if is_spec_path(name_or_path):
        path = Path(name_or_path)
        if not path.exists() and not path.is_symlink():  # named as given: Path drops "./"
            raise UsageError(f"no such spec file: {name_or_path}")
        return path
    folders = [spec_folder(spec_dir)]
    if folders[0] == DEFAULT_SPECS:
        folders.append(catalogue_dir())
    elif not folders[0].is_dir():
        raise UsageError(f"--specs {spec_dir}: no such folder (to look up spec {name_or_path!r})")
    for folder in folders:
        candidates = [folder / f"{name_or_path}{suffix}" for suffix in SPEC_SUFFIXES]
        found = [candidate for candidate in candidates if candidate.exists()]
        if len(found) > 1:
            raise UsageError(
                f"spec {name_or_path!r} is ambiguous: both {found[0]} and {found[1]} exist;"
                " name the file"
            )
        if found:
            return found[0]
    known = sorted({path.stem for folder in folders for path in specs_in(folder)})
    shown = " or ".join(f"{folder}/" for folder in folders)
    hint = f"; for the file here, write ./{name_or_path}" if Path(name_or_path).exists() else ""
    raise UsageError(f"no spec named {name_or_path!r} in {shown} (known: {', '.join(known)}){hint}")


def paths_or_names(arguments: Sequence[Path]) -> list[Path]:
    """``arguments`` of a command that takes spec files and folders, each that is not
    there and reads as a spec name (no suffix, no separator: ``rope``) looked up as
    ``explain`` looks it up (``spec_path``)."""
    return [
        argument
        if argument.exists() or argument.is_symlink() or is_spec_path(str(argument))
        else spec_path(str(argument), DEFAULT_SPECS)
        for argument in arguments
    ]


def check_replaceable(path: Path, ours: Callable[[Path], bool], what: str) -> None:
    """Raise OutputError unless ``path`` is absent, or a regular file (not a link) that
    ``ours`` recognises as posgen's; ``what`` says what posgen writes there."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as error:
        raise OutputError(f"cannot read {path}: {error.strerror or error}") from None
    if stat.S_ISLNK(mode):
        problem = "is a symbolic link (posgen never writes through or replaces a link)"
    elif not stat.S_ISREG(mode):
        problem = "is not a regular file"
    elif not ours(path):
        problem = f"exists and is not {what}"
    else:
        return
    raise OutputError(f"{path} {problem}; not overwriting it: move it away or choose another --out")
