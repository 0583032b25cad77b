"""The Hugging Face model families ``posgen from-hf`` knows, and the kind of each layer.

A config states a model's sizes and settings; its modeling code decides what the config
leaves unsaid. A ``Family`` records that part for one ``model_type``:

- how the rotation pairs features: ``half`` (``rotate_half`` on halves: feature k with
  k + d/2, Llama's layout) or ``interleaved`` (neighbours: 2k with 2k + 1, GPT-J's
  ``rotate_every_two``, Llama 4's complex pairs);
- its configuration class's defaults for the keys from-hf reads (``rope_theta``,
  ``partial_rotary_factor``, ``head_dim``, ``num_attention_heads``,
  ``attn_logit_softcapping``, ``use_sliding_window``), which a hand-written config may
  leave out;
- how it scales the logits: 1/sqrt(head_dim), 1/sqrt(query_pre_attn_scalar) (Gemma 2
  and 3) or ``attention_multiplier`` (Granite);
- for families whose layers differ, which layers rotate: Llama 4 and SmolLM3 leave every
  4th layer without positions (``no_rope_layers``), Gemma 3 turns its sliding layers with a
  local base, Cohere 2 rotates only its sliding layers.

Besides the rotary families, ``T5_FAMILIES`` lists the model_types whose self-attention
is T5's bucketed bias, and ``REFUSED`` the families whose attention no spec states.

Every entry was read from the modeling and configuration files of transformers 4.57; a
``model_type`` not listed here is not guessed at (a rotary one needs ``--pairing``; one
with T5's buckets is refused).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from posgen.hf_config import ConfigError, Settings

Pairing = Literal["half", "interleaved"]


class LayerKind(enum.Enum):
    """What one attention layer does with positions."""

    ROTARY = "RoPE"
    LOCAL_ROTARY = "RoPE with the local base (rope_local_base_freq, no scaling)"
    NOPE = "NoPE"


BASE_KEYS = ("rope_theta", "rotary_emb_base")
"""The config keys that state a rotation's base, in the order from-hf reads them."""

FRACTION_KEYS = ("partial_rotary_factor", "rotary_pct")
"""The config keys that state the rotated share of each head, in that order."""


@dataclass(frozen=True)
class RopeKeys:
    """What a family's modeling code reads of the rotation, where that is not the first
    of ``BASE_KEYS`` and ``FRACTION_KEYS`` set, nor ``rope_scaling``: the other keys of
    each kind are then not read by the model, and from-hf refuses them where they
    disagree with what it turns by."""

    base: str | None  # the key of the base (None: Family.base, whatever the config says)
    fraction: str | None  # the key of the rotated share (None: rotary_dim_key, or all)
    scaling: bool  # whether it reads rope_scaling


@dataclass(frozen=True)
class Family:
    """What a family's modeling code does that its config does not state."""

    pairing: Pairing
    base: float = 10000.0  # rope_theta when the config leaves it out
    fraction: float = 1.0  # partial_rotary_factor when the config leaves it out
    head_dim: int | None = None  # head_dim when left out (None: hidden_size // heads)
    heads: int | None = None  # num_attention_heads when left out (None: required)
    soft_capping: float | None = None  # attn_logit_softcapping when left out (Gemma 2: 50)
    slides: bool = True  # use_sliding_window when left out (Qwen, SmolLM3: False)
    scale: Literal["head_dim", "query_pre_attn_scalar", "attention_multiplier"] = "head_dim"
    layers: Callable[[Settings], list[LayerKind]] | None = None  # None: every layer rotates
    rotary_dim_key: str | None = None  # a count of rotated features (GPT-J), not a fraction
    # the config keys its code turns by, where its configuration class overwrites the
    # common ones (GPT-NeoX copies rotary_emb_base over rope_theta and rotary_pct over
    # partial_rotary_factor); None: the first of the common keys set
    rope_keys: RopeKeys | None = None
    # Llama 4's attention: llama3 scaling whenever rope_scaling is set (whatever rope_type
    # says), chunks and QK norm on the RoPE layers, temperature tuning on the NoPE ones
    llama4_attention: bool = False
    # how its code lays M-RoPE's sections (rope_scaling.mrope_section) over the pairs:
    # runs (Qwen2-VL's apply_multimodal_rotary_pos_emb) or dealt out in turn (Qwen3-VL's
    # apply_interleaved_mrope), whatever rope_scaling.mrope_interleaved says; None: as
    # that key says (a family from-hf does not know)
    mrope_layout: Literal["consecutive", "interleaved"] | None = None
    mrope_sections: tuple[int, ...] | None = None  # mrope_section when left out
    # rope_scaling.type values its configuration class rewrites before the code reads
    # them (Phi3Config: the older "su" and "yarn" mean longrope); rope_type is kept
    type_rewrites: tuple[tuple[str, str], ...] = ()
    # the top-level original_max_position_embeddings when left out (Phi3Config: 4096),
    # which LongRoPE then reads (the factor is max_position_embeddings over it); None:
    # the configuration class sets none, and LongRoPE takes rope_scaling's factor
    original_max_positions: int | None = None


