"""Render every spec into a tree of files, compare it with disk, and write atomically."""

from __future__ import annotations

import difflib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from posgen.codegen.plan import ModulePlan, build_plan
from posgen.codegen.render import (
    GENERATED_MARKER,
    RUNTIME_FILE,
    render_module,
    render_registry,
    render_runtime,
)
from posgen.spec.loader import LoadedSpec

REGISTRY_FILE = "__init__.py"


def plan_for(loaded: LoadedSpec) -> ModulePlan:
    """The plan of one loaded spec (named by its file name alone, never by a folder)."""
    return build_plan(loaded.spec, PurePath(loaded.display_path).name, loaded.sha256)


def render_tree(specs: list[LoadedSpec], with_registry: bool = True) -> dict[str, str]:
    """File name → source for the runtime, every module and the registry, sorted by name."""
    plans = [plan_for(loaded) for loaded in specs]
    tree = {f"{plan.module_name}.py": render_module(plan) for plan in plans}
    tree[RUNTIME_FILE] = render_runtime()
    if with_registry:
        tree[REGISTRY_FILE] = render_registry(plans)
    return dict(sorted(tree.items()))


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


def is_generated(path: Path) -> bool:
    """Whether a file carries the posgen header (only such files are ever removed)."""
    try:
        with path.open("r", encoding="utf-8") as handle:
            return handle.readline().startswith(GENERATED_MARKER)
    except (OSError, UnicodeDecodeError):
        return False


def compare(out_dir: Path, tree: dict[str, str]) -> Drift:
    """Changed, missing and extra (stale generated) files of ``out_dir``."""
    drift = Drift()
    for name, source in tree.items():
        path = out_dir / name
        if not path.exists():
            drift.missing.append(name)
        elif path.read_bytes() != source.encode("utf-8"):
            drift.changed.append(name)
    if out_dir.is_dir():
        for path in sorted(out_dir.glob("*.py")):
            if path.name not in tree and is_generated(path):
                drift.extra.append(path.name)
    return drift


def unified_diff(out_dir: Path, tree: dict[str, str], drift: Drift) -> str:
    """The unified diff from what is on disk to what the specs generate."""
    chunks: list[str] = []
    for name in drift.changed + drift.missing + drift.extra:
        path = out_dir / name
        old = path.read_text(encoding="utf-8").splitlines(True) if path.exists() else []
        new = tree.get(name, "").splitlines(True)
        chunks.extend(
            difflib.unified_diff(old, new, f"a/{out_dir.name}/{name}", f"b/{out_dir.name}/{name}")
        )
    return "".join(chunks)


def _write_atomically(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class NotOurs(Exception):
    """A file posgen would overwrite, but did not write (it lacks posgen's header)."""


def write_file(path: Path, source: str) -> bool:
    """Write one file atomically if its bytes changed; True when it was written.

    Raises NotOurs, writing nothing, when ``path`` exists without posgen's header.
    """
    data = source.encode("utf-8")
    if path.exists():
        if path.is_file() and path.read_bytes() == data:
            return False
        if not is_generated(path):
            raise NotOurs(str(path))
    _write_atomically(path, data)
    return True


def write_tree(out_dir: Path, tree: dict[str, str]) -> Drift:
    """Write changed and missing files atomically, remove stale generated ones."""
    drift = compare(out_dir, tree)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in drift.changed + drift.missing:
        _write_atomically(out_dir / name, tree[name].encode("utf-8"))
    for name in drift.extra:
        (out_dir / name).unlink()
    return drift
