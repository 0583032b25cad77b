"""The ``kind`` tags of the spec's unions and the words a field allows, found through
the models' fields: for the loader's error locations and the messages of a mapping that
lacks its ``kind`` or a field that is missing.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import Discriminator

from posgen.spec.model.base import KeywordModel, SpecModel
from posgen.spec.model.spec import Spec


def kind_tags() -> frozenset[str]:
    """Every ``kind`` value of the spec's models: the tags their unions report in error
    locations (the loader drops them to find the YAML position)."""
    tags: set[str] = set()
    for model in _spec_models():
        field = model.model_fields.get("kind")
        if field is not None:
            tags.update(a for a in typing.get_args(field.annotation) if isinstance(a, str))
    return frozenset(tags)


def _spec_models() -> list[type[SpecModel]]:
    """Every model of the spec language."""
    models: list[type[SpecModel]] = []
    pending: list[type[SpecModel]] = [SpecModel]
    while pending:
        for model in pending.pop().__subclasses__():
            pending.append(model)
            models.append(model)
    return models


def keyword_forms(class_name: str) -> list[str]:
    """The keywords that stand for a whole mapping of the model named ``class_name``
    (``scale: none`` for ``{kind: none}``), sorted; empty where it takes a mapping only."""
    for model in _spec_models():
        if model.__name__ == class_name:
            return sorted(model.keywords()) if issubclass(model, KeywordModel) else []
    return []


def kinds_at(path: tuple[str | int, ...], data: Any = None) -> list[str]:
    """The ``kind`` values allowed at a field of the spec (``path`` of keys and list
    indices from the top, as in the YAML), sorted; empty where the field is no union
    of kinds. For the message of a mapping that lacks its ``kind``.

    ``data``, the spec's parsed YAML, picks among a union's models the ones whose
    fields hold the mapping's keys there (an untied term's ``bias`` allows fewer kinds
    than a bias term's)."""
    annotations = _annotations_at(path, data)
    tags: set[str] = set()
    for annotation in annotations:
        for model in _alternatives(annotation):
            field = model.model_fields.get("kind") if _is_model(model) else None
            if field is not None:
                tags.update(a for a in typing.get_args(field.annotation) if isinstance(a, str))
    return sorted(tags)


def words_at(path: tuple[str | int, ...], data: Any = None) -> list[str]:
    """The words (``Literal`` values) a field of the spec allows, at ``path`` as in
    ``kinds_at``, in their declared order; empty where the field takes no fixed word.
    For the message of a required field that is missing."""
    annotations = _annotations_at(path, data)
    words: list[str] = []
    for annotation in annotations:
        for alternative in _alternatives(annotation):
            if typing.get_origin(alternative) is typing.Literal:
                words.extend(a for a in typing.get_args(alternative) if isinstance(a, str))
    return list(dict.fromkeys(words))


def forms_at(path: tuple[str | int, ...], data: Any = None) -> str | None:
    """The forms a term field at ``path`` takes, as its tagged union lists them ("keep,
    rotate": a keyword, or a mapping with that single key), or None where the field is
    no such union. For the message of a required term that is missing, whose ``Literal``
    words alone (``words_at``) leave out the mapping forms."""
    if not path or not isinstance(path[-1], str):
        return None
    annotations = _annotations_at(path[:-1], data)
    for annotation in annotations:
        for model in _alternatives(annotation):
            field = model.model_fields.get(path[-1]) if _is_model(model) else None
            for marker in [] if field is None else field.metadata:
                allowed = (getattr(marker, "custom_error_context", None) or {}).get("allowed")
                if isinstance(marker, Discriminator) and allowed:
                    return str(allowed)
    return None


def description_at(path: tuple[str | int, ...], data: Any = None) -> str | None:
    """The ``description`` of the model field at ``path`` (as in ``kinds_at``), or None
    where the field has none. For the message of a required field that is missing and
    takes no fixed word: what it is and the values it allows."""
    if not path or not isinstance(path[-1], str):
        return None
    for annotation in _annotations_at(path[:-1], data):
        for model in _alternatives(annotation):
            if not _is_model(model):
                continue
            for name, field in model.model_fields.items():
                if (field.alias or name) == path[-1] and field.description:
                    return field.description
    return None


def _annotations_at(path: tuple[str | int, ...], data: Any) -> list[Any]:
    """The annotations a field at ``path`` may have (``_field_types`` from the top, step
    by step along the parsed YAML ``data``)."""
    annotations: list[Any] = [Spec]
    node = data
    for part in path:
        annotations = [inner for a in annotations for inner in _field_types(a, part, node)]
        node = _child(node, part)
    return annotations


def _child(node: Any, part: str | int) -> Any:
    """``node[part]`` of parsed YAML, or None where there is none."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _alternatives(annotation: Any) -> list[Any]:
    """The types an annotation admits, through Annotated and unions (one level of each)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _alternatives(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _alternatives(arg)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    """Whether ``annotation`` is one of the spec's models."""
    return isinstance(annotation, type) and issubclass(annotation, SpecModel)


def _yaml_keys(model: type[SpecModel]) -> set[str]:
    """The keys a model's mapping may hold in YAML (aliases where set)."""
    return {field.alias or name for name, field in model.model_fields.items()}


def _field_types(annotation: Any, part: str | int, node: Any = None) -> list[Any]:
    """The annotations of field ``part`` (a key, or a list index) of a value annotated
    ``annotation`` whose parsed YAML is ``node``: a model's field (of the models whose
    fields hold every key of ``node``, where any does), a dict's values, a list's or
    tuple's items."""
    alternatives = _alternatives(annotation)
    if isinstance(node, dict):
        fitting = [a for a in alternatives if _is_model(a) and set(node) <= _yaml_keys(a)]
        alternatives = fitting or alternatives
    found: list[Any] = []
    for alternative in alternatives:
        origin = typing.get_origin(alternative)
        if _is_model(alternative) and isinstance(part, str):
            named = alternative.model_fields.items()  # found by YAML key: alias or name
            field = next((f for n, f in named if (f.alias or n) == part), None)
            found.extend([] if field is None else [field.annotation])
        elif origin is dict and isinstance(part, str):
            found.append(typing.get_args(alternative)[1])
        elif origin in (list, tuple) and isinstance(part, int):
            found.extend(a for a in typing.get_args(alternative) if a is not Ellipsis)
    return found
