"""Render every spec into a tree of files, compare it with disk, and write it safely.

Writing a tree is all or nothing as far as a file system allows:

1. every target is checked first: a file without posgen's header (``is_generated``) is
   never overwritten, and a folder or other non-file in a module's place is refused
   (``OutputError``, naming the path), before anything is written;
2. every changed or missing file is written in full to a temporary file beside its
   target (created as ``open`` would create it: mode 0o666 less the umask, or the mode of
   the file it replaces); if one cannot be written, the others are removed and nothing
   on disk has changed;
3. the temporaries are renamed over their targets, modules and the runtime first and the
   registry ``__init__.py`` last, so an interrupted run never leaves a registry importing
   a module that does not exist yet;
4. only then, in a pruning (full) run, are stale generated files removed;
5. where a rename or a removal fails (a file made immutable, a folder whose sticky bit
   keeps another user's file), every step before it is undone: each file replaced or
   removed is written back from the bytes read just before, each new one is removed,
   and the error names the file that failed.

Several runs over the same folder may race: a file that vanishes between the comparison
and the write counts as missing, and a stale file another run removed first is not an
error, so concurrent runs all succeed and leave the same tree.
"""

from __future__ import annotations

import difflib
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from posgen.codegen.plan import ModulePlan, build_plan
from posgen.codegen.render import (
    GENERATED_HEADERS,
    GENERATED_MARKER,
    STANDALONE_MARKER,
    render_module,
    render_registry,
    render_runtime,
)
from posgen.spec.loader import LoadedSpec

REGISTRY_FILE = "__init__.py"
_NEW_FILE_MODE = 0o666  # what open() asks for; the kernel applies the umask


def plan_for(loaded: LoadedSpec) -> ModulePlan:
    """The plan of one loaded spec (named by its file name alone, never by a folder)."""
    return build_plan(loaded.spec, loaded.path.name, loaded.sha256)


def render_tree(specs: list[LoadedSpec], with_registry: bool = True) -> dict[str, str]:
    """File name → source for the runtime's modules, every encoding module and the
    registry, sorted by name."""
    plans = [plan_for(loaded) for loaded in specs]
    tree = {f"{plan.module_name}.py": render_module(plan) for plan in plans}
    tree.update(render_runtime())
    if with_registry:
        tree[REGISTRY_FILE] = render_registry(plans)
    return dict(sorted(tree.items()))


class OutputError(Exception):
    """The output folder or a file in it cannot be read or written; one line naming it."""


class NotOurs(OutputError):
    """A file posgen would overwrite, but did not write (it lacks posgen's header)."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"{path} exists and was not written by posgen (no '{GENERATED_MARKER}' header);"
            " not overwriting it: move it away or choose another --out"
        )
        self.path = path


def _reason(error: OSError) -> str:
    """The operating system's words for ``error`` ("Permission denied", ...)."""
    return error.strerror or type(error).__name__


@dataclass
class Drift:
    """How a directory differs from the rendered tree."""

    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.changed or self.missing or self.extra)

    def lines(self) -> list[str]:
        return (
            [f"changed: {name}" for name in self.changed]
            + [f"missing: {name}" for name in self.missing]
            + [f"extra:   {name}" for name in self.extra]
        )


def _is_regular_file(path: Path) -> bool:
    """Whether ``path`` itself (not a link's target) is a regular file: posgen opens
    nothing else (a named pipe would block an open or a read for ever)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def is_generated(path: Path) -> bool:
    """Whether a file carries the posgen header (only such files are ever replaced or removed).

    Its first bytes are compared with the ways posgen's first lines begin
    (``GENERATED_HEADERS``), so bytes past the header that are not UTF-8 (a damaged
    generated module) leave it posgen's, to be replaced."""
    headers = [header.encode("utf-8") for header in GENERATED_HEADERS]
    if not _is_regular_file(path):  # a pipe would block the read for ever
        return False
    try:
        with path.open("rb") as handle:
            start = handle.read(max(len(header) for header in headers))
    except OSError:
        return False
    return any(start.startswith(header) for header in headers)


