"""Free text (titles, references, models): one line of printable characters, refused
with the character and its place where it holds a control, bidirectional or invisible
character or an unmatched bracket.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

# C0 and C1 controls (ESC starts terminal sequences, U+009B is CSI), DEL, line and
# paragraph separators, bidirectional marks, embeddings, overrides and isolates, and
# invisible characters (soft hyphen, zero-width space, word joiner and invisible
# operators, byte-order mark, tags) that would make text differ from what it shows.
# The schema's pattern refuses all but the tags (U+E0000 ..): its regex dialect
# (ECMA-262) names no character past U+FFFF, and Python's sees no surrogate pairs.
_NOT_IN_TEXT = r"\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_INVISIBLE_IN_BMP = r"\u00ad\u200b\u2060-\u2064\ufeff"
_INVISIBLE = _INVISIBLE_IN_BMP + r"\U000e0000-\U000e007f"
_INVISIBLE_CHARACTER = re.compile(f"[{_INVISIBLE}]")
TEXT_PATTERN = f"^[^{_NOT_IN_TEXT}{_INVISIBLE_IN_BMP}]*$"
_FORBIDDEN_IN_TEXT = re.compile(f"[{_NOT_IN_TEXT}{_INVISIBLE}]")


def _what_character(ch: str) -> str:
    """The kind of a character free text refuses, for the message."""
    code = ord(ch)
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return "a control character"
    if ch in "\u2028\u2029":
        return "a line or paragraph separator"
    if _INVISIBLE_CHARACTER.fullmatch(ch):
        return "an invisible character"
    return "a bidirectional control"


def plain_text(text: str) -> str:
    """Accept one line of printable text, not blank; refuse control and bidirectional
    characters.

    Titles, references and models are printed by ``explain`` and ``list`` and quoted in
    generated docstrings: a control sequence (ESC ] ... BEL, U+009B) would reach the
    terminal, and a bidirectional override (U+202E) would show text other than it is.
    """
    if not text.split():  # the words a docstring wraps (str.split: Unicode whitespace)
        raise PydanticCustomError(
            "free_text",
            "blank: free text needs at least one printable character that is not a space",
        )
    found = _FORBIDDEN_IN_TEXT.search(text)
    if found is None:
        return text
    ch = found.group()
    raise PydanticCustomError(
        "free_text",
        "{what} (U+{code}) at character {index}: free text is one line of printable "
        "characters, without control characters (C0, C1, DEL), line separators, "
        "bidirectional overrides or invisible characters",
        {"what": _what_character(ch), "code": f"{ord(ch):04X}", "index": found.start() + 1},
    )


_CLOSING_BRACKETS = {")": "(", "]": "["}


def with_matched_brackets(text: str) -> str:
    """Accept text whose round and square brackets match; refuse the first unmatched one.

    An unquoted comma inside a YAML flow list splits an entry: ``models: [Llama 3.1
    (8B, 70B)]`` loads as "Llama 3.1 (8B" and "70B)", two models that ``list --models``
    would print. Text with an unmatched bracket is refused with that remedy.
    """
    opened: list[tuple[str, int]] = []  # (bracket, index) of the brackets still open
    unmatched: int | None = None
    for index, ch in enumerate(text):
        if ch in "([":
            opened.append((ch, index))
        elif ch in _CLOSING_BRACKETS:
            if not opened or opened[-1][0] != _CLOSING_BRACKETS[ch]:
                unmatched = index
                break
            opened.pop()
    if unmatched is None and opened:
        unmatched = opened[-1][1]
    if unmatched is None:
        return text
    raise PydanticCustomError(
        "free_text",
        "unmatched '{bracket}' at character {index}: in a YAML flow list [a, b (c, d)] an "
        'unquoted comma splits an entry; quote the entry ("b (c, d)") or match the bracket',
        {"bracket": text[unmatched], "index": unmatched + 1},
    )


Text = Annotated[
    str,
    Field(min_length=1, max_length=300, json_schema_extra={"pattern": TEXT_PATTERN}),
    AfterValidator(plain_text),
    AfterValidator(with_matched_brackets),
]
