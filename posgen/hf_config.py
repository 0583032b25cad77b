"""Typed reads of a Hugging Face ``config.json`` for ``posgen from-hf``.

Every value from-hf uses is read through ``Settings``: a reader returns the value, the
default when the key is absent or null, or raises ``ConfigError`` naming the key by its
place in the file (``rope_scaling.factor``, a multimodal config's
``text_config.rope_theta``) and what it allows. Counts and lengths are positive
integers, never booleans; bases, factors and fractions are finite positive numbers;
sections are mappings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from posgen.spec.bounded_file import FileRule

MAX_CONFIG_BYTES = 16 * 1024**2
"""The largest config read, 16 MiB: a model's config.json is a few KiB (a classifier's
label names make it tens); the file's kind and size are checked before it is read, as a
spec file's are."""
CONFIG_FILE = FileRule(MAX_CONFIG_BYTES, "a config is a plain JSON file", "a config file")

T = TypeVar("T")
_SHOWN_CHARACTERS = 60  # how much of a bad value a message quotes


class ConfigError(ValueError):
    """A config posgen cannot turn into an exact spec (the message names the setting)."""


class _Required:
    """The default of a setting that has none: absent or null, it is reported missing."""


REQUIRED = _Required()


def _shown(value: Any) -> str:
    """A config value as its JSON text (``true``, ``"abc"``), shortened."""
    text = json.dumps(value, ensure_ascii=True, default=str)
    if len(text) > _SHOWN_CHARACTERS:
        return text[: _SHOWN_CHARACTERS - 3] + "..."
    return text


