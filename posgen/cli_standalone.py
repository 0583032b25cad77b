"""``posgen generate --standalone NAME --out FILE.py``: one spec as one self-contained file."""

from __future__ import annotations

import importlib.machinery
import keyword
import sys
from pathlib import Path

from posgen.cli_output import UsageError, say
from posgen.cli_paths import DEFAULT_OUT
from posgen.codegen.render import render_standalone
from posgen.codegen.writing import (
    NotOurs,
    check_target,
    compare,
    plan_for,
    unified_diff,
    write_file,
)
from posgen.spec.loader import LoadedSpec
from posgen.spec.model import RESERVED_MODULE_NAMES


def generate_standalone(
    loaded: list[LoadedSpec], name: str, out: Path, dry: bool, show_diff: bool
) -> None:
    """Write (or, dry, compare: exit 0 up to date, 1 not) the module of the spec ``name``;
    with ``show_diff`` (dry) print the unified diff first, as ``generate --diff`` does.

    The runtime is inlined. A file that posgen did not write is never overwritten.
    """
    chosen = [spec for spec in loaded if spec.spec.name == name]
    if not chosen:
        known = ", ".join(sorted(spec.spec.name for spec in loaded))
        raise UsageError(f"--standalone: no spec named {name!r}; known: {known}")
    if out == DEFAULT_OUT or out.is_dir() or out.suffix != ".py":
        raise UsageError(f"--standalone needs --out FILE.py (a file, not a folder), got {out}")
    _check_module_name(out)
    source = render_standalone(plan_for(chosen[0]))
    try:
        if dry:  # a file in the way that posgen did not write is an error, not drift
            check_target(out)
            _report_drift(out, source, show_diff)
        written = write_file(out, source)
    except NotOurs:
        raise UsageError(f"{out} exists and was not written by posgen; not overwriting") from None
    say(f"{out}: {'written' if written else 'up to date'} (standalone {name}).")


def _check_module_name(out: Path) -> None:
    """The file is imported by its stem: refuse one Python cannot import by name, or one
    that would shadow a standard-library module, or one torch or posgen imports or that is
    installed, beside the user's code."""
    stem = out.stem
    if not stem.isidentifier() or keyword.iskeyword(stem):
        raise UsageError(
            f"--out {out}: {stem!r} is not a name Python can import; name the file as its "
            "module, e.g. t5_attention.py"
        )
    if stem in RESERVED_MODULE_NAMES:
        raise UsageError(
            f"--out {out}: a module named {stem!r} would shadow the standard-library "
            "module of that name, or the one torch or posgen imports; choose another name"
        )
    installed = _installed_elsewhere(stem, out)
    if installed is not None:
        raise UsageError(
            f"--out {out}: a module named {stem!r} is installed ({installed}); a file of "
            "that name beside your code would shadow it (torch and posgen import "
            "typing_extensions, yaml, click, pydantic, ...); choose another name"
        )


def _installed_elsewhere(stem: str, out: Path) -> str | None:
    """Where a top-level module ``stem`` is installed in this environment (on sys.path,
    the user's own folders left out: the out folder and the working directory; or
    through an import hook, such as an editable install's), or None."""
    own = {out.parent.resolve(), Path.cwd().resolve()}
    installed = [entry for entry in sys.path if Path(entry or ".").resolve() not in own]
    finders = [importlib.machinery.PathFinder.find_spec(stem, installed)] + [
        finder.find_spec(stem, None)
        for finder in sys.meta_path
        if finder is not importlib.machinery.PathFinder and hasattr(finder, "find_spec")
    ]
    found = next((spec for spec in finders if spec is not None), None)
    if found is None:
        return None
    return found.origin or "a namespace package"


def _report_drift(out: Path, source: str, show_diff: bool) -> None:
    """Say whether ``out`` holds ``source`` (with ``show_diff``, the diff too) and exit:
    0 up to date, 1 not. Raises OutputError when ``out`` is not a file."""
    tree = {out.name: source}
    drift = compare(out.parent, tree, prune=False)
    if show_diff:
        # labelled a/FOLDER/FILE as generate --diff labels them (FOLDER: ``out``'s, by name)
        say(unified_diff(out.parent.absolute(), tree, drift), nl=False)
    say(f"{out}: {'up to date' if drift.clean else 'out of date'}.")
    sys.exit(0 if drift.clean else 1)