def _rope_flag_layers(config: Settings) -> list[LayerKind]:
    """SmolLM3 (and Llama 4): ``no_rope_layers[i]`` is 1 where layer i rotates and 0
    where it has no positions; without the list, every ``no_rope_layer_interval``-th
    layer (default 4) is NoPE, as the configuration classes build it."""
    if config.has("no_rope_layers"):
        flags = config.bits("no_rope_layers")
        count = config.layer_count(len(flags))
        if len(flags) < count:
            raise ConfigError(
                f"{config.path('no_rope_layers')}: lists {len(flags)} layers, "
                f"{config.path('num_hidden_layers')} is {count}"
            )
    else:
        count = config.layer_count()
        interval = config.positive_int("no_rope_layer_interval", 4)
        flags = [int((index + 1) % interval != 0) for index in range(count)]
    return [LayerKind.ROTARY if flag else LayerKind.NOPE for flag in flags[:count]]


def _llama4_layers(config: Settings) -> list[LayerKind]:
    """Llama 4: as ``_rope_flag_layers``, and an empty ``no_rope_layers`` (Scout's
    published config) is the default every-4th pattern, as Llama4TextConfig reads it."""
    if config.values.get("no_rope_layers") == []:
        config = config.replaced("no_rope_layers", None)
    return _rope_flag_layers(config)


def _layer_types(config: Settings, pattern: int) -> list[str]:
    """``layer_types`` (each ``sliding_attention`` or ``full_attention``); without it,
    every ``sliding_window_pattern``-th layer is full and the rest slide, as Gemma 3's
    and Cohere 2's configuration classes build it."""
    allowed = ("sliding_attention", "full_attention")
    if config.has("layer_types"):
        types = config.words("layer_types")
        count = config.layer_count(len(types))
        if len(types) != count:
            raise ConfigError(
                f"{config.path('layer_types')}: lists {len(types)} layers, "
                f"{config.path('num_hidden_layers')} is {count}"
            )
        for index, kind in enumerate(types):
            if kind not in allowed:
                raise ConfigError(
                    f"{config.path('layer_types')}[{index}]: must be one of {allowed}, got {kind!r}"
                )
        return types
    count = config.layer_count()
    pattern = config.positive_int("sliding_window_pattern", pattern)
    return [allowed[0] if (index + 1) % pattern else allowed[1] for index in range(count)]


def _gemma3_layers(config: Settings) -> list[LayerKind]:
    """Gemma 3: sliding layers turn with ``rope_local_base_freq`` and no scaling, full
    layers with ``rope_theta`` and ``rope_scaling`` (a full layer every 6th by default)."""
    return [
        LayerKind.LOCAL_ROTARY if kind == "sliding_attention" else LayerKind.ROTARY
        for kind in _layer_types(config, 6)
    ]


def _cohere2_layers(config: Settings) -> list[LayerKind]:
    """Cohere 2: only the sliding layers rotate (Cohere2Attention applies the rotation
    where its sliding window is set: 4096 when the config leaves it out, none where it
    is null); full layers have no positions."""
    window = config.values.get("sliding_window", 4096) is not None
    return [
        LayerKind.ROTARY if window and kind == "sliding_attention" else LayerKind.NOPE
        for kind in _layer_types(config, 4)
    ]


_FIXED_ROPE = RopeKeys(None, None, False)
_HALF = Family("half")
_QWEN2_VL = Family("half", base=1e6, mrope_layout="consecutive")
_QWEN3_VL = Family(
    "half", base=5e6, head_dim=128, heads=32, slides=False, mrope_layout="interleaved",
    mrope_sections=(24, 20, 20),
)  # fmt: skip
_INTERLEAVED = Family("interleaved")

