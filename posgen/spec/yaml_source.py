"""Strict YAML loading that remembers where every value came from.

Specs are small, hand-written files, so the loader is deliberately narrow: the safe
subset of YAML with plain mappings, sequences and scalars. It rejects what makes a
spec ambiguous or surprising: duplicate keys, anchors and aliases, merge keys (``<<``),
explicit tags, non-finite numbers, and YAML 1.1 booleans such as ``yes``/``on`` (they
load as strings, so a strict boolean field rejects them with a clear message).

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

from posgen.spec.diagnostics import Diagnostic, dotted_path

FieldPath = tuple[str | int, ...]
Position = tuple[int, int]

_BOOL_TRUE = re.compile(r"^(true|True|TRUE)$")
_BOOL_FALSE = re.compile(r"^(false|False|FALSE)$")
_INT = re.compile(r"^[-+]?(0|[1-9][0-9_]*)$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$")
_NON_FINITE = re.compile(r"^[-+]?\.(inf|Inf|INF|nan|NaN|NAN)$")
_NULL = re.compile(r"^(~|null|Null|NULL)$")


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
            key_path = (*path, key)
            if key in result:
                first_line, first_col = self.loaded.key_positions[key_path]
                raise self.fail(
                    key_node,
                    key_path,
                    f"duplicate key {key!r} (first defined at line {first_line}, col {first_col})",
                )
            self.loaded.key_positions[key_path] = _position(key_node)
            result[key] = self.build(value_node, key_path)
        return result

    def build_scalar(self, node: ScalarNode, path: FieldPath) -> object:
        text = node.value
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
        if _INT.match(text):
            return int(text.replace("_", ""))
        if _FLOAT.match(text) and any(ch.isdigit() for ch in text):
            value = float(text.replace("_", ""))
            if not math.isfinite(value):
                raise self.fail(node, path, f"number {text!r} overflows to infinity")
            return value
        return text


def _reject_forbidden_events(text: str, source_name: str) -> None:
    """Anchors, aliases and explicit tags are visible only at the event level."""
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        where = (source_name, *_mark_position(event.start_mark), "<document>")
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise YamlError(Diagnostic(*where, "anchors and aliases (&, *) are not allowed"))
        tag = getattr(event, "tag", None)
        if tag is not None and not (isinstance(event, yaml.ScalarEvent) and tag == "!"):
            raise YamlError(Diagnostic(*where, f"explicit tags ({tag}) are not allowed"))


def load_yaml(text: str, source_name: str) -> LoadedYaml:
    """Parse one YAML document strictly, recording the position of every value.

    Raises YamlError (with file:line:col) for syntax errors and for any construct
    the spec format forbids.
    """
    builder = _Builder(source_name, text)
    try:
        _reject_forbidden_events(text, source_name)
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as error:
        line, col = _mark_position(error.problem_mark or error.context_mark)
        problem = error.problem or str(error)
        raise YamlError(
            Diagnostic(source_name, line, col, "<document>", f"invalid YAML: {problem}")
        ) from None
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
