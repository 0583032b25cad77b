"""``posgen from-hf``: a spec from a Hugging Face model config's position settings.

Reads a ``config.json`` (a dict) and writes the spec of the positional encoding that
model uses, starting from the catalogue spec of its family and setting what the config
states:

- rotary models (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-NeoX, Qwen2-VL, ...): ``rope``
  with the config's ``rope_theta``, ``partial_rotary_factor`` / ``rotary_pct``,
  ``head_dim``, ``num_attention_heads``, every ``rope_scaling`` type of Hugging Face's
  ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn, longrope, llama3) as a frequency
  schedule, and ``mrope_section`` as M-RoPE axes;
- BLOOM (``n_head``, ``hidden_size``) and MPT with ``attn_config.alibi`` (power-of-two
  head counts, ``alibi_bias_max`` 8): ``alibi``;
- the T5 family (``relative_attention_num_buckets``, ``relative_attention_max_distance``,
  ``num_heads``, ``d_kv``): ``t5``.

A setting the catalogue cannot express (an unknown ``rope_scaling`` type, MPT's slopes
for a head count that is not a power of two) is an error that names it, never a spec that is
silently different from the model. A malformed setting (a count that is not a positive
integer, or is a boolean; a number that is not finite and positive; a section that is not
a mapping) is a ``ConfigError`` naming the key (``rope_scaling.factor``) and what it
allows; every value is read through the typed readers of ``Settings``. A key that is
absent or null takes Hugging Face's default, or is reported missing where there is none.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from posgen.spec.bounded_file import FileRule

MAX_CONFIG_BYTES = 16 * 1024**2
"""The largest config read, 16 MiB: a model's config.json is a few KiB (a classifier's
label names make it tens); the file's kind and size are checked before it is read, as a
spec file's are."""
CONFIG_FILE = FileRule(MAX_CONFIG_BYTES, "a config is a plain JSON file", "a config file")

