"""The Hugging Face model families ``posgen from-hf`` knows, and the kind of each layer.

A config states a model's sizes and settings; its modeling code decides what the config
leaves unsaid. A ``Family`` records that part for one ``model_type``:

- how the rotation pairs features: ``half`` (``rotate_half`` on halves: feature k with
  k + d/2, Llama's layout) or ``interleaved`` (neighbours: 2k with 2k + 1, GPT-J's
  ``rotate_every_two``, Llama 4's complex pairs);
- its configuration class's defaults for the keys from-hf reads (``rope_theta``,
  ``partial_rotary_factor``), which a hand-written config may leave out;
- how it scales the logits: 1/sqrt(head_dim), 1/sqrt(query_pre_attn_scalar) (Gemma 2
  and 3) or ``attention_multiplier`` (Granite);
- for families whose layers differ, which layers rotate: Llama 4 and SmolLM3 leave every
  4th layer without positions (``no_rope_layers``), Gemma 3 turns its sliding layers with a
  local base, Cohere 2 rotates only its sliding layers.

Every entry was read from the modeling and configuration files of transformers 4.57; a
``model_type`` not listed here is not guessed at (from-hf asks for ``--pairing``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from posgen.hf_config import ConfigError, Settings

Pairing = Literal["half", "interleaved"]


class LayerKind(enum.Enum):
    """What one attention layer does with positions."""

    ROTARY = "RoPE"
    LOCAL_ROTARY = "RoPE with the local base (rope_local_base_freq, no scaling)"
    NOPE = "NoPE"


@dataclass(frozen=True)
class Family:
    """What a family's modeling code does that its config does not state."""

    pairing: Pairing
    base: float = 10000.0  # rope_theta when the config leaves it out
    fraction: float = 1.0  # partial_rotary_factor when the config leaves it out
    scale: Literal["head_dim", "query_pre_attn_scalar", "attention_multiplier"] = "head_dim"
    layers: Callable[[Settings], list[LayerKind]] | None = None  # None: every layer rotates
    rotary_dim_key: str | None = None  # a count of rotated features (GPT-J), not a fraction
    # Llama 4's attention: llama3 scaling whenever rope_scaling is set (whatever rope_type
    # says), chunks and QK norm on the RoPE layers, temperature tuning on the NoPE ones
    llama4_attention: bool = False


def rope_flag_layers(config: Settings) -> list[LayerKind]:
    """Llama 4 and SmolLM3: ``no_rope_layers[i]`` is 1 where layer i rotates and 0 where
    it has no positions; without the list, every ``no_rope_layer_interval``-th layer
    (default 4) is NoPE, as the configuration classes build it."""
    if config.has("no_rope_layers"):
        flags = config.bits("no_rope_layers")
        count = config.positive_int("num_hidden_layers", len(flags))
        if len(flags) < count:
            raise ConfigError(
                f"no_rope_layers: lists {len(flags)} layers, num_hidden_layers is {count}"
            )
    else:
        count = config.positive_int("num_hidden_layers")
        interval = config.positive_int("no_rope_layer_interval", 4)
        flags = [int((index + 1) % interval != 0) for index in range(count)]
    return [LayerKind.ROTARY if flag else LayerKind.NOPE for flag in flags[:count]]


def layer_types(config: Settings, pattern: int) -> list[str]:
    """``layer_types`` (each ``sliding_attention`` or ``full_attention``); without it,
    every ``sliding_window_pattern``-th layer is full and the rest slide, as Gemma 3's
    and Cohere 2's configuration classes build it."""
    allowed = ("sliding_attention", "full_attention")
    if config.has("layer_types"):
        types = config.words("layer_types")
        count = config.positive_int("num_hidden_layers", len(types))
        if len(types) != count:
            raise ConfigError(
                f"layer_types: lists {len(types)} layers, num_hidden_layers is {count}"
            )
        for index, kind in enumerate(types):
            if kind not in allowed:
                raise ConfigError(f"layer_types[{index}]: must be one of {allowed}, got {kind!r}")
        return types
    count = config.positive_int("num_hidden_layers")
    pattern = config.positive_int("sliding_window_pattern", pattern)
    return [allowed[0] if (index + 1) % pattern else allowed[1] for index in range(count)]


def _gemma3_layers(config: Settings) -> list[LayerKind]:
    """Gemma 3: sliding layers turn with ``rope_local_base_freq`` and no scaling, full
    layers with ``rope_theta`` and ``rope_scaling`` (a full layer every 6th by default)."""
    return [
        LayerKind.LOCAL_ROTARY if kind == "sliding_attention" else LayerKind.ROTARY
        for kind in layer_types(config, 6)
    ]


def _cohere2_layers(config: Settings) -> list[LayerKind]:
    """Cohere 2: only the sliding layers rotate (Cohere2Attention applies the rotation
    where its sliding window is set); full layers have no positions."""
    window = config.has("sliding_window")
    return [
        LayerKind.ROTARY if window and kind == "sliding_attention" else LayerKind.NOPE
        for kind in layer_types(config, 4)
    ]


_HALF = Family("half")
_INTERLEAVED = Family("interleaved")

FAMILIES: dict[str, Family] = {
    # halves: rotate_half pairs feature k with k + d/2
    "llama": _HALF,
    "mistral": _HALF,
    "mixtral": Family("half", base=1e6),
    "qwen2": _HALF,
    "qwen2_moe": _HALF,
    "qwen3": _HALF,
    "qwen3_moe": _HALF,
    "qwen2_vl": Family("half", base=1e6),
    "qwen2_vl_text": Family("half", base=1e6),
    "qwen2_5_vl": Family("half", base=1e6),
    "qwen2_5_vl_text": Family("half", base=1e6),
    "gemma": _HALF,
    "gemma2": Family("half", scale="query_pre_attn_scalar"),
    "gemma3_text": Family("half", base=1e6, scale="query_pre_attn_scalar", layers=_gemma3_layers),
    "phi": Family("half", fraction=0.5),
    "phi3": _HALF,
    "gpt_neox": Family("half", fraction=0.25),
    "olmo": _HALF,
    "olmo2": _HALF,
    "olmoe": _HALF,
    "starcoder2": _HALF,
    "stablelm": Family("half", fraction=0.25),
    "persimmon": Family("half", base=25000.0, fraction=0.5),
    "falcon": _HALF,
    "granite": Family("half", scale="attention_multiplier"),
    "granitemoe": Family("half", scale="attention_multiplier"),
    "smollm3": Family("half", base=2e6, layers=rope_flag_layers),
    # neighbours: feature 2k pairs with 2k + 1
    "llama4_text": Family("interleaved", base=5e5, layers=rope_flag_layers, llama4_attention=True),
    "cohere": _INTERLEAVED,
    "cohere2": Family("interleaved", layers=_cohere2_layers),
    "glm": Family("interleaved", fraction=0.5),
    "glm4": Family("interleaved", fraction=0.5),
    "helium": Family("interleaved", base=1e5),
    "ernie4_5": Family("interleaved", base=5e5),
    "gptj": Family("interleaved", rotary_dim_key="rotary_dim"),
    "codegen": Family("interleaved", rotary_dim_key="rotary_dim"),
}

REFUSED: dict[str, str] = {
    family: "multi-head latent attention rotates a separate trailing part of each query "
    "and key head (qk_rope_head_dim); posgen rotates leading or spread features"
    for family in ("deepseek_v2", "deepseek_v3")
}
"""Families whose attention posgen's specs cannot state, with the reason."""
