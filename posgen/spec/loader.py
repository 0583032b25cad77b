"""Read spec files into validated ``Spec`` objects, or into located diagnostics."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from posgen.spec.diagnostics import Diagnostic, SpecError, closest_name, dotted_path
from posgen.spec.model import Spec
from posgen.spec.names import class_name_for
from posgen.spec.yaml_source import FieldPath, LoadedYaml, YamlError, load_yaml


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec with the facts about its source file that generation records."""

    spec: Spec
    path: Path
    display_path: str
    sha256: str
    name_position: tuple[int, int] = (1, 1)


def display_path(path: Path) -> str:
    """The path as shown in diagnostics and headers: relative to the cwd when inside it."""
    resolved = path.resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return resolved.as_posix()


def load_spec(path: Path) -> LoadedSpec:
    """Load and validate one spec file; raises SpecError with every diagnostic found."""
    shown = display_path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise SpecError(
            [Diagnostic(shown, 1, 1, "<file>", f"cannot read: {error.strerror}")]
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpecError([Diagnostic(shown, 1, 1, "<file>", f"not UTF-8: {error.reason}")]) from None
    try:
        loaded = load_yaml(text, shown)
    except YamlError as error:
        raise SpecError([error.diagnostic]) from None
    try:
        spec = Spec.model_validate(loaded.data)
    except ValidationError as error:
        raise SpecError(_diagnostics(error, loaded, shown)) from None
    if spec.name != path.stem:
        line, col = loaded.position_of(("name",))
        raise SpecError(
            [
                Diagnostic(
                    shown,
                    line,
                    col,
                    "name",
                    f"name {spec.name!r} must match the file name {path.name!r} "
                    f"(expected {path.stem!r})",
                )
            ]
        )
    return LoadedSpec(
        spec, path, shown, hashlib.sha256(raw).hexdigest(), loaded.position_of(("name",))
    )


def load_specs(paths: Iterable[Path]) -> list[LoadedSpec]:
    """Load every spec, collecting all diagnostics of all files before failing."""
    loaded: list[LoadedSpec] = []
    diagnostics: list[Diagnostic] = []
    for path in paths:
        try:
            loaded.append(load_spec(path))
        except SpecError as error:
            diagnostics.extend(error.diagnostics)
    diagnostics += _collisions(loaded, lambda spec: spec.name, "spec name")
    diagnostics += _collisions(loaded, lambda spec: class_name_for(spec.name), "class name")
    if diagnostics:
        raise SpecError(diagnostics)
    return sorted(loaded, key=lambda item: item.spec.name)


def _collisions(
    loaded: list[LoadedSpec], key: Callable[[Spec], str], what: str
) -> list[Diagnostic]:
    """A diagnostic at the name of every spec whose ``key`` an earlier spec already took."""
    seen: dict[str, LoadedSpec] = {}
    found: list[Diagnostic] = []
    for item in loaded:
        value = key(item.spec)
        if value in seen:
            line, col = item.name_position
            found.append(
                Diagnostic(
                    item.display_path,
                    line,
                    col,
                    "name",
                    f"duplicate {what} {value!r} (also from {seen[value].display_path})",
                )
            )
        seen.setdefault(value, item)
    return found


def expand_spec_paths(arguments: Sequence[Path]) -> list[Path]:
    """Spec files named directly, or every ``*.yaml`` in a named directory, sorted."""
    files: list[Path] = []
    for argument in arguments:
        if argument.is_dir():
            files.extend(sorted(argument.glob("*.yaml")))
        else:
            files.append(argument)
    return files


# --------------------------------------------------------------------------- error mapping


def _diagnostics(error: ValidationError, loaded: LoadedYaml, shown: str) -> list[Diagnostic]:
    found: list[Diagnostic] = []
    for item in error.errors(include_url=False):
        path = _data_path(item["loc"], loaded.data)
        context = item.get("ctx") or {}
        kind = item["type"]
        if kind == "cross_field":
            path = path + tuple(str(context["at"]).split("."))
        if kind == "unknown_field":
            key_path = (*path, context["key"])
            line, col = loaded.key_positions.get(key_path, loaded.position_of(path))
            path = key_path
        else:
            line, col = loaded.position_of(path)
        found.append(Diagnostic(shown, line, col, dotted_path(path), _message(item)))
    # a union reports one error per failed member; keep each position's first
    unique: dict[tuple[int, int, str], Diagnostic] = {}
    for diagnostic in found:
        unique.setdefault((diagnostic.line, diagnostic.col, diagnostic.field), diagnostic)
    return list(unique.values())


def _data_path(loc: tuple[str | int, ...], data: object) -> FieldPath:
    """Drop union tags from a pydantic location, keeping the keys that exist in data."""
    path: list[str | int] = []
    current = data
    for part in loc:
        if isinstance(current, dict) and part in current:
            path.append(part)
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and part < len(current):
            path.append(part)
            current = current[part]
        elif isinstance(current, dict) and isinstance(part, str) and not _is_tag(part):
            path.append(part)  # a missing field: name it
            current = None
    return tuple(path)


def _is_tag(part: str) -> bool:
    """Union tags in pydantic locations: model kinds and validator labels."""
    return part.startswith(("function-", "literal[")) or part in _KNOWN_TAGS


_KNOWN_TAGS = {
    "keep",
    "drop",
    "absolute",
    "rotate",
    "bias",
    "untied_term",
    "learned",
    "sinusoidal",
    "log_buckets",
    "linear_slopes",
    "learned_table",
    "hierarchical",
    "ode",
    "depthwise_conv",
    "add",
    "multiply",
    "complex_order",
    "str",
    "int",
    "float",
    "bool",
    "none",
    "relative",
    "global",
    "plain",
    "clip",
    "distance",
}


def _message(item: ErrorDetails) -> str:
    kind = item["type"]
    context = item.get("ctx") or {}
    given = item.get("input")
    if kind == "missing":
        return "required field is missing"
    if kind == "literal_error":
        hint = ""
        if isinstance(given, str):
            options = [
                o.strip().strip("'")
                for o in str(context.get("expected", "")).replace(" or ", ", ").split(",")
            ]
            best = closest_name(given, [o for o in options if o])
            hint = f" (did you mean {best!r}?)" if best else ""
        return f"got {given!r}; allowed: {context.get('expected')}{hint}"
    if kind == "invalid_form":
        hint = ""
        if isinstance(given, str):
            best = closest_name(given, str(context.get("allowed", "")).split(", "))
            hint = f" (did you mean {best!r}?)" if best else ""
        return f"got {_short(given)}; {item['msg']}{hint}"
    if kind == "union_tag_invalid":
        best = closest_name(str(context.get("tag")), _split_tags(context.get("expected_tags")))
        hint = f" (did you mean {best!r}?)" if best else ""
        return f"unknown kind {context.get('tag')!r}; allowed: {context.get('expected_tags')}{hint}"
    if kind == "union_tag_not_found":
        return f"'kind' is required; allowed kinds: {_describe_tags(item)}"
    if kind in ("cross_field", "unknown_field", "module_name"):
        return item["msg"]
    if kind == "value_error":
        return str(item["msg"]).removeprefix("Value error, ")
    if kind == "bool_type" and isinstance(given, str):
        return f"got {given!r}; write true or false (YAML 1.1 words like yes/on are strings here)"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"got {_short(given)} ({type(given).__name__}); {item['msg'].lower()}"
    return f"got {_short(given)}; {item['msg'].lower()}"


def _split_tags(expected: object) -> list[str]:
    return [t.strip().strip("'") for t in str(expected or "").split(",")]


def _describe_tags(item: ErrorDetails) -> str:
    context = item.get("ctx") or {}
    return str(context.get("expected_tags") or context.get("discriminator") or "see docs")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
