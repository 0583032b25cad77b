"""Reading a file whose size and kind are checked first: a regular file of at most a
given number of bytes, never a FIFO (which would block the read for ever) or a device
(which never ends). Spec files and ``from-hf``'s configs are read this way."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO returns at once (POSIX)
_BINARY = getattr(os, "O_BINARY", 0)  # no newline translation (Windows)


class RefusedFile(ValueError):
    """A file that was not read: its message says why, without the path."""


@dataclass(frozen=True)
class FileRule:
    """What a file must be: at most ``limit`` bytes; ``kind`` and ``holder`` word the
    refusals ("a spec is a plain YAML file", "a spec file")."""

    limit: int
    kind: str
    holder: str


def read_bounded(path: Path, rule: FileRule) -> bytes:
    """The bytes of a regular file of at most ``rule.limit`` bytes, or RefusedFile.

    The file's kind and size are checked before it is opened, again on the open
    descriptor, and the read itself stops one byte past the limit.
    """
    try:
        _check_file(path.stat(), rule)
        descriptor = os.open(path, os.O_RDONLY | _NONBLOCK | _BINARY)
        with os.fdopen(descriptor, "rb") as handle:
            _check_file(os.fstat(handle.fileno()), rule)
            raw = handle.read(rule.limit + 1)
    except OSError as error:
        if path.is_symlink() and not os.path.exists(path):
            raise RefusedFile("a symbolic link to nothing (dangling, or a loop)") from None
        raise RefusedFile(f"cannot read: {error.strerror or error}") from None
    if len(raw) > rule.limit:
        raise RefusedFile(_too_large(len(raw), rule, at_least=True))
    return raw


def _check_file(info: os.stat_result, rule: FileRule) -> None:
    """Refuse anything but a regular file, and a regular file over ``rule.limit``."""
    if not stat.S_ISREG(info.st_mode):
        raise RefusedFile(f"not a regular file ({_file_kind(info.st_mode)}): {rule.kind}")
    if info.st_size > rule.limit:
        raise RefusedFile(_too_large(info.st_size, rule))


def _too_large(size: int, rule: FileRule, at_least: bool = False) -> str:
    more = "more than " if at_least else ""
    return (
        f"file too large ({more}{size:,} bytes): {rule.holder} holds at most "
        f"{rule.limit:,} bytes ({_in_units(rule.limit)})"
    )


def _in_units(size: int) -> str:
    return f"{size // 1024**2} MiB" if size >= 1024**2 else f"{size // 1024} KiB"


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((kind for test, kind in kinds if test(mode)), "a special file")