def _positive_int(value: Any) -> int | None:
    """``value`` if it is an integer ≥ 1 (a JSON number, never a boolean), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


MAX_LAYERS = 4096
"""The most layers a config may state (published models: up to 126): the per-layer kinds
are a list as long as the count."""


def _layer_count(value: Any) -> int | None:
    """``value`` if it is an integer from 1 to ``MAX_LAYERS`` (never a boolean), else None."""
    count = _positive_int(value)
    return count if count is not None and count <= MAX_LAYERS else None


def _finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite JSON number (never a boolean), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range
        return None
    return number if math.isfinite(number) else None


def _positive_number(value: Any) -> float | None:
    """``value`` as a float if it is finite and > 0, else None."""
    number = _finite(value)
    return number if number is not None and number > 0 else None


def _non_negative_number(value: Any) -> float | None:
    """``value`` as a float if it is finite and ≥ 0, else None."""
    number = _finite(value)
    return number if number is not None and number >= 0 else None


def _list_of(item: Callable[[Any], T | None]) -> Callable[[Any], list[T] | None]:
    """A reader of a non-empty JSON list whose every item ``item`` accepts."""

    def read(value: Any) -> list[T] | None:
        if not isinstance(value, list) or not value:
            return None
        items = [item(entry) for entry in value]
        accepted = [entry for entry in items if entry is not None]
        return accepted if len(accepted) == len(items) else None

    return read


def _bit(value: Any) -> int | None:
    """``value`` if it is the integer 0 or 1 (never a boolean), else None."""
    return (
        value
        if value in (0, 1) and isinstance(value, int) and not isinstance(value, bool)
        else None
    )


def _whole_number(value: Any) -> int | None:
    """``value`` as an int if it is an integer >= 1 or a float of such an integral value
    (4.0; a JSON writer may give a count as a float), never a boolean, else None."""
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    return _positive_int(value)


def _truth(value: Any) -> bool | None:
    """``value`` as the truth Python's ``if`` reads in it, for true, false and integers
    (0 is false; Llama 4 Scout's config states ``"attn_temperature_tuning": 4``), never
    a string, a float or anything else a config may hold by mistake, else None."""
    return bool(value) if isinstance(value, int) else None


def _word(value: Any) -> str | None:
    """``value`` if it is a JSON string, else None."""
    return value if isinstance(value, str) else None


def _flag(value: Any) -> bool | None:
    """``value`` if it is true or false, else None."""
    return value if isinstance(value, bool) else None


def _mapping(value: Any) -> dict[str, Any] | None:
    """``value`` if it is a JSON object, else None."""
    return value if isinstance(value, dict) else None


class Settings:
    """Typed reads of one JSON object of a config: each reader returns the value, the
    default when the key is absent or null, or raises ConfigError naming the key by
    its path in the file (``path``: ``prefix`` and the key, as in
    ``rope_scaling.factor``) and what it allows.

    ``origins`` gives, for a key laid over these values from a section
    (``overlaid``), the path of that section (``text_config.``), so the message names
    the key where the file has it."""

    def __init__(
        self, values: Mapping[str, Any], prefix: str = "", origins: Mapping[str, str] | None = None
    ) -> None:
        self.values = values
        self.prefix = prefix
        self.origins = dict(origins or {})

    def path(self, key: str) -> str:
        """Where ``key`` is in the config file, as messages name it:
        ``rope_scaling.factor``, or ``text_config.rope_theta`` for a multimodal
        config's language model."""
        return f"{self.prefix}{self.origins.get(key, '')}{key}"

    def overlaid(self, key: str) -> Settings:
        """These settings with the section at ``key`` laid over them (its keys win), each
        of its keys named by its path in that section (``text_config.rope_theta``)."""
        section = self.section(key)
        where = f"{self.path(key)[len(self.prefix) :]}."
        origins = {**self.origins, **dict.fromkeys(section.values, where)}
        return Settings({**self.values, **section.values}, self.prefix, origins)

    def replaced(self, key: str, value: Any) -> Settings:
        """These settings with ``key`` set to ``value`` (None: as if absent), its path
        unchanged."""
        return Settings({**self.values, key: value}, self.prefix, self.origins)

    def has(self, key: str) -> bool:
        """Whether ``key`` is set (present and not null)."""
        return self.values.get(key) is not None

    def first_set(self, *keys: str) -> str:
        """The first of ``keys`` that is set, else the last (whose default then applies)."""
        return next((key for key in keys if self.has(key)), keys[-1])

    def _read(
        self, key: str, default: T | _Required, allowed: str, read: Callable[[Any], T | None]
    ) -> T:
        """``read(value)`` of ``key``; ``default`` when it is not set; else ConfigError."""
        value = self.values.get(key)
        if value is None:
            if isinstance(default, _Required):
                raise ConfigError(f"{self.path(key)}: missing; it must be {allowed}")
            return default
        converted = read(value)
        if converted is None:
            raise ConfigError(f"{self.path(key)}: must be {allowed}, got {_shown(value)}")
        return converted

    def positive_int(self, key: str, default: int | _Required = REQUIRED) -> int:
        """A count or a length: an integer >= 1, never a boolean."""
        return self._read(key, default, "a positive integer (not a boolean)", _positive_int)

    def layer_count(self, default: int | _Required = REQUIRED) -> int:
        """``num_hidden_layers``: an integer from 1 to ``MAX_LAYERS``, never a boolean."""
        allowed = f"a positive integer of at most {MAX_LAYERS:,} (not a boolean)"
        return self._read("num_hidden_layers", default, allowed, _layer_count)

    def whole_number(self, key: str, default: int | _Required = REQUIRED) -> int:
        """A count where Hugging Face's code divides by the value and a float of an
        integral value (4.0) counts as that integer (Llama 4's ``floor_scale``): an
        integer >= 1, never a boolean."""
        allowed = "a positive integer (4 or 4.0, not a boolean)"
        return self._read(key, default, allowed, _whole_number)

    def positive_number(self, key: str, default: float | _Required = REQUIRED) -> float:
        """A base, factor or fraction: a finite number > 0, never a boolean."""
        return self._read(key, default, "a finite positive number", _positive_number)

    def non_negative_number(self, key: str, default: float | _Required = REQUIRED) -> float:
        """A finite number >= 0 (YaRN's mscale), never a boolean."""
        return self._read(key, default, "a finite number >= 0", _non_negative_number)

    def positive_numbers(self, key: str) -> list[float]:
        """A required non-empty list of finite numbers > 0 (LongRoPE's factors)."""
        allowed = "a non-empty list of finite numbers > 0"
        return self._read(key, REQUIRED, allowed, _list_of(_positive_number))

    def positive_ints(self, key: str) -> list[int]:
        """A required non-empty list of positive integers (M-RoPE's sections)."""
        allowed = "a non-empty list of positive integers"
        return self._read(key, REQUIRED, allowed, _list_of(_positive_int))

    def bits(self, key: str) -> list[int]:
        """A required non-empty list of 0s and 1s (Llama 4's ``no_rope_layers``)."""
        return self._read(key, REQUIRED, "a non-empty list of 0s and 1s", _list_of(_bit))

    def words(self, key: str) -> list[str]:
        """A required non-empty list of strings (``layer_types``)."""
        return self._read(key, REQUIRED, "a non-empty list of strings", _list_of(_word))

    def word(self, key: str, default: str) -> str:
        """A JSON string."""
        return self._read(key, default, "a string", _word)

    def flag(self, key: str, default: bool) -> bool:
        """true or false (never 0, 1 or a string)."""
        return self._read(key, default, "true or false", _flag)

    def truth(self, key: str, default: bool) -> bool:
        """A setting Hugging Face's code tests only for truth (``if config.key``): true,
        false or an integer (0 is false), never a string (``"false"`` would be true)."""
        allowed = "true, false or an integer (0: false), as Hugging Face tests its truth"
        return self._read(key, default, allowed, _truth)

    def section(self, key: str) -> Settings:
        """The JSON object at ``key`` (absent or null: an empty one)."""
        empty: dict[str, Any] = {}
        values = self._read(key, empty, "a mapping (a JSON object) or null", _mapping)
        return Settings(values, f"{self.path(key)}.")
