"""Read spec files into validated ``Spec`` objects, or into located diagnostics.

Limits (each refused with a ``file:line:col`` diagnostic, never a traceback): a spec
file is a regular file of at most ``MAX_SPEC_BYTES``; its YAML nests at most
``MAX_NESTING`` levels and its number literals hold at most ``MAX_NUMBER_CHARS``
characters (both checked in ``yaml_source``); the fields' own bounds are in ``model``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from posgen.spec.bounded_file import FileRule, RefusedFile, read_bounded
from posgen.spec.diagnostics import Diagnostic, SpecError, closest_name, dotted_path, quoted
from posgen.spec.model import (
    FORM_SHAPES,
    Spec,
    description_at,
    forms_at,
    keyword_forms,
    kind_tags,
    kinds_at,
    spec_name_problem,
    words_at,
)
from posgen.spec.names import class_name_for
from posgen.spec.yaml_source import (
    MAX_NESTING,
    MAX_NUMBER_CHARS,
    FieldPath,
    LoadedYaml,
    YamlError,
    load_yaml,
    text_position,
)

__all__ = [
    "MAX_NESTING",
    "MAX_NUMBER_CHARS",
    "MAX_SPEC_BYTES",
    "LoadedSpec",
    "display_path",
    "expand_spec_paths",
    "load_spec",
    "load_specs",
    "unique_paths",
]

MAX_SPEC_BYTES = 256 * 1024
"""The largest spec file read, 256 KiB, checked before the file is read or parsed.

