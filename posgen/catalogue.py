"""The catalogue ``posgen list`` prints: one row per encoding, or the encodings by model."""

from __future__ import annotations

from collections.abc import Sequence

from posgen.spec.model import Spec


def term_word(value: object) -> str:
    """A term in one word: its keyword (``keep``, ``drop``) or its form (``rotate``, ``bias``)."""
    return value if isinstance(value, str) else str(getattr(value, "form", value))


def encoding_rows(specs: Sequence[Spec]) -> list[str]:
    """A header, a rule, and per encoding its terms in short, title and models."""
    name_width = max([18, *(len(spec.name) for spec in specs)])
    header = (
        f"{'name':<{name_width}} {'cc':<7} {'cp':<9} {'pc':<9} {'pp':<9} {'values':<9} "
        "title / used by"
    )
    lines = [header, "-" * len(header)]
    indent = name_width + 1 + 8 + 10 * 4
    for spec in specs:
        terms = spec.terms
        lines.append(
            f"{spec.name:<{name_width}} {term_word(terms.content_content):<7} "
            f"{term_word(terms.content_position):<9} {term_word(terms.position_content):<9} "
            f"{term_word(terms.position_position):<9} {term_word(spec.values):<9} "
            f"{spec.title}"
        )
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
