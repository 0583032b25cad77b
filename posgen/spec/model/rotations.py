"""Rotations of q and k (RoPE and its frequency schedules, xPos, M-RoPE and axial
sections) and the checks of what a head width can carry.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from posgen.spec.expr import FREQUENCY_NAMES, ExprError, Parsed, parse_expr
from posgen.spec.expr_values import expression_value
from posgen.spec.model.base import (
    BASE_WHY,
    MAX_BASE,
    SpecModel,
    cross_field_error,
    expression_error,
)

MAX_SCALING_FACTOR = float(1 << 20)
"""Largest context-extension factor: published factors are 2 to 64 (LongRoPE 128)."""
MAX_CONTEXT = 1 << 24
"""Largest original context length (published: 2,048 to 131,072)."""

_FACTOR_WHY = (
    f"context-extension factor, in [1, {MAX_SCALING_FACTOR:,.0f}]: positions (or the longest "
    "wavelengths) are stretched this many times; a factor below 1 shrinks the context and "
    "a factor of 0 or less has no meaning"
)
_ORIGINAL_MAX_WHY = (
    f"context length the model was trained with, in [2, {MAX_CONTEXT}] (Hugging Face's "
    "original_max_position_embeddings, or max_position_embeddings for dynamic NTK)"
)
_ATTENTION_FACTOR_WHY = (
    "multiplies cos and sin, so the logits scale by its square (an attention temperature); "
    "in (0, 10]; omitted: the method's own default"
)


class RotaryDims(SpecModel):
    """Which features rotate.

    ``leading``: the first round(fraction · head_dim) features rotate with frequencies
    base^(-2k / rotary_dim) (GPT-NeoX rotary_pct, Phi partial_rotary_factor).
    ``proportional``: p-RoPE (Barbero et al. 2024, arXiv:2410.06205; Gemma's proportional
    layout): the pairs span the whole head with frequencies base^(-2k / head_dim), and only
    the round(fraction · head_dim / 2) highest ones are kept; the lowest are set to 0.
    """

    fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="rotated share of each head, in (0, 1] (GPT-NeoX 0.25); 'leading': "
        "fraction x head_dim must round to an even number of features",
    )
    layout: Literal["leading", "proportional"] = "leading"


class StandardFrequencies(SpecModel):
    """theta_k = base^(-2k / d) (Su et al. 2021)."""

    kind: Literal["standard"] = "standard"


class LinearFrequencies(SpecModel):
    """Position Interpolation (Chen et al. 2023, arXiv:2306.15595): theta_k / factor."""

    kind: Literal["linear"]
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)


class NtkFrequencies(SpecModel):
    """NTK-aware scaling (bloc97, 2023): base · factor^(d / (d - 2)) in place of base."""

    kind: Literal["ntk"]
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)


class DynamicNtkFrequencies(SpecModel):
    """Dynamic NTK (emozilla 2023; Hugging Face rope_type 'dynamic').

    For a call whose largest position is L - 1, with s = max(L, original_max):
    base' = base · (factor · s / original_max - (factor - 1))^(d / (d - 2)). Stateless:
    it depends on this call's positions alone, and base' >= base.
    """

    kind: Literal["dynamic_ntk"]
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)
    original_max_positions: int = Field(ge=2, le=MAX_CONTEXT, description=_ORIGINAL_MAX_WHY)


class YarnFrequencies(SpecModel):
    """YaRN (Peng et al. 2023, arXiv:2309.00071), as Hugging Face's rope_type 'yarn'.

    Pair k keeps theta_k where it turns more than beta_fast times over original_max
    positions, takes theta_k / factor where it turns fewer than beta_slow times, and a
    linear ramp between. cos and sin are multiplied by the attention factor, by default
    0.1 ln(factor) + 1 (or the ratio of mscale and mscale_all_dim terms when both are set).
    """

    kind: Literal["yarn"]
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)
    original_max_positions: int = Field(ge=2, le=MAX_CONTEXT, description=_ORIGINAL_MAX_WHY)
    beta_fast: float = Field(
        32.0,
        ge=1e-3,
        le=1e4,
        description="rotations above which a pair is not interpolated, in [0.001, 10^4] "
        "(paper: 32)",
    )
    beta_slow: float = Field(
        1.0,
        ge=1e-3,
        le=1e4,
        description="rotations below which a pair is fully interpolated, in [0.001, 10^4], "
        "below beta_fast (paper: 1; a subnormal one made the ramp's bound infinite)",
    )
    attention_factor: float | None = Field(None, gt=0, le=10, description=_ATTENTION_FACTOR_WHY)
    mscale: float | None = Field(
        None, ge=0, le=100, description="DeepSeek-style mscale, in [0, 100]"
    )
    mscale_all_dim: float | None = Field(
        None, ge=0, le=100, description="DeepSeek-style mscale_all_dim, in [0, 100]"
    )
    truncate: bool = Field(
        True,
        description="round the ramp's ends to whole pairs (Hugging "
        "Face's default; gpt-oss sets false)",
    )

    @model_validator(mode="after")
    def _betas_ordered(self) -> YarnFrequencies:
        if self.beta_fast <= self.beta_slow:
            raise cross_field_error(
                "beta_fast",
                f"beta_fast must be greater than beta_slow (got {self.beta_fast:g} <= "
                f"{self.beta_slow:g}): pairs that turn fast keep their frequency",
            )
        return self


class Llama3Frequencies(SpecModel):
    """Llama 3.1 scaling (Meta 2024; Hugging Face rope_type 'llama3').

    Wavelengths longer than original_max / low_freq_factor are divided by factor, those
    shorter than original_max / high_freq_factor are kept, and between them the frequency
    is interpolated smoothly: (1 - s) theta / factor + s theta with
    s = (original_max / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    Equal factors leave no band between: one cut at original_max (Llama 4 Scout).
    """

    kind: Literal["llama3"]
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)
    low_freq_factor: float = Field(gt=0, le=1e4, description="in (0, 10^4] (Llama 3.1: 1)")
    high_freq_factor: float = Field(
        gt=0,
        le=1e4,
        description="in (0, 10^4], at least low_freq_factor (Llama 3.1: 4; equal: one cut)",
    )
    original_max_positions: int = Field(ge=2, le=MAX_CONTEXT, description=_ORIGINAL_MAX_WHY)

    @model_validator(mode="after")
    def _factors_ordered(self) -> Llama3Frequencies:
        if self.high_freq_factor < self.low_freq_factor:
            raise cross_field_error(
                "high_freq_factor",
                f"high_freq_factor must be at least low_freq_factor (got "
                f"{self.high_freq_factor:g} < {self.low_freq_factor:g})",
            )
        return self


MAX_LONGROPE_PAIRS = 4096
"""Longest LongRoPE factor list (one per rotated pair; published heads have 32 to 64)."""


# a pair's LongRoPE factor (published: 1 to about 60); one of 1e-309 made theta / f
# infinite, so the module gave NaN
_PairFactor = Annotated[float, Field(ge=1e-3, le=1e6)]


class LongRopeFrequencies(SpecModel):
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753), as Hugging Face's rope_type 'longrope'.

    theta_k / f_k with f = short_factor while the call's largest position is below
    original_max, else long_factor. cos and sin are multiplied by the attention factor,
    by default sqrt(1 + ln(factor) / ln(original_max)) (1 when factor <= 1), where factor
    is the extended context over original_max (Phi-3: max_position_embeddings /
    original_max_position_embeddings).
    """

    kind: Literal["longrope"]
    short_factor: list[_PairFactor] = Field(
        min_length=1,
        max_length=MAX_LONGROPE_PAIRS,
        description="per-pair rescale factors, in [0.001, 10^6], one per rotated pair",
    )
    long_factor: list[_PairFactor] = Field(
        min_length=1,
        max_length=MAX_LONGROPE_PAIRS,
        description="per-pair rescale factors past original_max, one per rotated pair, each "
        "in [0.001, 10^6]",
    )
    original_max_positions: int = Field(ge=2, le=MAX_CONTEXT, description=_ORIGINAL_MAX_WHY)
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)
    attention_factor: float | None = Field(None, gt=0, le=10, description=_ATTENTION_FACTOR_WHY)

    @model_validator(mode="after")
    def _lists_match(self) -> LongRopeFrequencies:
        if len(self.short_factor) != len(self.long_factor):
            raise cross_field_error(
                "long_factor",
                f"short_factor and long_factor need one factor per rotated pair each (got "
                f"{len(self.short_factor)} and {len(self.long_factor)})",
            )
        return self