def is_standalone(path: Path) -> bool:
    """Whether a file posgen wrote is a ``--standalone`` module: a file of its own, which
    a full run into its folder keeps (it is no stale part of the generated tree)."""
    if not _is_regular_file(path):
        return False
    try:
        with path.open("r", encoding="utf-8") as handle:
            header = [handle.readline() for _ in range(3)]
    except (OSError, UnicodeDecodeError):
        return False
    return header[0].startswith(GENERATED_HEADERS) and header[2].startswith(STANDALONE_MARKER)


def _check_folder(out_dir: Path) -> None:
    """Raise OutputError when ``out_dir`` exists but is not a folder, or is a symbolic
    link to nothing (``generate`` could not create the folder there)."""
    if out_dir.is_symlink() and not out_dir.exists():
        raise OutputError(
            f"{out_dir} is a symbolic link to a missing folder: --out needs a folder "
            "(create its target, or remove the link)"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir} is a file, not a folder: --out needs a folder")


def _read_target(path: Path) -> bytes | None:
    """The bytes of the file at ``path``; None when there is none (or it just vanished).

    Raises OutputError when ``path`` is a folder, a symbolic link (posgen never makes
    one, so never writes through or replaces one, whatever it points to) or anything
    else but a regular file (posgen would have to replace it) or cannot be read.
    """
    if path.is_symlink():
        missing = "" if path.exists() else " to a missing file"
        raise OutputError(
            f"{path} is a symbolic link{missing}, where posgen writes a module (posgen never "
            "writes through or replaces a link): remove it or choose another --out"
        )
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise OutputError(
                f"{path} is {kind}, where posgen writes a module: move it away or choose"
                " another --out"
            )
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise OutputError(f"cannot read {path}: {_reason(error)}") from None


def compare(out_dir: Path, tree: dict[str, str], prune: bool = True) -> Drift:
    """Changed, missing and (when ``prune``) extra stale generated files of ``out_dir``.

    Raises OutputError when ``out_dir`` is not a folder or a target is not a file.
    """
    _check_folder(out_dir)
    drift = Drift()
    for name, source in tree.items():
        on_disk = _read_target(out_dir / name)
        if on_disk is None:
            drift.missing.append(name)
        elif on_disk != source.encode("utf-8"):
            drift.changed.append(name)
    if prune and out_dir.is_dir():
        for path in sorted(out_dir.glob("*.py")):
            if path.is_symlink():  # a link posgen did not make: left as it is
                continue
            if path.name not in tree and is_generated(path) and not is_standalone(path):
                drift.extra.append(path.name)
    return drift


def _old_lines(path: Path, shown: str) -> list[str] | str:
    """The lines of ``path`` for a diff ([] when absent), or a note when it is not text."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as error:
        return f"{shown}: cannot read ({_reason(error)}); no diff shown\n"
    try:
        return data.decode("utf-8").splitlines(True)
    except UnicodeDecodeError:
        return f"{shown}: not UTF-8 text, differs; no diff shown\n"


def unified_diff(out_dir: Path, tree: dict[str, str], drift: Drift) -> str:
    """The unified diff from what is on disk to what the specs generate.

    A file on disk that is not UTF-8 text gets one line saying it differs instead.
    """
    chunks: list[str] = []
    for name in drift.changed + drift.missing + drift.extra:
        old_name, new_name = f"a/{out_dir.name}/{name}", f"b/{out_dir.name}/{name}"
        old = _old_lines(out_dir / name, old_name)
        if isinstance(old, str):
            chunks.append(old)
            continue
        new = tree.get(name, "").splitlines(True)
        chunks.extend(difflib.unified_diff(old, new, old_name, new_name))
    return "".join(chunks)


def _mode_for(path: Path) -> int | None:
    """The permission bits to keep: those of the file being replaced, None for a new file."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None