A spec is a hand-written page (the catalogue's largest is under 2 KiB). PyYAML's pure
Python parser takes about a minute and 1.5 GB for a 5 MB file, so anything this far
past a real spec is refused up front instead of parsed.
"""


@dataclass(frozen=True)
class LoadedSpec:
    """A validated spec with the facts about its source file that generation records."""

    spec: Spec
    path: Path
    display_path: str
    sha256: str
    name_position: tuple[int, int] = (1, 1)


SPEC_SUFFIXES = (".yaml", ".yml")
"""A spec file's name is its spec's name plus one of these (the generated header names it)."""


def display_path(path: Path) -> str:
    """The path as shown in diagnostics and headers, as given (a symlink keeps its own
    name): relative to the cwd when inside it."""
    absolute = Path(os.path.abspath(path))
    try:
        return absolute.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return absolute.as_posix()


def load_spec(path: Path) -> LoadedSpec:
    """Load and validate one spec file; raises SpecError with every diagnostic found."""
    shown = display_path(path)
    raw = _read_spec_bytes(path, shown)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line, col = _byte_position(raw, error.start)
        message = f"not UTF-8: byte 0x{raw[error.start]:02x}, {error.reason}"
        raise SpecError([Diagnostic(shown, line, col, "<file>", message)]) from None
    try:
        loaded = load_yaml(text, shown)
    except YamlError as error:
        raise SpecError([error.diagnostic]) from None
    try:
        spec = Spec.model_validate(loaded.data)
    except ValidationError as error:
        raise SpecError(_diagnostics(error, loaded, shown)) from None
    if spec.name != path.stem or path.suffix not in SPEC_SUFFIXES:
        line, col = loaded.position_of(("name",))
        renamed = quoted(f"{spec.name}.yaml")
        if spec.name == path.stem or spec_name_problem(path.stem) is not None:
            fix = f"rename the file {renamed}"
        else:
            fix = f"set name: {path.stem}, or rename the file {renamed}"
        message = (
            f"name {spec.name!r} must match the file name {quoted(path.name)}: a spec file "
            f"is NAME.yaml or NAME.yml ({fix})"
        )
        raise SpecError([Diagnostic(shown, line, col, "name", message)])
    return LoadedSpec(
        spec, path, shown, hashlib.sha256(raw).hexdigest(), loaded.position_of(("name",))
    )


def _byte_position(raw: bytes, offset: int) -> tuple[int, int]:
    """1-based (line, column) of byte ``offset``, the column in characters (the bytes
    before it, where decoding failed, are valid UTF-8)."""
    before = raw[:offset].decode("utf-8", errors="replace")
    return text_position(before, len(before))


_SPEC_FILE = FileRule(MAX_SPEC_BYTES, "a spec is a plain YAML file", "a spec file")


def _read_spec_bytes(path: Path, shown: str) -> bytes:
    """The bytes of a regular file of at most ``MAX_SPEC_BYTES``, or a SpecError
    (``read_bounded``: a FIFO would block the read for ever, a device never end)."""
    try:
        return read_bounded(path, _SPEC_FILE)
    except RefusedFile as error:
        raise SpecError([Diagnostic(shown, 1, 1, "<file>", str(error))]) from None


def load_specs(paths: Iterable[Path]) -> list[LoadedSpec]:
    """Load every spec, collecting all diagnostics of all files before failing.

    A file named twice (directly, through its folder, or by another spelling of its
    path) is loaded once, where it was first named.
    """
    loaded: list[LoadedSpec] = []
    diagnostics: list[Diagnostic] = []
    for path in unique_paths(paths):
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


def specs_in(folder: Path) -> list[Path]:
    """The spec files directly in ``folder`` (``*.yaml`` and ``*.yml``), sorted by name."""
    return sorted(
        (path for suffix in SPEC_SUFFIXES for path in folder.glob(f"*{suffix}")),
        key=lambda path: path.name,
    )


def expand_spec_paths(arguments: Sequence[Path]) -> list[Path]:
    """Spec files named directly, or every spec file in a named directory (``specs_in``).

    Each file appears once, where it was first named (``unique_paths``).
    """
    files: list[Path] = []
    for argument in arguments:
        if argument.is_dir():
            files.extend(specs_in(argument))
        else:
            files.append(argument)
    return unique_paths(files)


def unique_paths(paths: Iterable[Path]) -> list[Path]:
    """``paths`` without repeats of the same file (compared resolved), first-seen order.

    A path that cannot be resolved (a symbolic-link loop) is kept as named: reading it
    then reports the file as unreadable, as for any other spec that cannot be read.
    """
    seen: set[Path] = set()
    unique: list[Path] = []
    for path in paths:
        try:
            key = path.resolve()
        except (OSError, RuntimeError):  # RuntimeError: a loop, before Python 3.13
            key = path.absolute()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


# --------------------------------------------------------------------------- error mapping


def _diagnostics(error: ValidationError, loaded: LoadedYaml, shown: str) -> list[Diagnostic]:
    found: list[Diagnostic] = []
    for item in error.errors(include_url=False):
        path = _data_path(item["loc"], loaded.data)
        context = item.get("ctx") or {}
        kind = item["type"]
        if kind == "cross_field":
            # a part of digits is a list index (init.2); no field or name is all digits
            at = str(context["at"]).split(".")
            path = path + tuple(int(part) if part.isdigit() else part for part in at)
        if kind == "expr":
            path = (*path, "expr")
            line, col = _expr_position(loaded, path, int(context.get("offset", 0)))
        elif kind == "unknown_field":
            key_path = (*path, context["key"])
            line, col = loaded.key_positions.get(key_path, loaded.position_of(path))
            path = key_path
        else:
            line, col = loaded.position_of(path)
        message = _message(item, path, loaded.data)
        found.append(Diagnostic(shown, line, col, dotted_path(path), message))
    # a union reports one error per failed member; keep each position's first
    unique: dict[tuple[int, int, str], Diagnostic] = {}
    for diagnostic in found:
        unique.setdefault((diagnostic.line, diagnostic.col, diagnostic.field), diagnostic)
    return list(unique.values())


def _expr_position(loaded: LoadedYaml, path: FieldPath, offset: int) -> tuple[int, int]:
    """The file position of character ``offset`` of an expression string.

    Exact for a one-line plain or quoted scalar spelled verbatim; otherwise the position
    of the scalar itself (the message names the character either way).
    """
    start = loaded.text_starts.get(path)
    if start is None:
        return loaded.position_of(path)
    return start[0], start[1] + offset


def _data_path(loc: tuple[str | int, ...], data: object) -> FieldPath:
    """Drop union tags from a pydantic location, keeping the keys that exist in data."""
    path: list[str | int] = []
    current = data
    tag_skipped = False  # the tag of the dict at hand is dropped once: its field may follow
    for part in loc:
        if (
            isinstance(current, dict)
            and not tag_skipped
            and current.get("kind") == part
            and _is_tag(str(part))
        ):
            tag_skipped = True
            continue  # a union tag that is also a field name (kind: expr has a key expr)
        if isinstance(current, dict) and part in current:
            path.append(part)
            current = current[part]
            tag_skipped = False
        elif isinstance(current, list) and isinstance(part, int) and part < len(current):
            path.append(part)
            current = current[part]
            tag_skipped = False
        elif (
            isinstance(current, dict)
            and isinstance(part, str)
            and _names_a_field(part, tag_skipped)
        ):
            path.append(part)  # a missing field: name it
            current = None
    return tuple(path)


def _names_a_field(part: str, tag_skipped: bool) -> bool:
    """Whether a location part that is no key of the YAML mapping at hand names one of
    its fields (then missing): not a union tag, unless the mapping's own tag was just
    dropped (``kind: expr`` without its ``expr``), and no validator label."""
    if part.startswith(("function-", "literal[")):
        return False
    return tag_skipped or not _is_tag(part)


def _is_tag(part: str) -> bool:
    """Union tags in pydantic locations: model kinds and validator labels."""
    return part.startswith(("function-", "literal[")) or part in _KNOWN_TAGS


# Term forms and the type labels pydantic gives union members; every model kind is added
# from the model itself, so a new kind needs no entry here.
_FORM_TAGS = {
    "keep",
    "drop",
    "absolute",
    "rotate",
    "bias",
    "untied_term",
    "contextual",
    "relative",
    "global",
    "plain",
    "str",
    "int",
    "float",
    "bool",
    "none",
}
_KNOWN_TAGS = _FORM_TAGS | kind_tags()


_MISSING_HINTS: dict[FieldPath, str] = {
    ("claims",): "required: state unique, relative, decay, extrapolates (true/false), e.g. "
    "claims: {relative: true, decay: true}",
    ("scale",): "required: none (no scale, as T5) or inv_sqrt_head_dim (1/sqrt(head_dim)), "
    "or {kind: inv_sqrt_head_dim, factor: F} for 1/sqrt(F * head_dim)",
}
"""Messages for required fields whose plain "required field is missing" says too little."""


def _message(item: ErrorDetails, path: FieldPath = (), data: object = None) -> str:
    """The message of one pydantic error at ``path`` of the spec's parsed YAML ``data``."""
    kind = item["type"]
    context = item.get("ctx") or {}
    given = item.get("input")
    if kind == "missing":
        forms = forms_at(path, data)  # a term: its keywords and its mappings
        words = [] if forms is not None else words_at(path, data)
        allowed = f"; allowed: {_either(words)}" if words else ""
        description = None if words or forms is not None else description_at(path, data)
        if description:
            allowed = f"; {description}"
        if forms is not None:
            allowed = f"; allowed: one of {forms} {FORM_SHAPES}"
        return _MISSING_HINTS.get(path, f"required field is missing{allowed}")
    if kind == "literal_error":
        hint = ""
        if isinstance(given, str):
            options = [
                o.strip().strip("'")
                for o in str(context.get("expected", "")).replace(" or ", ", ").split(",")
            ]
            best = closest_name(given, [o for o in options if o])
            hint = f" (did you mean {best!r}?)" if best else ""
        return f"got {quoted(given)}; allowed: {context.get('expected')}{hint}"
    if kind == "invalid_form":
        hint = ""
        if isinstance(given, str):
            best = closest_name(given, str(context.get("allowed", "")).split(", "))
            hint = f" (did you mean {best!r}?)" if best else ""
        return f"got {quoted(given)}; {item['msg']}{hint}"
    if kind == "union_tag_invalid":
        tag = context.get("tag")
        best = closest_name(str(tag), _split_tags(context.get("expected_tags")))
        hint = f" (did you mean {best!r}?)" if best else ""
        return f"unknown kind {quoted(tag)}; allowed: {context.get('expected_tags')}{hint}"
    if kind == "union_tag_not_found":
        allowed = ", ".join(repr(t) for t in kinds_at(path, data)) or _describe_tags(item)
        return f"'kind' is required; allowed kinds: {allowed}"
    if kind in ("cross_field", "unknown_field", "module_name", "free_text", "expr"):
        return item["msg"]
    if kind == "value_error":
        return str(item["msg"]).removeprefix("Value error, ")
    if kind == "model_type":  # a scalar or a list where a mapping of fields belongs
        keywords = keyword_forms(str(context.get("class_name", "")))
        shape = "a mapping of its fields"
        if keywords:
            shape = f"one of {', '.join(map(repr, keywords))} or {shape}"
        return f"got {_typed(given)}; write {shape}"
    if kind == "model_attributes_type":  # the same where a union of kinds' mapping belongs
        kinds = ", ".join(repr(tag) for tag in kinds_at(path, data))
        shape = f"a mapping with its kind ({kinds})" if kinds else "a mapping of fields"
        return f"got {_typed(given)}; write {shape}"
    if kind == "bool_type" and isinstance(given, str):
        return (
            f"got {quoted(given)}; write true or false (YAML 1.1 words like yes/on are "
            "strings here)"
        )
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"got {_typed(given)}; {item['msg'].lower()}"
    return f"got {quoted(given)}; {item['msg'].lower()}"


def _either(words: Sequence[str]) -> str:
    """'a', 'b' or 'c', as pydantic lists a Literal's words."""
    quoted_words = [repr(w) for w in words]
    if len(quoted_words) < 2:
        return "".join(quoted_words)
    return f"{', '.join(quoted_words[:-1])} or {quoted_words[-1]}"


def _typed(given: object) -> str:
    """A wrong-typed YAML value and its type, in YAML's words for an empty one."""
    if given is None:
        return "null (an empty value)"
    return f"{quoted(given)} ({type(given).__name__})"


def _split_tags(expected: object) -> list[str]:
    return [t.strip().strip("'") for t in str(expected or "").split(",")]


def _describe_tags(item: ErrorDetails) -> str:
    context = item.get("ctx") or {}
    return str(context.get("expected_tags") or context.get("discriminator") or "see docs")
