"""``posgen from-hf``: a spec from a Hugging Face model config's position settings.

Reads a ``config.json`` (a dict) and writes the spec of the positional encoding that
model uses, starting from the catalogue spec of its family and setting what the config
states:

- rotary models (Llama, Mistral, Qwen, Gemma, Phi, GPT-NeoX, GPT-J, Cohere, GLM,
  Llama 4, SmolLM3, Qwen2-VL, ...; the families of ``posgen.hf_families``): ``rope`` with
  the family's pairing and the config's ``rope_theta``, ``partial_rotary_factor`` /
  ``rotary_pct`` / ``rotary_dim``, ``head_dim``, ``num_attention_heads``, every
  ``rope_scaling`` type of Hugging Face's ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn,
  longrope, llama3) as a frequency schedule, ``mrope_section`` as M-RoPE axes, and a
  logit scale other than 1/sqrt(head_dim) (``query_pre_attn_scalar``,
  ``attention_multiplier``);
- models whose layers differ (Llama 4, SmolLM3, Gemma 3, Cohere 2): the spec of one layer,
  chosen with ``layer``: ``rope`` as above (Gemma 3's sliding layers with
  ``rope_local_base_freq``), or ``nope`` (``nope_llama4`` with the config's
  ``floor_scale`` and ``attn_scale`` where Llama 4 tunes the temperature);
- BLOOM (``n_head``, ``hidden_size``) and MPT (``n_heads``, ``d_model``, ``alibi_bias_max``
  8, ``attn_config.softmax_scale`` as the logit scale): ``alibi``;
- the T5 family (``relative_attention_num_buckets``, ``relative_attention_max_distance``,
  ``num_heads``, ``d_kv``; the model_types of ``T5_FAMILIES``): ``t5``, the encoder's
  self-attention (the notes give the decoder's ``t5_decoder``).

A setting the catalogue cannot express (an unknown ``rope_scaling`` type, MPT's
``alibi_bias_max`` other than 8 or ``alibi`` false, logit soft-capping, DeepSeek's latent
attention, LongT5's local attention) is an error that names it, never a spec that is
silently different from the model; so is a rotary ``model_type`` whose pairing from-hf
does not know, unless ``pairing`` states it, and T5's buckets in a ``model_type`` whose
code from-hf has not read. A ``rope_scaling`` must state its type (``rope_type`` or
``type``, which must agree where both are set: Hugging Face's families settle that
differently). Values the spec language bounds (LongRoPE's one factor per rotated pair,
M-RoPE's sections summing to the pairs, T5's bucket counts) are checked here and named
by their config key. A malformed setting (a count that is not a positive integer, or
is a boolean; a number that is not finite and positive; a section that is not a mapping)
is a ``ConfigError`` naming the key (``rope_scaling.factor``) and what it allows; every
value is read through the typed readers of ``posgen.hf_config.Settings``. A key that is
absent or null takes Hugging Face's default, or is reported missing where there is none.
What the config sets that is a mask rather than a position term (a sliding window,
Llama 4's attention chunks) is stated in comments above the spec, with the module
argument that applies it.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posgen.hf_config import REQUIRED, ConfigError, Settings
from posgen.hf_families import (
    BASE_KEYS,
    FAMILIES,
    FRACTION_KEYS,
    REFUSED,
    T5_FAMILIES,
    TEXT_MODEL_TYPES,
    UNREAD_KEYS,
    Family,
    LayerKind,
    Pairing,
)

MIN_SCALE_FACTOR, MAX_SCALE_FACTOR = 1e-3, 1e3  # the spec's scale.factor range
MAX_BUCKETS, MAX_BUCKET_DISTANCE = 4096, 1 << 24  # the spec's log_buckets ranges
# rope_scaling types that name one schedule: Qwen2-VL's "mrope" is "default" (plain
# frequencies, M-RoPE's sections aside), Phi-3's "su" is "longrope"
_SAME_SCHEDULE = {"mrope": "default", "su": "longrope"}


@dataclass
class _Layer:
    """The layer whose positions the spec states, and what from-hf says about it."""

    kind: LayerKind = LayerKind.ROTARY
    index: int | None = None
    part: str | None = None  # which attention of the model, where it has several kinds
    notes: list[str] = field(default_factory=list)


def default_name(config: dict[str, Any]) -> str:
    """The spec name from-hf gives without ``--name``: MODEL_TYPE_positions."""
    model_type = Settings(config).word("model_type", "model")
    return f"{model_type}_positions".replace("-", "_")


def spec_from_config(
    config: dict[str, Any],
    name: str,
    catalogue: Path,
    *,
    layer: int | None = None,
    pairing: Pairing | None = None,
) -> str:
    """The YAML text of the spec called ``name`` for this model config.

    layer: the index of the attention layer to describe, for models whose layers differ
        (required there; checked against ``num_hidden_layers`` where the config states it).
    pairing: ``half`` or ``interleaved``, for a rotary model of a family from-hf does not
        know (for a known family it must agree with the family's).
    """
    settings, model_type = _language_model(config)
    if model_type in REFUSED:
        raise ConfigError(f"model_type {model_type!r}: {REFUSED[model_type]}")
    known = FAMILIES.get(model_type)
    _refuse_soft_capping(settings, known.soft_capping if known is not None else None)
    if layer is not None and settings.has("num_hidden_layers"):
        _check_layer_index(layer, settings.layer_count())
    chosen = _Layer(index=layer)
    if model_type in FAMILIES or settings.has("rope_theta"):
        family = _family(model_type, settings, pairing)
        chosen = _chosen_layer(family, settings, layer)
        spec = _rotary_family_spec(family, chosen, settings, catalogue)
    elif pairing is not None:
        raise ConfigError(f"--pairing {pairing}: model_type {model_type!r} does not rotate")
    elif model_type == "bloom":
        spec = _alibi(settings, _catalogue(catalogue, "alibi"), "BLOOM")
    elif model_type == "mpt":
        spec = _mpt(settings, _catalogue(catalogue, "alibi"))
    elif settings.has("relative_attention_num_buckets"):
        spec = _t5(model_type, settings, _catalogue(catalogue, "t5"), chosen)
    else:
        raise ConfigError(f"model_type {model_type!r}: no position settings posgen can read")
    spec["name"] = name
    source = settings.word("_name_or_path", "") or model_type
    where = "" if chosen.index is None else f", layer {chosen.index}"
    part = "" if chosen.part is None else f", {chosen.part}"
    spec["title"] = f"{spec['title']} ({source} config{where}{part})"
    notes = "".join(
        textwrap.fill(note, 88, initial_indent="# ", subsequent_indent="#   ") + "\n"
        for note in chosen.notes
    )
    return notes + yaml.safe_dump(spec, sort_keys=False, width=88, allow_unicode=False)


def _language_model(config: dict[str, Any]) -> tuple[Settings, str]:
    """The settings of the language model and its ``model_type``: a multimodal config's
    ``text_config`` (Llama 4, Gemma 3, Qwen2-VL) over the top level, where it holds the
    rotary settings or names a family; a message names such a key ``text_config.KEY``."""
    settings = Settings(config)
    model_type = settings.word("model_type", "")
    text = settings.section("text_config")
    text_type = text.word("model_type", "") or TEXT_MODEL_TYPES.get(model_type, "")
    held = text.values
    if held and "rope_theta" not in config and ("rope_theta" in held or text_type in FAMILIES):
        # each key of the language model named where the file has it: text_config.KEY
        return settings.overlaid("text_config"), text_type or model_type
    return settings, model_type


def _refuse_soft_capping(config: Settings, default: float | None) -> None:
    """ConfigError where the model caps its logits (Gemma 2, whose cap is 50 where the
    config leaves the key out; null: no cap): posgen's attention does not."""
    key = "attn_logit_softcapping"
    stated = key in config.values
    if (stated and config.has(key)) or (not stated and default is not None):
        cap = config.positive_number(key) if stated else default
        raise ConfigError(
            f"{config.path(key)} {cap:g}: the model caps its logits (cap * tanh(logits / "
            "cap)) and posgen's attention does not, so no spec gives this model's attention"
        )


def _family(model_type: str, config: Settings, pairing: Pairing | None) -> Family:
    """The model's family; for a rotary model_type from-hf does not know, one with the
    pairing the user states and Hugging Face's usual defaults."""
    family = FAMILIES.get(model_type)
    if family is not None:
        if pairing is not None and pairing != family.pairing:
            raise ConfigError(
                f"--pairing {pairing}: Hugging Face's {model_type} pairs {family.pairing} "
                "features (leave --pairing out for a family from-hf knows)"
            )
        if model_type == "falcon" and config.flag("alibi", False):
            raise ConfigError(
                "alibi is true: this Falcon adds ALiBi with Falcon's own slopes and "
                "scaling, which from-hf does not translate"
            )
        return family
    if pairing is None:
        raise ConfigError(
            f"model_type {model_type!r} is not a rotary family from-hf knows, so it cannot "
            "tell how the model pairs rotated features: read its apply_rotary_pos_emb and "
            "pass --pairing half (rotate_half on halves, feature k with k + d/2: Llama, "
            "Mistral, Qwen) or --pairing interleaved (neighbours 2k and 2k + 1: GPT-J, "
            "Cohere, GLM, Llama 4)"
        )
    for key, what in UNREAD_KEYS.items():
        if config.has(key):
            raise ConfigError(
                f"{config.path(key)}: model_type {model_type!r} sets it ({what}), and "
                "from-hf reads it only for the families it knows"
            )
    if config.has("layer_types") and len(set(config.words("layer_types"))) > 1:
        raise ConfigError(
            f"model_type {model_type!r} has layers of several kinds "
            f"({config.path('layer_types')}), and "
            "from-hf does not know which of them rotate in this family"
        )
    return Family(pairing)


def _chosen_layer(family: Family, config: Settings, layer: int | None) -> _Layer:
    """The layer the spec describes: its kind, and the notes about it."""
    chosen = _Layer(index=layer)
    if family.layers is not None:
        kinds = family.layers(config)
        if layer is None and len(set(kinds)) > 1:
            raise ConfigError(_several_kinds(kinds))
        if layer is not None:  # the list's own length where num_hidden_layers is not stated
            _check_layer_index(layer, len(kinds))
        chosen.kind = kinds[0 if layer is None else layer]
    _note_masks(family, config, chosen)
    return chosen


def _several_kinds(kinds: list[LayerKind]) -> str:
    """The message for a model whose layers differ and no --layer was given."""
    shown = 8
    parts = []
    for kind in sorted(set(kinds), key=kinds.index):
        indices = [index for index, each in enumerate(kinds) if each is kind]
        listed = ", ".join(str(index) for index in indices[:shown])
        more = f", ... ({len(indices)} in all)" if len(indices) > shown else ""
        parts.append(f"{kind.value} on layers {listed}{more}")
    return (
        f"the model's layers differ ({'; '.join(parts)}): choose one with --layer INDEX "
        "(one spec per kind of layer)"
    )


def _check_layer_index(layer: int, count: int) -> None:
    """ConfigError when --layer is past the model's ``count`` layers."""
    if layer >= count:
        raise ConfigError(f"--layer {layer}: the config has {count} layers (0 to {count - 1})")


def _note_masks(family: Family, config: Settings, chosen: _Layer) -> None:
    """Notes for what the layer's attention does that is a mask, not a position term."""
    if family.llama4_attention and chosen.kind is LayerKind.ROTARY:
        chunk = config.positive_int("attention_chunk_size", 8192)
        chosen.notes.append(
            f"Llama 4's RoPE layers attend within chunks of {chunk} positions (a mask, not a "
            f"position term): call the module with document_ids=positions // {chunk}"
        )
        if config.truth("use_qk_norm", True):  # HF tests its truth
            chosen.notes.append(
                "Llama 4 normalises each head of q and k on its RoPE layers (use_qk_norm: "
                "x / sqrt(mean(x^2) + rms_norm_eps), no weight); a rotation keeps that norm, "
                "so apply it before calling the module"
            )
    sliding = config.has("sliding_window") and config.flag("use_sliding_window", family.slides)
    if sliding and _may_slide(family, config, chosen):
        window = config.positive_int("sliding_window")
        known = chosen.index is not None and config.has("layer_types")
        where = "this layer attends" if known else "where the model attends"
        chosen.notes.append(
            f"{where} a sliding window of {window} keys (a mask, not a position term): call "
            f"the module with window={window}"
        )


def _may_slide(family: Family, config: Settings, chosen: _Layer) -> bool:
    """Whether the chosen layer may attend a sliding window: its layer type, where the
    config states them (SmolLM3's slide only on NoPE layers); Llama 4's never do."""
    if family.llama4_attention:
        return False
    if chosen.index is None or not config.has("layer_types"):
        return True
    types = config.words("layer_types")
    return chosen.index < len(types) and types[chosen.index] == "sliding_attention"


def _rotary_family_spec(
    family: Family, chosen: _Layer, config: Settings, catalogue: Path
) -> dict[str, Any]:
    """The spec of the chosen layer of a rotary family."""
    if family.heads is not None and not config.has("num_attention_heads"):
        heads = family.heads  # the configuration class's default
    else:
        heads = _heads(config, "num_attention_heads", "n_head")
    if family.head_dim is not None and not config.has("head_dim"):
        head_dim = family.head_dim  # the configuration class's default, not hidden // heads
    else:
        head_dim = _head_dim(config, heads, _HIDDEN_KEYS)
    if chosen.kind is LayerKind.NOPE:
        spec = _nope(family, config, catalogue)
    else:
        start = _catalogue(catalogue, "rope" if family.pairing == "half" else "rope_gptj")
        spec = _rotary(family, chosen.kind, config, head_dim, start)
    spec["defaults"] = {"heads": heads, "head_dim": head_dim}
    spec["models"] = []
    factor = _scale_factor(family, config, head_dim)
    if factor is not None:
        spec["scale"] = {"kind": "inv_sqrt_head_dim", "factor": factor}
    return spec


def _inverse_square(scale: float) -> float:
    """1 / scale², inf where it overflows (a scale of 1e-170: its square is 0)."""
    inverse = 1.0 / scale  # a positive float: at most inf, never a division by 0
    return inverse * inverse


def _scale_factor(family: Family, config: Settings, head_dim: int) -> float | None:
    """The spec's scale.factor f, where the model's scale 1/sqrt(f · head_dim) is not
    1/sqrt(head_dim): Gemma's 1/sqrt(query_pre_attn_scalar), Granite's
    attention_multiplier m (f = 1 / (m² · head_dim)); None for 1/sqrt(head_dim)."""
    if family.scale == "query_pre_attn_scalar":
        factor = config.positive_number("query_pre_attn_scalar", 256.0) / head_dim
    elif family.scale == "attention_multiplier":
        multiplier = config.positive_number("attention_multiplier", 1.0)
        factor = _inverse_square(multiplier) / head_dim
    else:
        return None
    if not MIN_SCALE_FACTOR <= factor <= MAX_SCALE_FACTOR:
        raise ConfigError(
            f"{config.path(family.scale)}: gives the logit scale 1/sqrt({factor:g} * "
            f"head_dim), and a spec's scale.factor is in [{MIN_SCALE_FACTOR:g}, "
            f"{MAX_SCALE_FACTOR:g}]"
        )
    return None if factor == 1.0 else factor


def _nope(family: Family, config: Settings, catalogue: Path) -> dict[str, Any]:
    """A NoPE layer: ``nope``, or ``nope_llama4`` with the config's floor_scale and
    attn_scale where Llama 4 tunes the attention temperature (attn_temperature_tuning,
    which Hugging Face tests for truth: Scout's config states 4). An attn_scale of 0
    scales every query by exactly 1, which is plain ``nope``."""
    tuned = family.llama4_attention and config.truth("attn_temperature_tuning", True)
    attn_scale = config.non_negative_number("attn_scale", 0.1) if tuned else 0.0
    spec = _catalogue(catalogue, "nope_llama4" if attn_scale > 0 else "nope")
    if attn_scale > 0:
        spec["query_scale"] = {
            "kind": "llama4",
            "floor_scale": _floor_scale(config),
            "attn_scale": attn_scale,
        }
    return spec


def _floor_scale(config: Settings) -> int:
    """Llama 4's ``floor_scale`` (default 8192), the positions per step of its
    temperature, floor((i + 1) / floor_scale): an integer, or a float of an integral
    value (4.0), which Hugging Face divides by alike. A fractional one steps at uneven
    positions, which posgen's query scale (a whole count of positions per step) does
    not state: refused, saying so."""
    key = "floor_scale"
    stated = config.values.get(key)
    if isinstance(stated, float) and math.isfinite(stated) and not stated.is_integer():
        raise ConfigError(
            f"{config.path(key)}: {stated:g} is not a whole number; Hugging Face's "
            f"temperature steps at floor((i + 1) / {stated:g}), and posgen's llama4 query "
            "scale steps every floor_scale positions, a positive integer"
        )
    return config.whole_number(key, 8192)


_HIDDEN_KEYS = ("hidden_size", "n_embd")


def _catalogue(folder: Path, name: str) -> dict[str, Any]:
    """The catalogue spec ``name`` as plain data, to start from."""
    loaded: dict[str, Any] = yaml.safe_load((folder / f"{name}.yaml").read_text("utf-8"))
    return loaded


def _stated(config: Settings, keys: tuple[str, ...], what: str) -> str:
    """The first of ``keys`` that the config sets; ConfigError naming them all if none."""
    key = config.first_set(*keys)
    if not config.has(key):
        named = " / ".join(config.path(each) for each in keys)
        raise ConfigError(f"the config states no {what} ({named})")
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
        raise ConfigError(f"{config.path(key)} {hidden} is smaller than the head count {heads}")
    return hidden // heads


def _rotary(
    family: Family, kind: LayerKind, config: Settings, head_dim: int, spec: dict[str, Any]
) -> dict[str, Any]:
    """``rope`` with the family's pairing and the config's base, rotated features,
    ``rope_scaling`` and M-RoPE sections; a local layer (Gemma 3's sliding layers) turns
    with ``rope_local_base_freq`` and no scaling."""
    fraction = _rotated_fraction(family, config, head_dim)
    rotated = _Rotated(round(head_dim * fraction), head_dim)  # int(head_dim * fraction)
    # RoFormer's decay bound holds or fails with the pairs a head has, the base and the
    # schedule (a 16-wide head at base 10^4 breaks it): measured by check, not claimed
    spec["claims"].pop("decay", None)
    rotate = spec["terms"]["content_content"]["rotate"]
    rotate["pairing"] = family.pairing
    scaling = _scaling(family, config)
    schedule = _schedule(family, config, scaling)
    if kind is LayerKind.LOCAL_ROTARY:
        rotate["base"] = config.positive_number("rope_local_base_freq", 10000.0)
        scaling, schedule = Settings({}, "rope_scaling."), "default"
    else:
        rotate["base"] = _base(family, config)
    if fraction != 1.0:
        rotate["rotary_dims"] = {"fraction": fraction, "layout": "leading"}
    axes = _mrope_axes(family, scaling, rotated)
    if axes is not None:
        rotate["axes"] = axes
    if _SAME_SCHEDULE.get(schedule, schedule) != "default":
        rotate["frequencies"] = _frequencies(schedule, scaling, config, rotated, family)
        if schedule == "dynamic":
            spec["claims"].pop("relative", None)  # the base follows the call's length
    return spec


@dataclass(frozen=True)
class _Rotated:
    """The features each head rotates (Hugging Face's int(head_dim × fraction)), for the
    messages of the settings that give one value per pair or section."""

    features: int
    head_dim: int

    @property
    def pairs(self) -> int:
        """The rotated pairs: one frequency each."""
        return self.features // 2

    def __str__(self) -> str:
        """The pair count and where it comes from: ``32 (64 rotated features / 2)``."""
        share = "" if self.features == self.head_dim else f" of head_dim {self.head_dim}"
        return f"{self.pairs} ({self.features} rotated features{share} / 2)"


def _schedule(family: Family, config: Settings, scaling: Settings) -> str:
    """The rope_scaling type the family's code runs: ``default`` without rope_scaling or
    for a family that reads none, ``llama3`` for Llama 4 (whatever the type keys say),
    else ``rope_type`` / ``type``. ConfigError where a rope_scaling states neither (Hugging
    Face looks the type up and fails) or the two disagree (its configuration classes
    settle that differently)."""
    if not config.has("rope_scaling"):
        return "default"
    if family.rope_keys is not None and not family.rope_keys.scaling:
        return "default"  # an empty rope_scaling, which _scaling lets by: never read
    if family.llama4_attention:
        return "llama3"  # Llama4TextRotaryEmbedding: llama3 whenever rope_scaling is set
    stated = {key: scaling.word(key, "") for key in ("rope_type", "type") if scaling.has(key)}
    if "type" in stated:  # as the family's configuration class rewrites it
        stated["type"] = dict(family.type_rewrites).get(stated["type"], stated["type"])
    if not stated:
        raise ConfigError(
            f"{config.path('rope_scaling')}: states neither rope_type nor type, and Hugging "
            "Face's rotary embedding looks the type up (a KeyError without one): set rope_type "
            '("default" for plain RoPE) or make rope_scaling null'
        )
    if len({_SAME_SCHEDULE.get(kind, kind) for kind in stated.values()}) > 1:
        raise ConfigError(
            f"{scaling.path('type')} {stated['type']!r} and {scaling.path('rope_type')} "
            f"{stated['rope_type']!r} disagree, and Hugging Face settles that per family: "
            "LlamaConfig and most others copy type over rope_type (type wins), Gemma's, "
            "Phi-3's, Cohere's and Falcon's read rope_type (rope_type wins); make them agree "
            "or leave one out"
        )
    kind = stated.get("rope_type") or stated.get("type")
    if not kind:  # "" (false to Hugging Face's `or`): neither names a schedule
        key = "rope_type" if "rope_type" in stated else "type"
        raise ConfigError(f"{scaling.path(key)}: must name a schedule, got {stated[key]!r}")
    return kind


def _mrope_axes(family: Family, scaling: Settings, rotated: _Rotated) -> dict[str, Any] | None:
    """M-RoPE's position axes: ``rope_scaling.mrope_section`` (else the family's default
    sections) laid out as the family's code lays them, or for a family from-hf does not
    know, as ``rope_scaling.mrope_interleaved`` says; None without sections. A stated
    layout the family's code does not follow is refused, and so are sections that do
    not split the rotated pairs."""
    key = "mrope_interleaved"
    stated = scaling.flag(key, False) if scaling.has(key) else None
    layout = family.mrope_layout
    if layout is None:
        layout = "interleaved" if stated else "consecutive"
    elif stated is not None and stated != (layout == "interleaved"):
        runs = "deals them out in turn" if layout == "interleaved" else "lays them in runs"
        raise ConfigError(
            f"{scaling.path(key)}: {str(stated).lower()}, but this family's modeling code "
            f"{runs}, whatever the key says"
        )
    if scaling.has("mrope_section"):
        sections = scaling.positive_ints("mrope_section")
        stated_as = f"{sections}"
    elif family.mrope_sections is not None:
        sections = list(family.mrope_sections)
        stated_as = f"left out, so the family's default {sections},"
    else:
        return None
    if sum(sections) != rotated.pairs:
        raise ConfigError(
            f"{scaling.path('mrope_section')}: {stated_as} sums to {sum(sections)}; the "
            f"sections split the rotated pairs, so they must sum to {rotated}"
        )
    return {"kind": "sections", "sections": sections, "layout": layout}


def _base(family: Family, config: Settings) -> float:
    """The base the family's code turns by: the first of ``BASE_KEYS`` set (else the
    family's default), or where the family reads its own key (``RopeKeys``), that one,
    which any other base key set must agree with."""
    keys = family.rope_keys
    if keys is None:
        return config.positive_number(config.first_set(*BASE_KEYS), family.base)
    base = family.base if keys.base is None else config.positive_number(keys.base, family.base)
    _refuse_unread(config, BASE_KEYS, keys.base, base, "base")
    return base


def _scaling(family: Family, config: Settings) -> Settings:
    """``rope_scaling``, refused for a family whose code applies none."""
    scaling = config.section("rope_scaling")
    if family.rope_keys is not None and not family.rope_keys.scaling and scaling.values:
        raise ConfigError(
            f"{config.path('rope_scaling')}: this family's modeling code applies no scaling "
            "(it reads no rope_scaling); leave it out"
        )
    return scaling


def _refuse_unread(
    config: Settings, keys: tuple[str, ...], read: str | None, value: float, what: str
) -> None:
    """ConfigError for a key of ``keys`` other than ``read`` (the one the family's code
    reads; None: none) set to another value than ``value``: the model ignores it."""
    for key in keys:
        if key == read or not config.has(key):
            continue
        stated = config.positive_number(key)
        if stated != value:
            uses = f"{read} ({value:g})" if read else f"{value:g}, whatever the config says"
            raise ConfigError(
                f"{config.path(key)}: {stated:g} is not the {what} this family's modeling "
                f"code turns by, {uses}: it reads no {key}; make them agree or leave {key} out"
            )


def _rotated_fraction(family: Family, config: Settings, head_dim: int) -> float:
    """The rotated share of each head: ``partial_rotary_factor`` / ``rotary_pct`` (or
    the family's own key of the two, ``RopeKeys``), or GPT-J's ``rotary_dim`` features
    (default 64) over head_dim."""
    if family.rotary_dim_key is None:
        own = family.rope_keys.fraction if family.rope_keys is not None else None
        key = own or config.first_set(*FRACTION_KEYS)
        fraction = config.positive_number(key, family.fraction)
        if own is not None:
            _refuse_unread(config, FRACTION_KEYS, own, fraction, "rotated share")
        return _truncated_fraction(config.path(key), fraction, head_dim)
    features = config.positive_int(family.rotary_dim_key, 64)
    if features > head_dim or features % 2:
        raise ConfigError(
            f"{config.path(family.rotary_dim_key)}: must be even and at most head_dim "
            f"{head_dim}, got {features}"
        )
    return features / head_dim


def _truncated_fraction(key: str, fraction: float, head_dim: int) -> float:
    """Hugging Face rotates int(head_dim * fraction) features (truncated, its frequencies
    base^(-2k / that width)); posgen's specs round fraction * head_dim. The fraction of
    exactly those features, or ConfigError where they are odd or fewer than 2."""
    if not head_dim * fraction <= head_dim:  # inf (1e308) or past head_dim: no int() of it
        raise ConfigError(f"{key}: must be a fraction of head_dim in (0, 1], got {fraction:g}")
    features = int(head_dim * fraction)
    if features % 2 or features < 2:
        raise ConfigError(
            f"{key}: {fraction:g} of head_dim {head_dim} is {head_dim * fraction:g} "
            f"features, of which Hugging Face rotates int() = {features}; posgen's specs "
            "rotate an even count of at least 2 (frequencies over that count)"
        )
    return fraction if round(head_dim * fraction) == features else features / head_dim


def _frequencies(
    kind: str, scaling: Settings, config: Settings, rotated: _Rotated, family: Family
) -> dict[str, Any]:
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
        return _longrope(scaling, config, rotated, family.original_max_positions)
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
    # Hugging Face reads rope_scaling.get("truncate", True): null is falsy there
    if scaling.values.get("truncate", True) is None or not scaling.flag("truncate", True):
        frequencies["truncate"] = False
    return frequencies


def _longrope(
    scaling: Settings, config: Settings, rotated: _Rotated, default_original: int | None
) -> dict[str, Any]:
    """LongRoPE as Hugging Face's: with a top-level original_max_position_embeddings
    (Phi-3 states the trained length there, and Phi3Config sets 4096 where the config
    leaves it out: ``default_original``), the factor is max_position_embeddings over
    it; else the original length is max_position_embeddings and the factor
    rope_scaling's."""
    key = "original_max_position_embeddings"
    if config.has(key) or default_original is not None:
        original = config.positive_int(
            key, REQUIRED if default_original is None else default_original
        )
        factor = config.positive_int("max_position_embeddings") / original
    else:
        original = config.positive_int("max_position_embeddings")
        factor = scaling.positive_number("factor", 1.0)
    frequencies = {
        "kind": "longrope",
        "short_factor": _per_pair(scaling, "short_factor", rotated),
        "long_factor": _per_pair(scaling, "long_factor", rotated),
        "original_max_positions": original,
        "factor": max(factor, 1.0),
    }
    if scaling.has("attention_factor"):
        frequencies["attention_factor"] = scaling.positive_number("attention_factor")
    return frequencies


def _per_pair(scaling: Settings, key: str, rotated: _Rotated) -> list[float]:
    """LongRoPE's list ``key`` of factors > 0, one per rotated pair (as Hugging Face's
    longrope validation requires)."""
    factors = scaling.positive_numbers(key)
    if len(factors) != rotated.pairs:
        raise ConfigError(
            f"{scaling.path(key)}: has {len(factors)} entries; longrope needs one per "
            f"rotated pair: {rotated}"
        )
    return factors


def _alibi(config: Settings, spec: dict[str, Any], model: str) -> dict[str, Any]:
    heads = _heads(config, "n_head", "n_heads", "num_attention_heads")
    spec["defaults"] = {
        "heads": heads,
        "head_dim": _head_dim(config, heads, ("hidden_size", "d_model")),
    }
    spec["models"] = [model]
    return spec


def _mpt(config: Settings, spec: dict[str, Any]) -> dict[str, Any]:
    """MPT's ALiBi: ``build_mpt_alibi_tensor`` with alibi_bias_max 8 gives ALiBi's slopes
    for every head count (for a count that is not a power of two, its odd then even
    slopes of the next power of two are the paper's recipe), added after the logit
    scale ``attn_config.softmax_scale`` (default 1/sqrt(d_model / n_heads)).
    ``attn_config.alibi`` defaults to true (MptAttentionConfig); Hugging Face's MptModel
    adds ALiBi with alibi_bias_max 8 whatever the two say, MosaicML's own code follows
    them: a config that sets either otherwise is refused."""
    attention = config.section("attn_config")
    if not attention.flag("alibi", True):
        raise ConfigError(
            "attn_config.alibi is false: MosaicML's MPT then uses no ALiBi bias (learned "
            "position embeddings), while Hugging Face's MptModel adds ALiBi whatever it "
            "says, so from-hf does not guess which of the two this model is"
        )
    bias_max = attention.positive_number("alibi_bias_max", 8.0)
    if bias_max != 8:
        raise ConfigError(
            f"attn_config.alibi_bias_max {bias_max:g}: MosaicML's MPT then has slopes "
            "2^(-alibi_bias_max * h / heads), not alibi_geometric's (8), while Hugging Face's "
            "MptModel uses 8 whatever it says, so from-hf does not guess which of the two "
            "this model is"
        )
    spec = _alibi(config, spec, "MPT")
    if attention.has("softmax_scale"):
        scale = attention.positive_number("softmax_scale")
        factor = _inverse_square(scale) / spec["defaults"]["head_dim"]
        if not MIN_SCALE_FACTOR <= factor <= MAX_SCALE_FACTOR:
            raise ConfigError(
                f"attn_config.softmax_scale: {scale:g} gives the logit scale "
                f"1/sqrt({factor:g} * head_dim), and a spec's scale.factor is in "
                f"[{MIN_SCALE_FACTOR:g}, {MAX_SCALE_FACTOR:g}]"
            )
        if factor != 1.0:
            spec["scale"] = {"kind": "inv_sqrt_head_dim", "factor": factor}
    return spec


def _t5(model_type: str, config: Settings, spec: dict[str, Any], chosen: _Layer) -> dict[str, Any]:
    """The encoder self-attention of a T5-family model (``T5_FAMILIES``): ``t5`` with the
    config's buckets, max distance and sizes; the notes say what its decoder does."""
    tables = T5_FAMILIES.get(model_type)
    if tables is None:
        what = f"model_type {model_type!r}" if model_type else "a config without model_type"
        known = ", ".join(T5_FAMILIES)
        raise ConfigError(
            f"relative_attention_num_buckets: {what} sets it, and from-hf reads T5's "
            f"bucketed bias only for the families whose code it follows ({known}): "
            "another family may bucket or scale differently or add other position terms "
            "(MPNet adds absolute position embeddings, UDOP 2-D layout biases); if its "
            "attention is T5's, start from the catalogue's t5 (posgen new NAME --from t5)"
        )
    buckets, max_distance = _t5_buckets(config)
    index = spec["terms"]["position_position"]["bias"]["index"]
    index["buckets"] = buckets
    index["max_distance"] = max_distance
    heads = _heads(config, "num_heads")
    spec["defaults"] = {"heads": heads, "head_dim": config.positive_int("d_kv", 64)}
    spec["models"] = []
    chosen.part = "encoder self-attention"
    chosen.notes += [
        "this spec is the encoder's self-attention (bidirectional buckets); the decoder's "
        "self-attention adds a bias of its own over one-sided buckets (past keys only, "
        "under the causal mask): posgen new NAME --from t5_decoder, then set buckets: "
        f"{buckets} and max_distance: {max_distance}; cross-attention has no position term",
        f"{model_type}: {tables}",
    ]
    return spec


def _t5_buckets(config: Settings) -> tuple[int, int]:
    """``relative_attention_num_buckets`` and ``relative_attention_max_distance`` (default
    128), refused where the encoder's buckets are not posgen's bidirectional ones."""
    key = "relative_attention_num_buckets"
    buckets = config.positive_int(key)
    max_distance = config.positive_int("relative_attention_max_distance", 128)
    if buckets % 2:
        raise ConfigError(
            f"{key}: {buckets} is odd; T5's encoder splits its buckets between the two "
            f"directions ({buckets // 2} each, the table's last row never read), and "
            "posgen's bidirectional buckets need an even count"
        )
    if not 4 <= buckets <= MAX_BUCKETS:
        raise ConfigError(
            f"{key}: {buckets}; T5's encoder gives each direction half the buckets and "
            "half of those to exact distances, so posgen needs 4 to "
            f"{MAX_BUCKETS} buckets (its bias table holds buckets x heads floats)"
        )
    max_exact = buckets // 4
    if not max_exact < max_distance <= MAX_BUCKET_DISTANCE:
        raise ConfigError(
            f"relative_attention_max_distance: {max_distance}; the log-spaced buckets run "
            f"from the exact range ({max_exact} distances, {key} / 4) to it, so it must be "
            f"above {max_exact} (and at most {MAX_BUCKET_DISTANCE:,})"
        )
    return buckets, max_distance
