"""``posgen from-hf``: a spec from a Hugging Face model config's position settings.

Reads a ``config.json`` (a dict) and writes the spec of the positional encoding that
model uses, starting from the catalogue spec of its family and setting what the config
states:

- rotary models (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-NeoX, ...): ``rope`` with the
  config's ``rope_theta``, ``partial_rotary_factor`` / ``rotary_pct``, ``head_dim`` and
  ``num_attention_heads``;
- BLOOM (``n_head``, ``hidden_size``) and MPT with ``attn_config.alibi`` (power-of-two
  head counts, ``alibi_bias_max`` 8): ``alibi``;
- the T5 family (``relative_attention_num_buckets``, ``relative_attention_max_distance``,
  ``num_heads``, ``d_kv``): ``t5``.

A setting the catalogue cannot express yet (a ``rope_scaling`` type, MPT's slopes for a
head count that is not a power of two) is an error that names it, never a spec that is
silently different from the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROTARY_TYPES = {"llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "phi3", "gpt_neox"}


class ConfigError(ValueError):
    """A config posgen cannot turn into an exact spec (the message names the setting)."""


def spec_from_config(config: dict[str, Any], name: str, catalogue: Path) -> str:
    """The YAML text of the spec called ``name`` for this model config."""
    model_type = str(config.get("model_type", ""))
    if model_type in ROTARY_TYPES or "rope_theta" in config:
        spec = _rotary(config, _catalogue(catalogue, "rope"))
    elif model_type == "bloom":
        spec = _alibi(config, _catalogue(catalogue, "alibi"), "BLOOM")
    elif model_type == "mpt":
        spec = _mpt(config, _catalogue(catalogue, "alibi"))
    elif "relative_attention_num_buckets" in config:
        spec = _t5(config, _catalogue(catalogue, "t5"))
    else:
        raise ConfigError(f"model_type {model_type!r}: no position settings posgen can read")
    spec["name"] = name
    source = config.get("_name_or_path") or model_type
    spec["title"] = f"{spec['title']} ({source} config)"
    return yaml.safe_dump(spec, sort_keys=False, width=88, allow_unicode=False)


def _catalogue(folder: Path, name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((folder / f"{name}.yaml").read_text("utf-8"))
    return loaded


def _heads(config: dict[str, Any], *keys: str) -> int:
    for key in keys:
        if isinstance(config.get(key), int):
            return int(config[key])
    raise ConfigError(f"the config states no head count ({' / '.join(keys)})")


def _rotary(config: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    scaling = config.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        kind = scaling.get("rope_type") or scaling.get("type")
        raise ConfigError(f"rope_scaling type {kind!r} is not in the spec language yet")
    heads = _heads(config, "num_attention_heads", "n_head")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    fraction = config.get("partial_rotary_factor", config.get("rotary_pct", 1.0))
    rotate = spec["terms"]["content_content"]["rotate"]
    rotate["base"] = float(config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    if fraction != 1.0:
        rotate["rotary_dims"] = {"fraction": float(fraction), "layout": "leading"}
        spec["claims"].pop("decay", None)  # with few rotated pairs decay may fail: measure it
    spec["defaults"] = {"heads": heads, "head_dim": int(head_dim)}
    spec["models"] = []
    return spec


def _alibi(config: dict[str, Any], spec: dict[str, Any], model: str) -> dict[str, Any]:
    heads = _heads(config, "n_head", "n_heads", "num_attention_heads")
    hidden = config.get("hidden_size") or config.get("d_model")
    if not isinstance(hidden, int):
        raise ConfigError("the config states no hidden size (hidden_size / d_model)")
    spec["defaults"] = {"heads": heads, "head_dim": hidden // heads}
    spec["models"] = [model]
    return spec


def _mpt(config: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    attention = config.get("attn_config") or {}
    if not attention.get("alibi"):
        raise ConfigError("attn_config.alibi is false: this MPT uses no ALiBi bias")
    heads = _heads(config, "n_heads")
    if heads & (heads - 1) or attention.get("alibi_bias_max", 8) != 8:
        raise ConfigError(
            f"MPT's slopes for {heads} heads (alibi_bias_max "
            f"{attention.get('alibi_bias_max', 8)}) differ from alibi_geometric"
        )
    return _alibi(config, spec, "MPT")


def _t5(config: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    index = spec["terms"]["position_position"]["bias"]["index"]
    index["buckets"] = int(config["relative_attention_num_buckets"])
    index["max_distance"] = int(config.get("relative_attention_max_distance", 128))
    heads = _heads(config, "num_heads")
    spec["defaults"] = {"heads": heads, "head_dim": int(config.get("d_kv", 64))}
    spec["models"] = []
    return spec
