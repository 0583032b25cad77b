"""Strict YAML loading that remembers where every value came from.

Specs are small, hand-written files, so the loader is deliberately narrow: the safe
subset of YAML with plain mappings, sequences and scalars. It rejects what makes a
spec ambiguous or surprising: duplicate keys, anchors and aliases, merge keys (``<<``),
explicit tags, non-finite numbers, and YAML 1.1 booleans such as ``yes``/``on`` (they
load as strings, so a strict boolean field rejects them with a clear message). Number
forms that YAML 1.1 and 1.2 read differently (``010``, ``0o17``, ``0x1F``, ``1_000``,
``1:20``) are rejected with the value each reading gives, as are number literals longer
than ``MAX_NUMBER_CHARS`` and nesting deeper than ``MAX_NESTING``.

Every value's position is recorded under its path (a tuple of keys and indices), so a
later validation error can point at ``file:line:col``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Protocol

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from posgen.spec.diagnostics import Diagnostic, dotted_path, printable, quoted

FieldPath = tuple[str | int, ...]
Position = tuple[int, int]

MAX_NESTING = 32
"""The deepest a spec's mappings and lists may nest (the catalogue needs 6 levels).

PyYAML composes nodes recursively, so about 500 nested ``[`` overflow Python's stack
(a RecursionError, not a diagnostic); the limit is checked on the parser's events,
before anything is composed, and leaves room for every form a spec can take.
"""

MAX_NUMBER_CHARS = 64
"""The longest number literal a spec may hold (a spec's numbers have at most 10 digits).

Python refuses to convert an integer of more than 4,300 digits (ValueError: Exceeds the
limit); a literal past this length is reported as too long before any conversion.
"""

_BOOL_TRUE = re.compile(r"^(true|True|TRUE)$")
_BOOL_FALSE = re.compile(r"^(false|False|FALSE)$")
_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$")
_NON_FINITE = re.compile(r"^[-+]?\.(inf|Inf|INF|nan|NaN|NAN)$")
_MANTISSA_DIGIT = re.compile(r"[1-9]")  # a float written with a nonzero digit is not 0
_NULL = re.compile(r"^(~|null|Null|NULL)$")
# number forms that YAML 1.1 and YAML 1.2 read differently (or only one of them reads)
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+(\.[0-9_]*)?([eE][-+]?[0-9]+)?$")
_PREFIXED = re.compile(r"^[-+]?0([xXoObB])[0-9a-fA-F_]*$")
_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?$")
_PREFIX_NAMES = {"x": "hexadecimal", "o": "octal", "b": "binary"}


class YamlError(Exception):
    """A spec file that is not acceptable YAML; carries one diagnostic."""

    def __init__(self, diagnostic: Diagnostic) -> None:
        super().__init__(diagnostic.render())
        self.diagnostic = diagnostic


@dataclass
class LoadedYaml:
    """A parsed document plus the source position of every value and key."""

    data: object
    value_positions: dict[FieldPath, Position] = field(default_factory=dict)
    key_positions: dict[FieldPath, Position] = field(default_factory=dict)
    # where the text of a one-line string scalar starts, when its source spells the value
    # character for character (plain, or quoted without escapes): offsets inside the
    # string (an expression's tokens) then map to columns
    text_starts: dict[FieldPath, Position] = field(default_factory=dict)

    def position_of(self, path: FieldPath) -> Position:
        """The position of the deepest recorded prefix of ``path`` (1-based line, col)."""
        for end in range(len(path), -1, -1):
            prefix = path[:end]
            if prefix in self.value_positions:
                return self.value_positions[prefix]
        return (1, 1)


class _Mark(Protocol):
    """A source position as PyYAML's pure-Python and C marks both carry it (0-based)."""

    line: int
    column: int


def _mark_position(mark: _Mark | None) -> Position:
    """1-based (line, col) of a mark; (1, 1) when PyYAML recorded none."""
    return (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)


def _position(node: Node) -> Position:
    return _mark_position(node.start_mark)


class _Builder:
    def __init__(self, source_name: str, text: str) -> None:
        self.source_name = source_name
        self.text = text
        self.loaded = LoadedYaml(data=None)
        self._lines: list[str] | None = None

    def _record_text_start(self, node: ScalarNode, path: FieldPath) -> None:
        if self._lines is None:
            self._lines = self.text.split("\n")
        start = _text_start(node, self._lines)
        if start is not None:
            self.loaded.text_starts[path] = start

    def fail(self, node: Node | None, path: FieldPath, message: str) -> YamlError:
        line, col = _position(node) if node is not None else (1, 1)
        return YamlError(Diagnostic(self.source_name, line, col, dotted_path(path), message))

    def build(self, node: Node, path: FieldPath) -> object:
        self.loaded.value_positions[path] = _position(node)
        if isinstance(node, MappingNode):
            return self.build_mapping(node, path)
        if isinstance(node, SequenceNode):
            return [self.build(item, (*path, index)) for index, item in enumerate(node.value)]
        assert isinstance(node, ScalarNode)
        return self.build_scalar(node, path)

    def build_mapping(self, node: MappingNode, path: FieldPath) -> dict[str, object]:
        result: dict[str, object] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or key_node.value == "<<":
                raise self.fail(key_node, path, "merge keys (<<) are not allowed in specs")
            if not isinstance(key_node, ScalarNode):
                raise self.fail(key_node, path, "mapping keys must be plain strings")
            key = key_node.value
            if _has_surrogate(key):
                raise self.fail(
                    key_node,
                    path,
                    f"mapping key {ascii(key)} holds "
                    "a lone surrogate (\\ud800-\\udfff), which is not a character; keys are "
                    "field names",
                )
            key_path = (*path, key)
            if key in result:
                first_line, first_col = self.loaded.key_positions[key_path]
                raise self.fail(
                    key_node,
                    key_path,
                    f"duplicate key {quoted(key)} (first defined at line {first_line}, "
                    f"col {first_col})",
                )
            self.loaded.key_positions[key_path] = _position(key_node)
            result[key] = self.build(value_node, key_path)
        return result

    def build_scalar(self, node: ScalarNode, path: FieldPath) -> object:
        text = node.value
        self._record_text_start(node, path)
        if node.style is not None and node.style != "":
            return text  # quoted or block scalar: always a string
        if _NON_FINITE.match(text):
            raise self.fail(node, path, f"non-finite number {text!r} is not allowed")
        if _NULL.match(text) or text == "":
            return None
        if _BOOL_TRUE.match(text):
            return True
        if _BOOL_FALSE.match(text):
            return False
        problem = _number_problem(text)
        if problem is not None:
            raise self.fail(node, path, problem)
        if _INT.match(text):
            return int(text)
        if _FLOAT.match(text) and any(ch.isdigit() for ch in text):
            value = float(text)
            if not math.isfinite(value):
                raise self.fail(node, path, f"number {text!r} overflows to infinity")
            if value == 0.0 and _MANTISSA_DIGIT.search(text.split("e")[0].split("E")[0]):
                raise self.fail(
                    node, path, f"number {text!r} underflows to 0 (float64 reaches down to ~5e-324)"
                )
            return value
        return text


def _has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate code point (YAML's "\\udc80" escape makes
    one), which no UTF-8 text can carry."""
    return any("\ud800" <= character <= "\udfff" for character in text)


def _text_start(node: ScalarNode, source_lines: list[str]) -> Position | None:
    """Where a one-line scalar's value starts in the source, if spelled verbatim."""
    start, end = node.start_mark, node.end_mark
    if start is None or end is None or start.line != end.line or start.line >= len(source_lines):
        return None
    raw = source_lines[start.line][start.column : end.column]
    quote = 1 if node.style in ("'", '"') else 0
    if node.style not in (None, "", "'", '"'):
        return None
    if raw[quote : len(raw) - quote] != node.value:
        return None
    return (start.line + 1, start.column + 1 + quote)


def _is_number_form(text: str) -> bool:
    """Whether a plain scalar is written as a number in any form YAML 1.1 or 1.2 knows."""
    patterns = (_INT, _FLOAT, _LEADING_ZERO, _PREFIXED, _SEXAGESIMAL)
    return any(pattern.match(text) for pattern in patterns) and any(c.isdigit() for c in text)


def _number_problem(text: str) -> str | None:
    """Why a plain scalar written as a number is refused, or None if it is unambiguous.

    Refused: literals longer than ``MAX_NUMBER_CHARS``, leading zeros (YAML 1.1 octal),
    ``0x``/``0o``/``0b`` prefixes, digit separators (``1_000``) and sexagesimal
    ``1:20``: YAML 1.1 and YAML 1.2 give them different values, or one reads text.
    """
    if not _is_number_form(text):
        return None
    hint = "write the decimal number, or quote the value if it is text"
    if len(text) > MAX_NUMBER_CHARS:
        return (
            f"number literal is too long ({len(text):,} characters; at most "
            f"{MAX_NUMBER_CHARS}): {hint}"
        )
    prefixed = _PREFIXED.match(text)
    if prefixed is not None:
        base = _PREFIX_NAMES[prefixed.group(1).lower()]
        value = _prefixed_value(text)
        written = str(value) if value is not None else "the decimal number"
        return (
            f"{base} form {text!r} is not allowed: specs write numbers in decimal (YAML 1.1 "
            f"and YAML 1.2 disagree on 0o and 0b, and YAML 1.1 reads 0o17 as text): write "
            f"{written}, or quote the value if it is text"
        )
    if _SEXAGESIMAL.match(text):
        return (
            f"sexagesimal (base 60) form {text!r} is not allowed (YAML 1.1 reads "
            f"{_sexagesimal_value(text)}, YAML 1.2 reads text): {hint}"
        )
    if _LEADING_ZERO.match(text):
        return _leading_zero_problem(text)
    if "_" in text:
        return (
            f"digit separators in {text!r} are not allowed (YAML 1.1 drops them, YAML 1.2 "
            f"reads text): write {_decimal(text)}"
        )
    return None


def _leading_zero_problem(text: str) -> str:
    """``010``: octal 8 in YAML 1.1, 10 in YAML 1.2 (``09``: text in YAML 1.1)."""
    digits = text.replace("_", "")
    if re.fullmatch(r"[-+]?[0-9]+", digits):
        octal = re.fullmatch(r"[-+]?[0-7]+", digits)
        reading = f"octal {int(digits, 8)}" if octal else "text"
        readings = f"YAML 1.1 reads {reading}, YAML 1.2 reads {_decimal(text)}"
    else:
        readings = "a leading zero marks octal integers in YAML 1.1"
    return f"leading zero in {text!r} is not allowed ({readings}): write {_decimal(text)}"


def _decimal(text: str) -> str:
    """The plain decimal spelling of a number written with leading zeros or separators."""
    digits = text.replace("_", "")
    if re.fullmatch(r"[-+]?[0-9]+", digits):
        return str(int(digits))
    return repr(float(digits))


def _prefixed_value(text: str) -> int | None:
    """The value of ``0x1F``, ``0o17`` or ``0b101`` (with sign), or None if malformed."""
    try:
        return int(text.replace("_", ""), 0)
    except ValueError:
        return None


def _sexagesimal_value(text: str) -> str:
    """YAML 1.1's reading of ``1:20`` (80): base-60 digits, the last one may be a float."""
    sign = -1 if text.startswith("-") else 1
    value = 0.0
    for part in text.lstrip("+-").replace("_", "").split(":"):
        value = value * 60 + float(part)
    value *= sign
    return str(int(value)) if value.is_integer() else repr(value)


class _CheckingLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses anchors, aliases, explicit tags and deep
    nesting as each parser event is taken, in the one pass that composes the document
    (a separate pass over the events doubled the time: 2.7 s for a 250 KiB spec).

    Nesting is checked at each collection's start event, before the composer recurses
    into it, so nesting deeper than ``MAX_NESTING`` never reaches PyYAML's recursive
    composer (about 500 levels overflow Python's stack).
    """

    def __init__(self, stream: str, source_name: str) -> None:
        super().__init__(stream)
        self.source_name = source_name
        self.depth = 0

    def get_event(self) -> yaml.Event:
        event = super().get_event()
        where = (self.source_name, *_mark_position(event.start_mark), "<document>")
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise YamlError(Diagnostic(*where, "anchors and aliases (&, *) are not allowed"))
        tag = getattr(event, "tag", None)
        if tag is not None and not (isinstance(event, yaml.ScalarEvent) and tag == "!"):
            raise YamlError(Diagnostic(*where, f"explicit tags ({tag}) are not allowed"))
        if isinstance(event, yaml.CollectionStartEvent):
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise YamlError(
                    Diagnostic(
                        *where,
                        f"mappings and lists nest more than {MAX_NESTING} levels deep; "
                        f"a spec nests at most {MAX_NESTING}",
                    )
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            self.depth -= 1
        return event


def _composed(text: str, source_name: str) -> list[Node]:
    """Every document of ``text`` composed into nodes by ``_CheckingLoader``."""
    loader = _CheckingLoader(text, source_name)
    try:
        nodes: list[Node] = []
        while loader.check_node():
            node = loader.get_node()
            assert node is not None  # check_node said a document follows
            nodes.append(node)
        return nodes
    finally:
        loader.dispose()


def text_position(text: str, offset: int) -> Position:
    """1-based (line, column) of character ``offset`` of ``text``, lines ending at LF."""
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1


# Line breaks to YAML other than LF and CR LF, which posgen's positions count: a lone
# carriage return, NEL, and the Unicode line and paragraph separators
_OTHER_LINE_BREAK = re.compile("\r(?!\n)|[\x85\u2028\u2029]")


# Characters that look like a space (no-break, the typographic spaces, zero-width ones)
# and that YAML reads as text: after a colon one turns "key: value" into a plain scalar,
# and YAML reports the error where the mapping breaks, often lines later
_SPACE_LOOKALIKE = re.compile("[\u00a0\u1680\u2000-\u200b\u202f\u205f\u3000]")


def _reject_other_line_breaks(text: str, source_name: str) -> None:
    """Refuse a raw line break other than LF or CR LF: PyYAML would count it as a new
    line, so every position after it would be off by one line."""
    found = _OTHER_LINE_BREAK.search(text)
    if found is None:
        return
    line, col = text_position(text, found.start())
    code = f"U+{ord(found.group()):04X}"
    message = (
        f"invalid YAML: a raw {code}, a line break to YAML; a spec's lines end with LF "
        "(or CR LF), and text that needs the character writes it as an escape in a "
        "double-quoted string"
    )
    raise YamlError(Diagnostic(source_name, line, col, "<document>", message))


def _reader_error(error: yaml.reader.ReaderError, text: str, source_name: str) -> YamlError:
    """A character YAML refuses (a control character), at its line and column."""
    line, col = text_position(text, error.position)
    character = error.character
    shown = chr(character) if isinstance(character, int) else str(character)
    message = (
        f"invalid YAML: character {printable(shown)} (U+{ord(shown[:1] or chr(0)):04X}) is not "
        "allowed in a YAML file (control characters must be escaped in a double-quoted "
        "string, and spec text refuses them there too)"
    )
    return YamlError(Diagnostic(source_name, line, col, "<document>", message))


def load_yaml(text: str, source_name: str) -> LoadedYaml:
    """Parse one YAML document strictly, recording the position of every value.

    Raises YamlError (with file:line:col) for syntax errors and for any construct
    the spec format forbids.
    """
    _reject_other_line_breaks(text, source_name)
    builder = _Builder(source_name, text)
    try:
        nodes = _composed(text, source_name)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line, col = _mark_position(mark)
        problem = error.problem or str(error)
        lookalike = _SPACE_LOOKALIKE.search(text, 0, mark.index + 1 if mark else len(text))
        if lookalike is not None:  # the likely cause, often lines before the error
            line, col = text_position(text, lookalike.start())
            problem = (
                f"{problem}; a raw U+{ord(lookalike.group()):04X} here looks like a space "
                "but is not one to YAML: write a plain space"
            )
        raise YamlError(
            Diagnostic(source_name, line, col, "<document>", f"invalid YAML: {problem}")
        ) from None
    except yaml.reader.ReaderError as error:
        raise _reader_error(error, text, source_name) from None
    except yaml.YAMLError as error:
        raise YamlError(
            Diagnostic(source_name, 1, 1, "<document>", f"invalid YAML: {error}")
        ) from None
    if len(nodes) != 1:
        raise YamlError(
            Diagnostic(
                source_name,
                1,
                1,
                "<document>",
                f"a spec file holds exactly one YAML document (found {len(nodes)})",
            )
        )
    root = nodes[0]
    if not isinstance(root, MappingNode):
        raise builder.fail(root, (), "a spec must be a mapping of fields (name: ..., terms: ...)")
    builder.loaded.data = builder.build(root, ())
    return builder.loaded