def _create_temporary(path: Path) -> tuple[int, Path]:
    """A new, empty, uniquely named file beside ``path``: (open descriptor, its path).

    Unlike ``tempfile.mkstemp`` (always 0o600), it is created with mode 0o666 so the
    kernel applies the umask (and any default ACL) exactly as for an ordinary new file;
    O_EXCL never follows a link or reuses a file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temporary = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(temporary, flags, _NEW_FILE_MODE), temporary
        except FileExistsError:
            continue


def _stage(path: Path, data: bytes) -> Path:
    """Write ``data`` in full to a temporary file beside ``path``; the temporary's path.

    The temporary gets the mode of the file it will replace, else the umask's. Raises
    OutputError (leaving nothing behind) when it cannot be written.
    """
    keep_mode = _mode_for(path)
    try:
        handle, temporary = _create_temporary(path)
    except OSError as error:
        raise OutputError(f"cannot write {path}: {_reason(error)}") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        if keep_mode is not None:
            os.chmod(temporary, keep_mode)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OutputError(f"cannot write {path}: {_reason(error)}") from None
        raise
    return temporary


@contextmanager
def _staged(files: list[tuple[Path, bytes]]) -> Iterator[list[tuple[Path, Path]]]:
    """Stage every (target, data); yield (temporary, target) pairs in the same order.

    Whatever is not renamed by the time the block ends (an error, an interrupt) is
    removed, so no temporary file is left behind.
    """
    pairs: list[tuple[Path, Path]] = []
    try:
        for target, data in files:
            pairs.append((_stage(target, data), target))
        yield pairs
    finally:
        for temporary, _ in pairs:
            temporary.unlink(missing_ok=True)


def _commit(pairs: list[tuple[Path, Path]], stale: list[Path] | None = None) -> None:
    """Rename each temporary over its target, in order (atomic per file), then remove the
    ``stale`` files posgen wrote (one that vanished: another run's work); where a step
    fails, undo the ones before it (``_undo``) and raise OutputError naming the file."""
    done: list[tuple[Path, bytes | None]] = []  # each file changed, with its bytes before
    try:
        for temporary, target in pairs:
            before = _bytes_before(target)
            try:
                os.replace(temporary, target)
            except OSError as error:
                raise OutputError(f"cannot write {target}: {_reason(error)}") from None
            done.append((target, before))
        for path in stale or []:
            if path.is_symlink() or not is_generated(path):  # replaced meanwhile: not ours
                continue
            before = _bytes_before(path)
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                raise OutputError(f"cannot remove stale {path}: {_reason(error)}") from None
            if before is not None:
                done.append((path, before))
    except BaseException:
        _undo(done)
        raise


def _bytes_before(path: Path) -> bytes | None:
    """The bytes of ``path`` before posgen changes it (None: no file), to undo with."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise OutputError(f"cannot read {path}: {_reason(error)}") from None


def _undo(done: list[tuple[Path, bytes | None]]) -> None:
    """Put back each (path, bytes before) in reverse order: the bytes written again
    (atomically, keeping the file's mode), or a new file removed. Best effort: the
    error that stopped the run is the one reported."""
    for path, before in reversed(done):
        try:
            if before is None:
                path.unlink(missing_ok=True)
            else:
                write_atomically(path, before)
        except (OSError, OutputError):
            continue


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (temporary file + rename); OutputError if not.

    No header check: callers that must not overwrite foreign files use ``write_file``.
    """
    with _staged([(path, data)]) as pairs:
        _commit(pairs)


def check_target(path: Path) -> None:
    """Raise OutputError unless ``path`` is absent, or a regular file posgen wrote."""
    if _read_target(path) is not None and not is_generated(path) and path.exists():
        raise NotOurs(path)


def write_file(path: Path, source: str) -> bool:
    """Write one file atomically if its bytes changed; True when it was written.

    Raises NotOurs, writing nothing, when ``path`` exists without posgen's header, and
    OutputError when it cannot be written.
    """
    data = source.encode("utf-8")
    if _read_target(path) == data:
        return False
    check_target(path)
    write_atomically(path, data)
    return True


def _write_order(names: list[str]) -> list[str]:
    """``names`` sorted, the registry last (it imports every other file)."""
    return sorted(names, key=lambda name: (name == REGISTRY_FILE, name))


def write_tree(out_dir: Path, tree: dict[str, str], prune: bool = True) -> Drift:
    """Write changed and missing files (registry last); with ``prune``, remove stale ones.

    Every target is checked before anything is written: a file posgen did not write
    raises NotOurs, a folder in a file's place OutputError, and nothing changes. A rename
    or removal that fails undoes the ones before it (OutputError).
    """
    drift = compare(out_dir, tree, prune)
    names = _write_order(drift.changed + drift.missing)
    for name in names:
        check_target(out_dir / name)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot create the folder {out_dir}: {_reason(error)}") from None
    with _staged([(out_dir / name, tree[name].encode("utf-8")) for name in names]) as pairs:
        _commit(pairs, [out_dir / name for name in drift.extra])
    return drift
