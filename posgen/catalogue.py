"""The catalogue ``posgen list`` prints: one row per encoding, or the encodings by model."""

from __future__ import annotations

from collections.abc import Sequence

from posgen.spec.model import Spec


def term_word(value: object) -> str:
    """A term in one word: its keyword (``keep``, ``drop``) or its form (``rotate``, ``bias``)."""
    return value if isinstance(value, str) else str(getattr(value, "form", value))


def encoding_rows(specs: Sequence[Spec]) -> list[str]:
    """A header, a rule, and per encoding its terms in short, title and models; each
    column as wide as its longest word (``contextual``) and one space."""
    rows = [
        [
            spec.name,
            term_word(spec.terms.content_content),
            term_word(spec.terms.content_position),
            term_word(spec.terms.position_content),
            term_word(spec.terms.position_position),
            term_word(spec.values),
        ]
        for spec in specs
    ]
    header = ["name", "cc", "cp", "pc", "pp", "values"]
    minimum = [18, 7, 9, 9, 9, 9]  # the widths of a catalogue of short words
    widths = [
        max([least, len(title), *(len(row[column]) for row in rows)])
        for column, (least, title) in enumerate(zip(minimum, header, strict=True))
    ]

    def line(cells: Sequence[str], last: str) -> str:
        padded = (f"{cell:<{width}}" for cell, width in zip(cells, widths, strict=True))
        return " ".join(padded) + f" {last}"

    top = line(header, "title / used by")
    lines = [top, "-" * len(top)]
    indent = sum(widths) + len(widths)
    for spec, row in zip(specs, rows, strict=True):
        lines.append(line(row, spec.title))
        if spec.models:
            lines.append(f"{'':<{indent}}used by: {', '.join(spec.models)}")
    return lines


def model_rows(specs: Sequence[Spec]) -> list[str]:
    """Per model (case-insensitive order), the encodings it uses."""
    users: dict[str, list[str]] = {}
    for spec in specs:
        for model in spec.models:
            users.setdefault(model, []).append(spec.name)
    width = max((len(model) for model in users), default=5)
    ordered = sorted(users, key=str.lower)
    return [f"{model:<{width}}  {', '.join(users[model])}" for model in ordered]
