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
    text = config.get("text_config")
    if isinstance(text, dict) and "rope_theta" in text and "rope_theta" not in config:
        config = {**config, **text}  # a multimodal model: the language model's positions
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
    heads = _heads(config, "num_attention_heads", "n_head")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    fraction = config.get("partial_rotary_factor", config.get("rotary_pct", 1.0))
    rotate = spec["terms"]["content_content"]["rotate"]
    rotate["base"] = float(config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    if fraction != 1.0:
        rotate["rotary_dims"] = {"fraction": float(fraction), "layout": "leading"}
        spec["claims"].pop("decay", None)  # with few rotated pairs decay may fail: measure it
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if "mrope_section" in scaling:
        rotate["axes"] = {
            "kind": "sections",
            "sections": [int(s) for s in scaling["mrope_section"]],
        }
    if kind not in ("default", "mrope"):
        try:
            rotate["frequencies"] = _frequencies(str(kind), scaling, config)
        except KeyError as missing:
            raise ConfigError(f"rope_scaling {kind!r} needs {missing.args[0]!r}") from None
        spec["claims"].pop("decay", None)  # a rescaled schedule: measure decay, do not claim
        if kind == "dynamic":
            spec["claims"].pop("relative", None)  # the base follows the call's length
    spec["defaults"] = {"heads": heads, "head_dim": int(head_dim)}
    spec["models"] = []
    return spec


def _frequencies(kind: str, scaling: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The spec's ``frequencies`` for a Hugging Face ``rope_scaling`` (same defaults)."""
    max_positions = config.get("max_position_embeddings")
    original = scaling.get("original_max_position_embeddings") or max_positions
    if kind == "linear":
        return {"kind": "linear", "factor": float(scaling["factor"])}
    if kind == "dynamic":  # Hugging Face scales from max_position_embeddings
        return {
            "kind": "dynamic_ntk",
            "factor": float(scaling["factor"]),
            "original_max_positions": int(_required(max_positions, "max_position_embeddings")),
        }
    if kind == "yarn":
        frequencies: dict[str, Any] = {
            "kind": "yarn",
            "factor": float(scaling["factor"]),
            "original_max_positions": int(_required(original, "original_max_position_embeddings")),
            "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1),
        }
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                frequencies[key] = float(scaling[key])
        if scaling.get("truncate") is False:
            frequencies["truncate"] = False
        return frequencies
    if kind == "llama3":
        return {
            "kind": "llama3",
            "factor": float(scaling["factor"]),
            "low_freq_factor": float(scaling["low_freq_factor"]),
            "high_freq_factor": float(scaling["high_freq_factor"]),
            "original_max_positions": int(scaling["original_max_position_embeddings"]),
        }
    if kind in ("longrope", "su"):
        # Phi-3 states the trained length at the top level; factor is the extension
        top_original = config.get("original_max_position_embeddings")
        if top_original:
            original, factor = (
                top_original,
                _required(max_positions, "max_position_embeddings") / top_original,
            )
        else:
            original, factor = max_positions, scaling.get("factor", 1.0)
        frequencies = {
            "kind": "longrope",
            "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]],
            "original_max_positions": int(_required(original, "max_position_embeddings")),
            "factor": float(max(factor, 1.0)),
        }
        if scaling.get("attention_factor") is not None:
            frequencies["attention_factor"] = float(scaling["attention_factor"])
        return frequencies
    raise ConfigError(f"rope_scaling type {kind!r} has no frequency schedule in posgen")


def _required(value: Any, key: str) -> Any:
    if value is None:
        raise ConfigError(f"the config states no {key}, which its rope_scaling needs")
    return value


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