ROTARY_TYPES = {"llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "phi3", "gpt_neox"}

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
    default when the key is absent or null, or raises ConfigError naming the key (with
    ``prefix``, as in ``rope_scaling.factor``) and what it allows."""

    def __init__(self, values: Mapping[str, Any], prefix: str = "") -> None:
        self.values = values
        self.prefix = prefix

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
                raise ConfigError(f"{self.prefix}{key}: missing; it must be {allowed}")
            return default
        converted = read(value)
        if converted is None:
            raise ConfigError(f"{self.prefix}{key}: must be {allowed}, got {_shown(value)}")
        return converted

    def positive_int(self, key: str, default: int | _Required = REQUIRED) -> int:
        """A count or a length: an integer >= 1, never a boolean."""
        return self._read(key, default, "a positive integer (not a boolean)", _positive_int)

    def positive_number(self, key: str, default: float | _Required = REQUIRED) -> float:
        """A base, factor or fraction: a finite number > 0, never a boolean."""
        return self._read(key, default, "a finite positive number", _positive_number)

    def non_negative_number(self, key: str, default: float | _Required = REQUIRED) -> float:
        """A finite number >= 0 (YaRN's mscale), never a boolean."""
        return self._read(key, default, "a finite number >= 0", _non_negative_number)

    def numbers(self, key: str) -> list[float]:
        """A required non-empty list of finite numbers (LongRoPE's factors)."""
        return self._read(key, REQUIRED, "a non-empty list of finite numbers", _list_of(_finite))

    def positive_ints(self, key: str) -> list[int]:
        """A required non-empty list of positive integers (M-RoPE's sections)."""
        allowed = "a non-empty list of positive integers"
        return self._read(key, REQUIRED, allowed, _list_of(_positive_int))

    def word(self, key: str, default: str) -> str:
        """A JSON string."""
        return self._read(key, default, "a string", _word)

    def flag(self, key: str, default: bool) -> bool:
        """true or false (never 0, 1 or a string)."""
        return self._read(key, default, "true or false", _flag)

    def section(self, key: str) -> Settings:
        """The JSON object at ``key`` (absent or null: an empty one)."""
        empty: dict[str, Any] = {}
        values = self._read(key, empty, "a mapping (a JSON object) or null", _mapping)
        return Settings(values, f"{self.prefix}{key}.")


def default_name(config: dict[str, Any]) -> str:
    """The spec name from-hf gives without ``--name``: MODEL_TYPE_positions."""
    model_type = Settings(config).word("model_type", "model")
    return f"{model_type}_positions".replace("-", "_")


def spec_from_config(config: dict[str, Any], name: str, catalogue: Path) -> str:
    """The YAML text of the spec called ``name`` for this model config."""
    settings = Settings(config)
    model_type = settings.word("model_type", "")
    text = config.get("text_config")
    if isinstance(text, dict) and "rope_theta" in text and "rope_theta" not in config:
        settings = Settings({**config, **text})  # multimodal: the language model's positions
    if model_type in ROTARY_TYPES or settings.has("rope_theta"):
        spec = _rotary(settings, _catalogue(catalogue, "rope"))
    elif model_type == "bloom":
        spec = _alibi(settings, _catalogue(catalogue, "alibi"), "BLOOM")
    elif model_type == "mpt":
        spec = _mpt(settings, _catalogue(catalogue, "alibi"))
    elif settings.has("relative_attention_num_buckets"):
        spec = _t5(settings, _catalogue(catalogue, "t5"))
    else:
        raise ConfigError(f"model_type {model_type!r}: no position settings posgen can read")
    spec["name"] = name
    source = settings.word("_name_or_path", "") or model_type
    spec["title"] = f"{spec['title']} ({source} config)"
    return yaml.safe_dump(spec, sort_keys=False, width=88, allow_unicode=False)


def _catalogue(folder: Path, name: str) -> dict[str, Any]:
    """The catalogue spec ``name`` as plain data, to start from."""
    loaded: dict[str, Any] = yaml.safe_load((folder / f"{name}.yaml").read_text("utf-8"))
    return loaded


def _stated(config: Settings, keys: tuple[str, ...], what: str) -> str:
    """The first of ``keys`` that the config sets; ConfigError naming them all if none."""
    key = config.first_set(*keys)
    if not config.has(key):
        raise ConfigError(f"the config states no {what} ({' / '.join(keys)})")
    return key


def _heads(config: Settings, *keys: str) -> int:
    """The head count: the first of ``keys`` set, a positive integer."""
    return config.positive_int(_stated(config, keys, "head count"))


def _head_dim(config: Settings, heads: int, hidden_keys: tuple[str, ...]) -> int:
    """``head_dim`` if set, else the hidden size (the first of ``hidden_keys``) // heads."""
    if config.has("head_dim"):
        return config.positive_int("head_dim")
    key = _stated(config, hidden_keys, "hidden size")
    hidden = config.positive_int(key)
    if hidden < heads:
        raise ConfigError(f"{key} {hidden} is smaller than the head count {heads}")
    return hidden // heads


def _rotary(config: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    heads = _heads(config, "num_attention_heads", "n_head")
    head_dim = _head_dim(config, heads, ("hidden_size",))
    fraction = config.positive_number(config.first_set("partial_rotary_factor", "rotary_pct"), 1.0)
    rotate = spec["terms"]["content_content"]["rotate"]
    rotate["base"] = config.positive_number(config.first_set("rope_theta", "rotary_emb_base"), 1e4)
    if fraction != 1.0:
        rotate["rotary_dims"] = {"fraction": fraction, "layout": "leading"}
        spec["claims"].pop("decay", None)  # with few rotated pairs decay may fail: measure it
    scaling = config.section("rope_scaling")
    kind = scaling.word(scaling.first_set("rope_type", "type"), "default")
    if scaling.has("mrope_section"):
        rotate["axes"] = {"kind": "sections", "sections": scaling.positive_ints("mrope_section")}
    if kind not in ("default", "mrope"):
        rotate["frequencies"] = _frequencies(kind, scaling, config)
        spec["claims"].pop("decay", None)  # a rescaled schedule: measure decay, do not claim
        if kind == "dynamic":
            spec["claims"].pop("relative", None)  # the base follows the call's length
    spec["defaults"] = {"heads": heads, "head_dim": head_dim}
    spec["models"] = []
    return spec


def _frequencies(kind: str, scaling: Settings, config: Settings) -> dict[str, Any]:
    """The spec's ``frequencies`` for a Hugging Face ``rope_scaling`` (same defaults)."""
    if kind == "linear":
        return {"kind": "linear", "factor": scaling.positive_number("factor")}
    if kind == "dynamic":  # Hugging Face scales from max_position_embeddings
        return {
            "kind": "dynamic_ntk",
            "factor": scaling.positive_number("factor"),
            "original_max_positions": config.positive_int("max_position_embeddings"),
        }
    if kind == "yarn":
        return _yarn(scaling, config)
    if kind == "llama3":
        return {
            "kind": "llama3",
            "factor": scaling.positive_number("factor"),
            "low_freq_factor": scaling.positive_number("low_freq_factor"),
            "high_freq_factor": scaling.positive_number("high_freq_factor"),
            "original_max_positions": scaling.positive_int("original_max_position_embeddings"),
        }
    if kind in ("longrope", "su"):
        return _longrope(scaling, config)
    raise ConfigError(f"rope_scaling type {kind!r} has no frequency schedule in posgen")


def _original_positions(scaling: Settings, config: Settings) -> int:
    """rope_scaling's original_max_position_embeddings, else max_position_embeddings."""
    if scaling.has("original_max_position_embeddings"):
        return scaling.positive_int("original_max_position_embeddings")
    return config.positive_int("max_position_embeddings")


def _yarn(scaling: Settings, config: Settings) -> dict[str, Any]:
    frequencies: dict[str, Any] = {
        "kind": "yarn",
        "factor": scaling.positive_number("factor"),
        "original_max_positions": _original_positions(scaling, config),
        "beta_fast": scaling.positive_number("beta_fast", 32.0),
        "beta_slow": scaling.positive_number("beta_slow", 1.0),
    }
    if scaling.has("attention_factor"):
        frequencies["attention_factor"] = scaling.positive_number("attention_factor")
    for key in ("mscale", "mscale_all_dim"):
        if scaling.has(key):
            frequencies[key] = scaling.non_negative_number(key)
    if not scaling.flag("truncate", True):
        frequencies["truncate"] = False
    return frequencies


def _longrope(scaling: Settings, config: Settings) -> dict[str, Any]:
    if config.has("original_max_position_embeddings"):
        # Phi-3 states the trained length at the top level; factor is the extension
        original = config.positive_int("original_max_position_embeddings")
        factor = config.positive_int("max_position_embeddings") / original
    else:
        original = config.positive_int("max_position_embeddings")
        factor = scaling.positive_number("factor", 1.0)
    frequencies = {
        "kind": "longrope",
        "short_factor": scaling.numbers("short_factor"),
        "long_factor": scaling.numbers("long_factor"),
        "original_max_positions": original,
        "factor": max(factor, 1.0),
    }
    if scaling.has("attention_factor"):
        frequencies["attention_factor"] = scaling.positive_number("attention_factor")
    return frequencies


def _alibi(config: Settings, spec: dict[str, Any], model: str) -> dict[str, Any]:
    heads = _heads(config, "n_head", "n_heads", "num_attention_heads")
    spec["defaults"] = {
        "heads": heads,
        "head_dim": _head_dim(config, heads, ("hidden_size", "d_model")),
    }
    spec["models"] = [model]
    return spec


def _mpt(config: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    attention = config.section("attn_config")
    if not attention.flag("alibi", False):
        raise ConfigError("attn_config.alibi is false: this MPT uses no ALiBi bias")
    heads = _heads(config, "n_heads")
    bias_max = attention.positive_number("alibi_bias_max", 8.0)
    if heads & (heads - 1) or bias_max != 8:
        raise ConfigError(
            f"MPT's slopes for {heads} heads (alibi_bias_max {bias_max:g}) differ from "
            "alibi_geometric"
        )
    return _alibi(config, spec, "MPT")


def _t5(config: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    index = spec["terms"]["position_position"]["bias"]["index"]
    index["buckets"] = config.positive_int("relative_attention_num_buckets")
    index["max_distance"] = config.positive_int("relative_attention_max_distance", 128)
    heads = _heads(config, "num_heads")
    spec["defaults"] = {"heads": heads, "head_dim": config.positive_int("d_kv", 64)}
    spec["models"] = []
    return spec