class ExprFrequencies(SpecModel):
    """A frequency schedule written as an expression of k, d and base (posgen/spec/expr.py).

    ``k`` is the pair index 0 .. d/2 - 1, ``d`` the rotated features, ``base`` the
    rotation's base; the standard schedule is ``base ** (-2 * k / d)``. Checked against
    the expression whitelist; the module refuses a schedule that is not finite.
    """

    kind: Literal["expr"]
    expr: str = Field(
        description="theta_k as an expression of k, d and base, e.g. 'base ** (-2 * k / d)'; "
        "at most 500 characters, the functions and operators of the bias expressions"
    )

    @model_validator(mode="after")
    def _parse(self) -> ExprFrequencies:
        try:
            parsed = parse_expr(self.expr, {}, FREQUENCY_NAMES)
        except ExprError as error:
            raise expression_error(error) from None
        if "k" not in parsed.reads:
            raise PydanticCustomError(
                "expr",
                "a frequency schedule must depend on the pair index k (at character "
                "{character} of the expression)",
                {"character": 1, "offset": 0},
            )
        return self

    def parsed(self) -> Parsed:
        """The checked expression (validated already, so this cannot fail)."""
        return parse_expr(self.expr, {}, FREQUENCY_NAMES)

    def values(self, rotary_dim: int, base: float) -> list[float]:
        """theta_k for k = 0 .. rotary_dim / 2 - 1, in float64 Python floats."""
        tree = self.parsed().tree
        names = {"d": float(rotary_dim), "base": base}
        return [
            expression_value(tree, {**names, "k": float(k)}, {}) for k in range(rotary_dim // 2)
        ]


Frequencies = Annotated[
    StandardFrequencies
    | LinearFrequencies
    | NtkFrequencies
    | DynamicNtkFrequencies
    | YarnFrequencies
    | Llama3Frequencies
    | LongRopeFrequencies
    | ExprFrequencies,
    Field(discriminator="kind"),
]


MIN_XPOS_SCALE_BASE = 1.0
"""The smallest xPos scale_base: the factors of pair 0, (1.4 / 0.4)^(offset / scale_base),
stay finite for offsets up to about 51 x scale_base (the module's XPOS_MAX_EXPONENT, 64,
over ln 3.5), so below 1 a module would refuse calls of more than about 100 positions."""


class XposScale(SpecModel):
    """xPos (Sun et al. 2023, A Length-Extrapolatable Transformer, arXiv:2212.10554).

    Pair k of the query at position n is scaled by zeta_k^(n / scale_base) and of the key by
    zeta_k^(-n / scale_base), zeta_k = (2k + 0.4 d) / (1.4 d), so the logit of (i, j) decays
    as zeta_k^((i - j) / scale_base). Computed relative to the middle of the keys' positions
    (as x-transformers does), which cancels in the product and keeps the factors finite.
    """

    kind: Literal["xpos"]
    scale_base: float = Field(
        512.0,
        ge=MIN_XPOS_SCALE_BASE,
        le=1e8,
        description="positions over which the decay factor applies once, in [1, 10^8] "
        "(paper: 512); a module reaches about 51 x scale_base positions from the middle of a "
        "call's keys before the factors overflow",
    )


class MultimodalSections(SpecModel):
    """M-RoPE (Wang et al. 2024, Qwen2-VL, arXiv:2409.12191): positions [n, batch, N].

    Section a holds sections[a] of the rotated pairs, and pair k of section a turns by
    positions[a] · theta_k. ``consecutive`` sections are runs of pairs in axis order
    (temporal, height, width), as Hugging Face's apply_multimodal_rotary_pos_emb;
    ``interleaved`` ones (Qwen3-VL, Bai et al. 2025, arXiv:2511.21631) deal the pairs out
    in turn: axis a >= 1 takes the first sections[a] pairs k with k mod n = a, and axis 0
    every other pair, as Hugging Face's apply_interleaved_mrope, so that each axis spans
    the whole frequency range. With 2 sections it is a 2-D rotary embedding over
    (row, column) positions [2, batch, N].
    """

    kind: Literal["sections"]
    sections: list[Annotated[int, Field(ge=1, le=1 << 16)]] = Field(
        min_length=2,
        max_length=4,
        description="rotated pairs per position axis (Qwen2-VL: [16, 24, 24]); they must sum "
        "to rotary_dim / 2",
    )
    layout: Literal["consecutive", "interleaved"] = Field(
        "consecutive",
        description="consecutive: each section a run of pairs, in axis order (Qwen2-VL, "
        "Qwen2.5-VL); interleaved: pair k on axis k mod n while that axis has pairs left, "
        "else on axis 0 (Qwen3-VL)",
    )


class AxialAxes(SpecModel):
    """Axial RoPE (Heo et al. 2024, Rotary Position Embedding for Vision Transformer,
    arXiv:2403.13298): the rotated pairs split evenly among ``count`` position axes (row,
    column, ...), each axis with the whole schedule over its own share of the features,
    theta_t = base^(-2t / (d_rot / count)); positions [count, batch, N].
    """

    kind: Literal["axial"]
    count: int = Field(2, ge=2, le=4, description="position axes, 2 to 4 (images: 2)")


Axes = Annotated[MultimodalSections | AxialAxes, Field(discriminator="kind")]


class Rotation(SpecModel):
    """Rotary position embedding (Su et al. 2021, RoFormer, arXiv:2104.09864).

    Each feature pair (a, b) of q and k is rotated by the angle position · theta_k.
    ``half`` pairs feature k with k + d/2 (GPT-NeoX, HF Llama); ``interleaved`` pairs
    2k with 2k+1 (GPT-J, Meta's original LLaMA). ``frequencies`` picks the schedule
    theta_k (standard, or a context-extension method), ``position_scale`` an optional
    per-position scale (xPos), ``axes`` rotary over several position axes (M-RoPE).
    """

    base: float = Field(gt=1, le=MAX_BASE, description=BASE_WHY)
    pairing: Literal["half", "interleaved"]
    rotary_dims: RotaryDims = RotaryDims()
    frequencies: Frequencies = StandardFrequencies()
    position_scale: XposScale | None = None
    axes: Axes | None = None

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (so the logits scale by its square): 1 for most kinds."""
        return attention_factor_of(self.frequencies)


def attention_factor_of(frequencies: Frequencies) -> float:
    """The factor on cos and sin: the spec's, or the method's default (1 for most).

    YaRN (Peng et al. 2023): 0.1 ln(s) + 1, or with DeepSeek's mscale and mscale_all_dim
    the ratio (0.1 mscale ln(s) + 1) / (0.1 mscale_all_dim ln(s) + 1); 1 for s <= 1.
    LongRoPE (Ding et al. 2024): sqrt(1 + ln(s) / ln(original_max)), 1 for s <= 1.
    """
    if isinstance(frequencies, YarnFrequencies):
        if frequencies.attention_factor is not None:
            return float(frequencies.attention_factor)
        factor = frequencies.factor
        if frequencies.mscale and frequencies.mscale_all_dim:
            return _yarn_mscale(factor, frequencies.mscale) / _yarn_mscale(
                factor, frequencies.mscale_all_dim
            )
        return _yarn_mscale(factor, 1.0)
    if isinstance(frequencies, LongRopeFrequencies):
        if frequencies.attention_factor is not None:
            return float(frequencies.attention_factor)
        if frequencies.factor <= 1:
            return 1.0
        return math.sqrt(
            1 + math.log(frequencies.factor) / math.log(frequencies.original_max_positions)
        )
    return 1.0


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RotateTerm(SpecModel):
    """content_content: rotate q and k by their positions before the product."""

    rotate: Rotation

    @property
    def form(self) -> str:
        return "rotate"


def rotary_dim_for(head_dim: int, fraction: float) -> int:
    """Number of rotated features: fraction · head_dim, rounded to the nearest integer."""
    return int(round(head_dim * fraction))


def rotated_features(rotation: Rotation, head_dim: int) -> int:
    """Features the rotation pairs: round(fraction · head_dim) for the leading layout, the
    whole head for the proportional one (p-RoPE, whose lowest frequencies are 0)."""
    if rotation.rotary_dims.layout == "proportional":
        return head_dim
    return rotary_dim_for(head_dim, rotation.rotary_dims.fraction)


def turning_pairs(rotation: Rotation, head_dim: int) -> int:
    """Pairs with a non-zero frequency: all rotated pairs, or p-RoPE's kept
    round(fraction · head_dim / 2)."""
    if rotation.rotary_dims.layout == "proportional":
        return int(round(head_dim * rotation.rotary_dims.fraction / 2))
    return rotated_features(rotation, head_dim) // 2


def interleaved_shortfall(sections: list[int]) -> str | None:
    """Why interleaved ``sections`` cannot be dealt out over their sum of pairs, or None.

    Axis a >= 1 of n takes pairs a, a + n, ..., a + n (sections[a] - 1): the last must be
    below the pair count (Hugging Face's apply_interleaved_mrope fills axis a from the
    slice a : n * sections[a] : n, which is shorter otherwise).
    """
    pairs, count = sum(sections), len(sections)
    for axis, size in enumerate(sections[1:], start=1):
        last = axis + count * (size - 1)
        if last >= pairs:
            most = (pairs - 1 - axis) // count + 1
            return (
                f"interleaved sections deal axis {axis} one pair in {count} from pair "
                f"{axis}: its {size} pairs would end at pair {last}, past the {pairs} rotated "
                f"pairs (at most {most} fit; axis 0 takes the pairs left over)"
            )
    return None


def rotation_problem(rotation: Rotation, head_dim: int) -> tuple[str, str] | None:
    """(field, message) for a rotation that head_dim cannot carry, else None.

    The generated module repeats these checks when its head_dim is overridden.
    """
    dims = rotation.rotary_dims
    rotary_dim = rotated_features(rotation, head_dim)
    if dims.layout == "leading":
        if rotary_dim < 2 or rotary_dim % 2:
            return "rotary_dims.fraction", (
                f"fraction × head_dim must round to an even number ≥ 2 of rotated "
                f"features (head_dim {head_dim} gives {rotary_dim})"
            )
    else:
        if head_dim % 2:
            return "rotary_dims.layout", (
                f"the proportional layout pairs the whole head: head_dim must be even "
                f"(got {head_dim})"
            )
        if turning_pairs(rotation, head_dim) < 1:
            return "rotary_dims.fraction", (
                f"fraction × head_dim / 2 must keep at least one pair (head_dim {head_dim})"
            )
    pairs = rotary_dim // 2
    frequencies = rotation.frequencies
    if isinstance(frequencies, (NtkFrequencies, DynamicNtkFrequencies)) and rotary_dim < 4:
        return "frequencies.kind", (
            f"NTK scaling raises the base to d / (d - 2): it needs at least 4 rotated "
            f"features (got {rotary_dim})"
        )
    if isinstance(frequencies, LongRopeFrequencies) and len(frequencies.short_factor) != pairs:
        return "frequencies.short_factor", (
            f"LongRoPE needs one factor per rotated pair: {pairs} for {rotary_dim} rotated "
            f"features (got {len(frequencies.short_factor)})"
        )
    if isinstance(rotation.axes, AxialAxes) and rotary_dim % (2 * rotation.axes.count):
        return "axes.count", (
            f"axial RoPE gives each of {rotation.axes.count} axes an even share of the "
            f"{rotary_dim} rotated features: {rotary_dim} is not a multiple of "
            f"{2 * rotation.axes.count}"
        )
    if isinstance(rotation.axes, MultimodalSections):
        if sum(rotation.axes.sections) != pairs:
            return "axes.sections", (
                f"sections must sum to the {pairs} rotated pairs (rotary_dim {rotary_dim} / "
                f"2); got {sum(rotation.axes.sections)}"
            )
        if rotation.axes.layout == "interleaved":
            short = interleaved_shortfall(rotation.axes.sections)
            if short is not None:
                return "axes.sections", short
    if rotation.axes is not None and dims.layout == "proportional":
        return "axes", (
            "the proportional layout (p-RoPE) spans the whole head with one schedule; "
            "position axes split the pairs: use one or the other"
        )
    if rotation.axes is not None and rotation.position_scale is not None:
        return "position_scale", (
            "xPos scales by a single position; M-RoPE and axial RoPE have one per axis: use "
            "one or the other"
        )
    if isinstance(frequencies, ExprFrequencies):
        return _frequency_expression_problem(frequencies, rotary_dim, rotation.base)
    return None


def _frequency_expression_problem(
    frequencies: ExprFrequencies, rotary_dim: int, base: float
) -> tuple[str, str] | None:
    """The first pair k whose frequency is NaN or infinite in float64 (as the module
    computes it) for these rotated features, as (field, message); None where all are
    finite. The module refuses such a schedule when it is built."""
    for k, value in enumerate(frequencies.values(rotary_dim, base)):
        if not math.isfinite(value):
            return "frequencies.expr", (
                f"the frequency is {value} at pair k = {k} (d = {rotary_dim}, base "
                f"{base:g}): every pair's angle must be a finite number"
            )
    return None