FAMILIES: dict[str, Family] = {
    # halves: rotate_half pairs feature k with k + d/2
    "llama": _HALF,
    "mistral": _HALF,
    "mixtral": Family("half", base=1e6),
    "qwen2": Family("half", slides=False),
    "qwen2_moe": Family("half", slides=False),
    "qwen3": Family("half", head_dim=128, heads=32, slides=False),
    "qwen3_moe": Family("half", slides=False),
    "qwen2_vl": _QWEN2_VL,
    "qwen2_vl_text": _QWEN2_VL,
    "qwen2_5_vl": _QWEN2_VL,
    "qwen2_5_vl_text": _QWEN2_VL,
    "qwen3_vl_text": _QWEN3_VL,
    "qwen3_vl_moe_text": replace(_QWEN3_VL, heads=16),
    "gemma": Family("half", head_dim=256, heads=16),
    "gemma2": Family(
        "half", head_dim=256, heads=8, scale="query_pre_attn_scalar", soft_capping=50.0
    ),
    "gemma3_text": Family(
        "half",
        base=1e6,
        head_dim=256,
        heads=8,
        scale="query_pre_attn_scalar",
        layers=_gemma3_layers,
    ),  # fmt: skip
    "phi": Family("half", fraction=0.5),
    "phi3": Family(
        "half",
        type_rewrites=(("su", "longrope"), ("yarn", "longrope")),
        original_max_positions=4096,
    ),  # fmt: skip
    "gpt_neox": Family(
        "half", fraction=0.25, rope_keys=RopeKeys("rotary_emb_base", "rotary_pct", True)
    ),
    "olmo": _HALF,
    "olmo2": _HALF,
    "olmoe": _HALF,
    "starcoder2": _HALF,
    "stablelm": Family("half", fraction=0.25),
    "persimmon": Family("half", base=25000.0, fraction=0.5),
    "falcon": _HALF,
    "granite": Family("half", scale="attention_multiplier"),
    "granitemoe": Family("half", scale="attention_multiplier"),
    "smollm3": Family("half", base=2e6, layers=_rope_flag_layers, slides=False),
    # neighbours: feature 2k pairs with 2k + 1
    "llama4_text": Family(
        "interleaved",
        base=5e5,
        head_dim=128,
        heads=40,
        layers=_llama4_layers,
        llama4_attention=True,
    ),  # fmt: skip
    "cohere": _INTERLEAVED,
    "cohere2": Family("interleaved", layers=_cohere2_layers),
    "glm": Family("interleaved", fraction=0.5, head_dim=128, heads=32),
    "glm4": Family("interleaved", fraction=0.5, head_dim=128, heads=32),
    "helium": Family("interleaved", base=1e5, head_dim=128, heads=20),
    "ernie4_5": Family("interleaved", base=5e5, head_dim=128, heads=16),
    # create_sinusoidal_positions: base 10000 and no scaling, whatever the config says
    "gptj": Family("interleaved", rotary_dim_key="rotary_dim", rope_keys=_FIXED_ROPE),
    "codegen": Family("interleaved", rotary_dim_key="rotary_dim", rope_keys=_FIXED_ROPE),
}

TEXT_MODEL_TYPES = {
    "llama4": "llama4_text",
    "gemma3": "gemma3_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
}
"""The language model's family of a multimodal model_type whose text_config may leave
its own model_type out (the configuration class then builds that family's config)."""

UNREAD_KEYS: dict[str, str] = {
    "attention_multiplier": "a logit scale of its own",
    "query_pre_attn_scalar": "a logit scale of its own",
    "qk_rope_head_dim": "latent attention (a separately rotated part of each head)",
    "no_rope_layers": "layers without positions",
}
"""Keys that change a model's attention, which from-hf reads only for the families it
knows: a config of another family that sets one is refused, with what it changes."""

REFUSED: dict[str, str] = {
    **{
        family: "multi-head latent attention rotates a separate trailing part of each query "
        "and key head (qk_rope_head_dim); posgen rotates leading or spread features"
        for family in ("deepseek_v2", "deepseek_v3")
    },
    "gpt_oss": "attention sinks: a learned logit per head joins every row's softmax "
    "(GptOssAttention's sinks), which posgen's attention does not have",
    "longt5": "LongT5's encoder attends locally (each query to the keys within local_radius, "
    "read block by block: encoder_attention_type 'local') or also to a global token per "
    "block of global_block_size with a bias table of its own ('transient-global'), never "
    "as T5's full attention, and posgen's attention does neither; only its decoder's "
    "self-attention is T5's (the catalogue's t5_decoder)",
}
"""Families whose attention posgen's specs cannot state, with the reason."""

T5_FAMILIES: dict[str, str] = {
    **dict.fromkeys(
        ("t5", "mt5", "switch_transformers", "pop2piano"),
        "the first layer of each stack (encoder, decoder) learns the bias table and every "
        "layer of that stack adds it: one module per stack",
    ),
    "umt5": "every self-attention layer learns a bias table of its own: one module per layer",
}
"""The families whose self-attention adds T5's bucketed bias (``T5Attention``'s
``_relative_position_bucket``, no 1/sqrt(d_kv) scale) with
``relative_attention_num_buckets``, ``relative_attention_max_distance``, ``num_heads`` and
``d_kv``, each with how its layers hold the bias table. Another model_type that sets
``relative_attention_num_buckets`` is refused: MPNet buckets the same keys but also adds
absolute position embeddings, UDOP adds 2-D layout biases, LongT5's encoder attends
locally (``REFUSED``)."""
