"""The spec language: a strict pydantic mirror of ``specs/*.yaml``.

A spec states one row of the score-decomposition table (DESIGN.md §1). With absolute
positions added to the input, the logit between query i and key j is

    a_ij = x_i Wq Wkᵀ x_jᵀ  (content_content)  + x_i Wq Wkᵀ p_jᵀ (content_position)
         + p_i Wq Wkᵀ x_jᵀ  (position_content) + p_i Wq Wkᵀ p_jᵀ (position_position)

and each encoding keeps, drops, replaces or biases each term. Every convention on which
published implementations disagree (rotation pairing, sign of the relative position,
bucket recipe, slope recipe, where the 1/√d scale applies) is a required field.

Models are frozen, reject unknown keys (with the closest valid name), and never coerce a
string into a number. Forms written as a single-key mapping (``{rotate: ...}``,
``{bias: ...}``) or a bare keyword (``keep``, ``drop``) are tagged unions on that key.

Every number is bounded so that a generated module stays finite and its tables fit in
memory; each field's description says why (``posgen schema`` shows them). Free text is
one line of printable characters: no control characters, no bidirectional overrides, no
invisible characters.
"""

from __future__ import annotations

import builtins
import keyword
import math
import re
import sys
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from posgen.spec.diagnostics import closest_name, quoted
from posgen.spec.expr import (
    FREQUENCY_NAMES,
    PARAM_NAME,
    RESERVED_PARAM_NAMES,
    ExprError,
    ParamInfo,
    Parsed,
    parse_expr,
)
from posgen.spec.names import reserved_name_problem

MODULE_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")  # fullmatch
# Names a generated module must not take: copied beside other code, it would shadow them.
RESERVED_MODULE_NAMES = frozenset(sys.stdlib_module_names) | {"torch", "posgen", "generated"}


def spec_name_problem(name: str) -> str | None:
    """Why ``name`` fails the ``name`` field's own rule (``Spec.name``: its length,
    pattern and reserved names), or None. A keyword or builtin name, which the model
    checks across fields, passes here and is caught when a whole spec is validated."""
    try:
        Spec.model_validate({"name": name})
    except ValidationError as error:
        problems = [item["msg"] for item in error.errors() if item["loc"] == ("name",)]
        return problems[0] if problems else None
    return None


MAX_TABLE_ROWS = 1 << 21
# Every trained table (and projection of one) a spec's defaults create holds at most this
# many floats (512 MiB in float32), whatever its rows and width: a module's memory is
# bounded by its spec.
MAX_TABLE_ELEMENTS = 1 << 27
# An ODE trajectory is integrated step by step (Python loop): a tighter horizon bound.
MAX_ODE_POSITIONS = 1 << 16
"""Rows of a trained position table (2,097,152): each row is model_dim floats."""
MAX_BASE = 1e9
"""Largest sinusoid or rotary base: published bases reach 10^7 (Qwen2.5-1M's rope_theta)."""
MAX_INIT_STD = 10.0
"""Largest initialisation std (published encodings use 0.02 to 1; 1e300 makes inf)."""
MAX_GRID_KERNEL = 63
"""Largest k of a k x k grid_2d convolution (k^2 weights per feature; CPVT uses 3)."""
MAX_EXPR_INIT = 1e4
"""Largest magnitude of an expression parameter's init and bounds."""
MIN_EPS = 1e-12
"""Smallest normalisation eps (BERT's): smaller ones vanish in float32, 0/0 gives NaN."""

_INIT_STD_WHY = (
    f"std of the normal initialisation, in (0, {MAX_INIT_STD:g}] (published: 0.02 to 1): "
    "1e300 makes the parameters inf, and large values push the logits past half precision"
)
_BASE_WHY = (
    f"base of the frequencies base^(-2k/d), in (1, {MAX_BASE:g}]: published bases are "
    "10,000 to 10^7; a base of 1 or less gives no decreasing frequencies"
)
_EPS_WHY = (
    f"added to the variance, in [{MIN_EPS:g}, 0.1]: a smaller eps vanishes in float32 and "
    "a constant row gives 0/0 = NaN; larger ones flatten the normalisation"
)


def _init_std(default: float) -> Any:
    """The ``init_std`` field every trained parameter has: bounded, documented."""
    return Field(default, gt=0, le=MAX_INIT_STD, description=_INIT_STD_WHY)


class SpecModel(BaseModel):
    """Base of every spec model: frozen, strict, unknown keys rejected with a hint."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = {info.alias or name for name, info in cls.model_fields.items()}
            for key in data:
                if key not in allowed:
                    hint = closest_name(str(key), allowed)
                    suggestion = f" (did you mean {hint!r}?)" if hint else ""
                    raise PydanticCustomError(
                        "unknown_field",
                        "unknown field {shown}{suggestion}; allowed: {allowed}",
                        {
                            "key": str(key),
                            "shown": quoted(str(key)),
                            "suggestion": suggestion,
                            "allowed": ", ".join(sorted(allowed)),
                        },
                    )
        return data


def cross_field_error(at: str, message: str) -> PydanticCustomError:
    """An error about a combination of fields, reported at the sub-field ``at``."""
    return PydanticCustomError("cross_field", "{message}", {"message": message, "at": at})


def _tagged(*tags: str, what: str, leading: tuple[str, str] | None = None) -> Discriminator:
    """Discriminate a term written as a bare keyword or as a single-key mapping.

    ``leading = (key, tag)`` names a form whose mapping may carry more keys: any mapping
    that holds ``key`` is that form (its model then rejects keys it does not know). Its
    tag differs from the key so that error locations keep the key as a data path.
    """
    allowed = set(tags)
    lead_key, lead_tag = leading if leading is not None else (None, None)

    def tag_of(value: Any) -> str | None:
        if isinstance(value, str):
            return value if value in allowed else None
        if isinstance(value, dict) and lead_key is not None and lead_key in value:
            return lead_tag
        if isinstance(value, dict) and len(value) == 1:
            key = next(iter(value))
            return key if key in allowed else None
        if isinstance(value, BaseModel):  # a built term (validated again, or serialised)
            form = getattr(value, "form", None)
            return lead_tag if form is not None and form == lead_key else form
        return None

    listing = ", ".join(sorted(allowed | ({lead_key} if lead_key else set())))
    return Discriminator(
        tag_of,
        custom_error_type="invalid_form",
        custom_error_message=f"{what} must be one of: {listing} (a keyword, or a mapping "
        "with that single key)",
        custom_error_context={"allowed": listing},
    )


# --------------------------------------------------------------------------- text fields

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


# --------------------------------------------------------------------------- scale


class Scale(SpecModel):
    """Logit scale: ``none`` (T5) or 1/sqrt(factor · head_dim) (Vaswani et al. 2017)."""

    kind: Literal["none", "inv_sqrt_head_dim"]
    factor: float = Field(
        1.0,
        ge=1e-3,
        le=1e3,
        description="the scale is 1/sqrt(factor * head_dim), factor in [0.001, 1000] "
        "(DeBERTa 3, TUPE 2): 1e-308 makes the logits overflow to NaN, 1e308 makes the scale "
        "0 so that attention ignores the content",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_keyword(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _factor_needs_a_scale(self) -> Scale:
        if self.kind == "none" and "factor" in self.model_fields_set:
            raise cross_field_error(
                "factor",
                "scale 'none' leaves the logits unscaled, so a factor has no effect: remove "
                "it or use kind 'inv_sqrt_head_dim'",
            )
        return self


# --------------------------------------------------------------------------- input tables


class LearnedTable(SpecModel):
    """A trained [max_positions, model_dim] table (GPT-2 ``wpe``, BERT position ids).

    Initialised from N(init_mean, init_std²): mean 0 for a table that is added, mean 1
    for one that multiplies (so that x ⊙ p starts near x rather than near 0).
    """

    kind: Literal["learned"]
    max_positions: int = Field(
        ge=1,
        le=MAX_TABLE_ROWS,
        description=f"rows of the table, 1 to {MAX_TABLE_ROWS:,} (2^21): the table holds "
        "max_positions x model_dim trained floats (GPT-2 1024, BERT 512)",
    )
    init_std: float = _init_std(0.02)
    init_mean: float = Field(
        0.0,
        ge=-10,
        le=10,
        description="mean of the normal initialisation, in [-10, 10]: 0 for a table that "
        "is added, 1 for one that multiplies; far larger means push x * p past half precision",
    )


class SinusoidalTable(SpecModel):
    """Fixed sinusoids (Vaswani et al. 2017, arXiv:1706.03762).

    ``interleaved``: PE(p, 2i) = sin(p·base^(-2i/d)), PE(p, 2i+1) = cos(p·base^(-2i/d)).
    ``split``: the sines fill the first half of the features and the cosines the second
    (the tensor2tensor layout).
    """

    kind: Literal["sinusoidal"]
    base: float = Field(gt=1, le=MAX_BASE, description=_BASE_WHY)
    layout: Literal["interleaved", "split"]


class HierarchicalTable(SpecModel):
    """Hierarchically decomposed positions (Su 2020, kexue.fm/archives/7947).

    A trained table u of n = ``base_positions`` rows serves n² positions: position
    i·n + j (0 ≤ i, j < n) is q = alpha·u_i + (1 − alpha)·u_j. alpha ≠ 0.5 keeps
    positions i·n + j and j·n + i apart; positions ≥ n² raise.
    """

    kind: Literal["hierarchical"]
    base_positions: int = Field(
        ge=2,
        le=MAX_TABLE_ROWS,
        description=f"rows n of the trained table u, 2 to {MAX_TABLE_ROWS:,} (2^21), serving "
        "n^2 positions; each row is model_dim floats",
    )
    alpha: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="weight of u_i in q = alpha u_i + (1 - alpha) u_j, in (0, 1), not 0.5",
    )
    init_std: float = _init_std(0.02)

    @model_validator(mode="after")
    def _check_alpha(self) -> HierarchicalTable:
        if self.alpha == 0.5:
            raise cross_field_error(
                "alpha",
                "alpha = 0.5 makes position i*n + j equal to position j*n + i "
                "(q = (u_i + u_j) / 2 is symmetric); choose alpha in (0, 1) other than 0.5",
            )
        return self


class DepthwiseConvTable(SpecModel):
    """Positions generated from the tokens by a depthwise convolution (Chu et al. 2021,
    CPVT's position encoding generator, arXiv:2102.10882): p = DWConv(x), one kernel per
    feature, zero padding at the sequence edges (the only source of absolute position).

    ``same``: (k − 1)/2 zeros on each side, output i sees inputs i − (k−1)/2 … i + (k−1)/2
    (CPVT's PEG; k odd ≥ 3). ``causal``: k − 1 zeros on the left, output i sees inputs
    i − k + 1 … i only, so it can sit in a decoder (k ≥ 2). The kernel is a
    cross-correlation, as PyTorch's Conv1d: out_i = b + Σ_t w_t · x_(i + t − left).

    ``layout: grid_2d`` is CPVT's own form: the tokens are an H × W grid in row-major
    order (token r·W + c), given to ``embed`` as ``grid=(H, W)``, and the convolution is
    k × k with (k − 1)/2 zeros on every side.
    """

    kind: Literal["depthwise_conv"]
    kernel_size: int = Field(
        ge=2,
        le=1024,
        description="kernel width k, 2 to 1024 (CPVT 3, wav2vec 2.0 128; grid_2d: at most "
        "63, a k x k kernel): one kernel of k (grid_2d: k^2) floats per feature",
    )
    padding: Literal["same", "causal"]
    bias: bool = True
    layout: Literal["sequence", "grid_2d"] = "sequence"

    @model_validator(mode="after")
    def _check_kernel(self) -> DepthwiseConvTable:
        if self.layout == "grid_2d" and self.padding != "same":
            raise cross_field_error(
                "padding",
                "a 2-D grid has no causal order: grid_2d needs 'same' padding (CPVT's "
                "(k - 1)/2 zeros on every side)",
            )
        if self.layout == "grid_2d" and self.kernel_size > MAX_GRID_KERNEL:
            raise cross_field_error(
                "kernel_size",
                f"a grid_2d kernel has kernel_size^2 weights per feature: kernel_size is at "
                f"most {MAX_GRID_KERNEL} there (got {self.kernel_size})",
            )
        if self.padding == "same" and (self.kernel_size % 2 == 0 or self.kernel_size < 3):
            raise cross_field_error(
                "kernel_size",
                f"'same' padding centres the kernel on each token, so kernel_size must be "
                f"odd and at least 3 (got {self.kernel_size})",
            )
        return self


class OdeTable(SpecModel):
    """Positions from a learned continuous dynamical system (Liu et al. 2020, FLOATER,
    arXiv:2003.09229): p(t) solves dp/dt = h(p, t), p(0) = p_0, and position i gets
    p(i · position_step).

    h(p, t) = W_out [σ(W_in [p; t] + b_in); t] + b_out: a one-hidden-layer network with
    the time appended to the input of both layers (the authors' ``flow_func_linear``).
    The ODE is integrated with ``steps_per_position`` fixed steps of size
    position_step / steps_per_position by ``euler`` (first order) or ``rk4`` (classic
    fourth-order Runge-Kutta). ``initial``: p_0 is a trained vector (``learned``) or 0.
    ``max_positions`` is the integration horizon, required: integrating to position i
    takes i · steps_per_position steps (4 evaluations of h each with rk4) and keeps i
    states, so a caller-supplied position must have a bound; positions past it raise
    ValueError naming the bound.
    """

    kind: Literal["ode"]
    hidden: int = Field(
        ge=1,
        le=1 << 16,
        description="width of h's hidden layer, 1 to 65,536: h holds about "
        "2 x hidden x (model_dim + 1) trained floats",
    )
    activation: Literal["relu", "tanh", "gelu", "sigmoid"]
    integrator: Literal["euler", "rk4"]
    position_step: float = Field(
        gt=0,
        le=100,
        description="time between positions, in (0, 100] (FLOATER 0.1): the time enters h "
        "linearly, so p grows with it; larger steps overflow long before the horizon",
    )
    steps_per_position: int = Field(
        ge=1,
        le=1024,
        description="integration steps per position, 1 to 1024 (work per position)",
    )
    initial: Literal["learned", "zero"]
    max_positions: int = Field(
        ge=1,
        le=MAX_ODE_POSITIONS,
        description=f"integration horizon, required, 1 to {MAX_ODE_POSITIONS:,} (2^16): "
        "integrating to position i takes i x steps_per_position steps and keeps i x "
        "model_dim floats (and, with autograd, every intermediate state), so the cost of "
        "any position the caller passes is bounded by this",
    )
    init_std: float = _init_std(0.02)


AbsoluteTable = Annotated[
    LearnedTable | SinusoidalTable | HierarchicalTable | DepthwiseConvTable | OdeTable,
    Field(discriminator="kind"),
]


class TableInput(SpecModel):
    """Input-level positions, combined with the token embeddings x feature by feature.

    ``add``: x + p (Vaswani et al. 2017; GPT-2, BERT). ``multiply``: x ⊙ p, each feature
    of x scaled by the position's table entry; a learned table then acts as a per-position
    gain (initialise it around 1 with ``init_mean: 1``), and a sinusoidal table modulates
    x by sin/cos waves: at position 0 every sine feature is 0, so x ⊙ p zeroes those
    features there (half of them) while the cosine features pass x unchanged.
    """

    kind: Literal["add", "multiply"]
    table: AbsoluteTable

    @model_validator(mode="after")
    def _multiply_needs_a_gain_table(self) -> TableInput:
        if self.kind == "multiply" and self.table.kind not in ("learned", "sinusoidal"):
            raise cross_field_error(
                "kind",
                f"a {self.table.kind!r} table starts near zero or reads the content itself, "
                "so x * p would erase the tokens: 'multiply' takes a 'learned' table "
                "(init_mean 1) or a 'sinusoidal' one; use 'add' here",
            )
        return self


class ComplexOrderInput(SpecModel):
    """Complex word-order embeddings (Wang et al. 2020, arXiv:1912.12333, eq. 3).

    Each feature d of the token at position pos is r_d · exp(i(ω_d · pos + θ_d)) with
    a per-token amplitude r (the caller's token embedding), frequency ω and phase θ.
    The module cannot own a vocabulary, so ω and θ come from the caller per token, or,
    with ``module_parameters: learned_per_feature``, from the module's own per-feature
    ω [model_dim] (initialised to frequency_base^(−d / model_dim)) and θ (zeros),
    used whenever the caller passes none.
    """

    kind: Literal["complex_order"]
    module_parameters: Literal["learned_per_feature", "none"]
    frequency_base: float | None = Field(
        None,
        gt=1,
        le=MAX_BASE,
        description=f"initial omega_d = frequency_base^(-d / model_dim), in (1, {MAX_BASE:g}]: "
        "a base of 1 or less gives no decreasing frequencies",
    )

    @model_validator(mode="after")
    def _check_frequency_base(self) -> ComplexOrderInput:
        learned = self.module_parameters == "learned_per_feature"
        if learned and self.frequency_base is None:
            raise cross_field_error(
                "frequency_base",
                "learned per-feature frequencies need frequency_base (their initial values "
                "are frequency_base^(-d / model_dim))",
            )
        if not learned and self.frequency_base is not None:
            raise cross_field_error(
                "frequency_base",
                "frequency_base initialises the module's own frequencies; with "
                "module_parameters: none there are none",
            )
        return self


InputForm = Annotated[TableInput | ComplexOrderInput, Field(discriminator="kind")]


# --------------------------------------------------------------------------- rotations

MAX_SCALING_FACTOR = float(1 << 20)
"""Largest context-extension factor: published factors are 2 to 64 (LongRoPE 128)."""
MAX_CONTEXT = 1 << 24
"""Largest original context length (published: 2,048 to 131,072)."""

_FACTOR_WHY = (
    f"context-extension factor, in [1, {MAX_SCALING_FACTOR:g}]: positions (or the longest "
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
        gt=0,
        le=1e4,
        description="rotations above which a pair is not interpolated, in (0, 10^4] (paper: 32)",
    )
    beta_slow: float = Field(
        1.0,
        gt=0,
        le=1e4,
        description="rotations below which a pair "
        "is fully interpolated, in (0, 10^4], below beta_fast (paper: 1)",
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
    """

    kind: Literal["llama3"]
    factor: float = Field(ge=1, le=MAX_SCALING_FACTOR, description=_FACTOR_WHY)
    low_freq_factor: float = Field(gt=0, le=1e4, description="in (0, 10^4] (Llama 3.1: 1)")
    high_freq_factor: float = Field(
        gt=0, le=1e4, description="in (0, 10^4], above low_freq_factor (Llama 3.1: 4)"
    )
    original_max_positions: int = Field(ge=2, le=MAX_CONTEXT, description=_ORIGINAL_MAX_WHY)

    @model_validator(mode="after")
    def _factors_ordered(self) -> Llama3Frequencies:
        if self.high_freq_factor <= self.low_freq_factor:
            raise cross_field_error(
                "high_freq_factor",
                f"high_freq_factor must be greater than low_freq_factor (got "
                f"{self.high_freq_factor:g} <= {self.low_freq_factor:g})",
            )
        return self


MAX_LONGROPE_PAIRS = 4096
"""Longest LongRoPE factor list (one per rotated pair; published heads have 32 to 64)."""


_PairFactor = Annotated[float, Field(gt=0, le=1e6)]


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
        description="per-pair rescale factors, in (0, 10^6], one per rotated pair",
    )
    long_factor: list[_PairFactor] = Field(
        min_length=1,
        max_length=MAX_LONGROPE_PAIRS,
        description="per-pair rescale factors past original_max, one per rotated pair, each "
        "in (0, 10^6]",
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
            raise PydanticCustomError(
                "expr",
                "{message} (at character {character} of the expression)",
                {"message": error.message, "character": error.offset + 1, "offset": error.offset},
            ) from None
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
        gt=0,
        le=1e8,
        description="positions over which the decay factor applies once, in (0, 10^8] (paper: 512)",
    )


class MultimodalSections(SpecModel):
    """M-RoPE (Wang et al. 2024, Qwen2-VL, arXiv:2409.12191): positions [3, batch, N].

    The rotated pairs are split into consecutive sections (temporal, height, width); pair k
    of section a turns by positions[a] · theta_k, as Hugging Face's
    apply_multimodal_rotary_pos_emb. With 2 sections it is a 2-D rotary embedding over
    (row, column) positions [2, batch, N].
    """

    kind: Literal["sections"]
    sections: list[Annotated[int, Field(ge=1, le=1 << 16)]] = Field(
        min_length=2,
        max_length=4,
        description="rotated pairs per position axis (Qwen2-VL: [16, 24, 24]); they must sum "
        "to rotary_dim / 2",
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

    base: float = Field(gt=1, le=MAX_BASE, description=_BASE_WHY)
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


# --------------------------------------------------------------------------- biases


class LogBuckets(SpecModel):
    """Relative positions mapped to log-spaced buckets (Raffel et al. 2020, T5).

    Within each direction (``bidirectional``: half the buckets for each sign), distances
    below max_exact = buckets_per_direction / 2 get their own bucket and larger ones share
    log-spaced buckets up to ``max_distance``, past which all share the last bucket.
    """

    kind: Literal["log_buckets"]
    recipe: Literal["t5"]
    buckets: int = Field(
        ge=2,
        le=4096,
        description="bucket count, 2 to 4096 (T5 32): the bias table holds buckets x heads floats",
    )
    max_distance: int = Field(
        ge=2,
        le=1 << 24,
        description="distance from which all share the last bucket, 2 to 16,777,216 (2^24; "
        "T5 128): only the bucket formula reads it, nothing is allocated per distance",
    )
    bidirectional: bool
    sign: Literal["key_minus_query", "query_minus_key"]

    @model_validator(mode="after")
    def _check_ranges(self) -> LogBuckets:
        if self.bidirectional and self.buckets % 2:
            raise cross_field_error(
                "buckets",
                f"bidirectional buckets are split evenly between the two directions, so "
                f"the count must be even (got {self.buckets})",
            )
        if not self.bidirectional and self.sign != "key_minus_query":
            raise cross_field_error(
                "sign",
                "one-sided buckets tell apart past keys only (n = max(i - j, 0), the T5 "
                "decoder recipe); with sign 'query_minus_key' every visible key would share "
                "bucket 0: use 'key_minus_query'",
            )
        per_direction = self.buckets // 2 if self.bidirectional else self.buckets
        max_exact = per_direction // 2
        if max_exact < 1:
            raise cross_field_error(
                "buckets", f"too few buckets ({self.buckets}) for an exact range"
            )
        if self.max_distance <= max_exact:
            raise cross_field_error(
                "max_distance",
                f"max_distance must be greater than the exact range {max_exact} "
                f"(buckets per direction / 2); got {self.max_distance}",
            )
        return self

    @property
    def max_exact(self) -> int:
        per_direction = self.buckets // 2 if self.bidirectional else self.buckets
        return per_direction // 2


class LinearSlopeBias(SpecModel):
    """bias[h, i, j] = -slope_h · |i - j| (Press et al. 2022, ALiBi, arXiv:2108.12409).

    ``alibi_geometric``: for n heads a power of two, slope_h = 2^(-8(h+1)/n); otherwise the
    slopes of the closest lower power of two followed by every other slope of the next.
    ``learned``: trained slopes (an ``nn.Parameter``), initialised from that recipe.
    ``custom``: the slopes listed in ``values``, one per head (defaults.heads of them).
    ``heads_with_bias: N`` gives the recipe's slopes for N heads to the first N heads and
    no bias to the others (x-transformers' AlibiPositionalBias with alibi_num_heads).
    ``distance: absolute`` is |i - j| on both sides: without a causal mask this is the
    symmetric ALiBi of encoders.
    """

    kind: Literal["linear_slopes"]
    slopes: Literal["alibi_geometric", "learned", "custom"]
    values: list[Annotated[float, Field(ge=0, le=1000)]] | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="custom slopes, one per head (defaults.heads of them), each in [0, 1000]: "
        "a slope of 1000 already ends attention one position away",
    )
    heads_with_bias: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="only the first N heads get a bias (1 to defaults.heads); the rest none",
    )
    distance: Literal["absolute"]
    placement: Literal["after_scale", "before_scale"]

    @model_validator(mode="after")
    def _check_values(self) -> LinearSlopeBias:
        if self.slopes == "custom" and self.values is None:
            raise cross_field_error("slopes", "slopes 'custom' needs 'values': one slope per head")
        if self.slopes != "custom" and self.values is not None:
            raise cross_field_error(
                "values", f"'values' are read only with slopes 'custom' (got {self.slopes!r})"
            )
        if self.slopes == "custom" and self.heads_with_bias is not None:
            raise cross_field_error(
                "heads_with_bias",
                "custom values give every head its slope already: write 0 for the heads "
                "without a bias",
            )
        return self


class LearnedTableBias(SpecModel):
    """bias[h, i, j] = table[index(i, j), h]: a trained scalar per (bucket, head)."""

    kind: Literal["learned_table"]
    index: LogBuckets
    placement: Literal["after_scale", "before_scale"]
    init_std: float = _init_std(1.0)


class KerpleBias(SpecModel):
    """KERPLE (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for
    Length Extrapolation", arXiv:2205.09921): a conditionally positive definite kernel of
    the distance, with two trained positive scalars per head.

    ``log``:   bias[h, i, j] = -r1_h · log(1 + r2_h · |i - j|)
    ``power``: bias[h, i, j] = -r1_h · |i - j|^r2_h, with 0 < r2_h ≤ 2

    As the authors' code (chijames/KERPLE, ParallelKerpleLog / ParallelKerplePower), r1
    starts uniform in [0, 2) and r2 uniform in [0, 1), and the forward pass reads them
    clamped to at least 0.01 (r2 of ``power`` also to at most 2); unlike that code, the
    clamp is not written back into the parameters (the forward pass has no side effects).
    """

    kind: Literal["kerple"]
    variant: Literal["log", "power"]
    placement: Literal["after_scale", "before_scale"]


class FireBias(SpecModel):
    """FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions Improves
    Long Context Transformers", arXiv:2310.04418).

    bias[h, i, j] = f_θ(ψ(i - j) / ψ(max(i, L)))_h with ψ(x) = log(|c| · x + 1), a trained
    c (initially ``init_c``) and threshold L = |s · L0| (L0 = ``init_threshold``, fixed;
    s trained, initially 1), as the paper's reference code. f_θ is an MLP 1 → ``hidden``
    → heads with one ReLU. The distance is causal: i - j is clamped at 0, so keys after
    the query share the bias of distance 0 (the reference code takes |i - j|; the two
    agree under a causal mask). A small 1e-6 keeps the normaliser positive.
    """

    kind: Literal["fire"]
    hidden: int = Field(
        32, ge=1, le=1024, description="width of the MLP's hidden layer, 1 to 1024 (paper: 32)"
    )
    init_c: float = Field(
        0.1, gt=0, le=100, description="initial c of psi(x) = log(c x + 1), in (0, 100] (0.1)"
    )
    init_threshold: float = Field(
        512.0,
        ge=1,
        le=1 << 24,
        description="L0, the fixed base of the threshold L = |s L0|, 1 to 2^24 (paper: 512)",
    )
    placement: Literal["after_scale", "before_scale"]


class SandwichBias(SpecModel):
    """Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens
    of Receptive Field Analysis", arXiv:2212.10356): the position_position term of
    sinusoidal embeddings of ``dim`` (d') features, without trained parameters:

        bias[h, i, j] = sum_{k=1}^{d'/2} cos((i - j) / base^(2k / d'))

    the same for every head (base 10000 in the paper).
    """

    kind: Literal["sandwich"]
    dim: int = Field(
        ge=2, le=4096, description="d', the (even) sinusoid width the bias sums over, 2 to 4096"
    )
    base: float = Field(10000.0, gt=1, le=MAX_BASE, description=_BASE_WHY)
    placement: Literal["after_scale", "before_scale"]

    @model_validator(mode="after")
    def _even(self) -> SandwichBias:
        if self.dim % 2:
            raise cross_field_error(
                "dim", f"d' pairs sin and cos features, so it must be even (got {self.dim})"
            )
        return self


class ExprParam(SpecModel):
    """A trained parameter of an expression bias: one per head, or one scalar.

    ``positive``: stored unconstrained and read through softplus (init is the value
    after softplus); ``bounds``: read clamped to [lo, hi].
    """

    shape: list[Literal["heads"]] = Field(
        max_length=1, description="[heads] (one value per head, read as name[h]) or [] (scalar)"
    )
    init: float = Field(
        ge=-MAX_EXPR_INIT,
        le=MAX_EXPR_INIT,
        description=f"initial value, within ±{MAX_EXPR_INIT:g}",
    )
    positive: bool = False
    bounds: list[Annotated[float, Field(ge=-MAX_EXPR_INIT, le=MAX_EXPR_INIT)]] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description=f"[lo, hi], each within ±{MAX_EXPR_INIT:g}: the value is read clamped",
    )

    @model_validator(mode="after")
    def _check_init(self) -> ExprParam:
        if self.positive and self.init < 1e-6:
            raise cross_field_error(
                "init", f"a positive parameter needs init ≥ 1e-6 (got {self.init!r})"
            )
        if self.bounds is not None:
            lo, hi = self.bounds
            if not lo < hi:
                raise cross_field_error(
                    "bounds", f"bounds must be [lo, hi] with lo < hi (got {self.bounds})"
                )
            if not lo <= self.init <= hi:
                raise cross_field_error(
                    "init", f"init {self.init!r} lies outside bounds {self.bounds}"
                )
        return self

    @property
    def per_head(self) -> bool:
        return bool(self.shape)


class ExprBias(SpecModel):
    """A bias written as a safe expression of i, j, h and declared parameters.

    The grammar (posgen/spec/expr.py, docs/reference.md): names i, j (float positions),
    h (head index) and the parameters; numbers; + - * / ** % and unary -, +; comparisons;
    abs log log1p exp sqrt sin cos sign floor minimum maximum clamp where. Parsed with
    ``ast`` against that whitelist and rendered from a fixed table of torch calls.
    """

    kind: Literal["expr"]
    expr: str = Field(description="the expression (one line, at most 500 characters)")
    params: dict[str, ExprParam] = Field(
        default_factory=dict, max_length=16, description="up to 16 trained parameters"
    )
    placement: Literal["after_scale", "before_scale"]

    @model_validator(mode="after")
    def _parse(self) -> ExprBias:
        for name in self.params:
            if (
                not PARAM_NAME.fullmatch(name)
                or name in RESERVED_PARAM_NAMES
                or keyword.iskeyword(name)
                or keyword.issoftkeyword(name)
                or hasattr(builtins, name)  # a local of that name would hide the builtin
            ):
                raise cross_field_error(
                    "params",
                    f"parameter name {quoted(name)} must be lower-case letters, digits and "
                    "underscores (at most 31, starting with a letter), and not i, j, h, a "
                    "function name, a Python keyword or a Python builtin (type, len, ...)",
                )
        infos = {name: ParamInfo(per_head=param.per_head) for name, param in self.params.items()}
        try:
            parsed = parse_expr(self.expr, infos)
        except ExprError as error:
            raise PydanticCustomError(
                "expr",
                "{message} (at character {character} of the expression)",
                {"message": error.message, "character": error.offset + 1, "offset": error.offset},
            ) from None
        unused = [name for name in self.params if name not in parsed.params]
        if unused:
            raise cross_field_error(
                f"params.{unused[0]}", f"parameter {quoted(unused[0])} is declared but never used"
            )
        return self

    def parsed(self) -> Parsed:
        """The checked expression (validated already, so this cannot fail)."""
        infos = {name: ParamInfo(per_head=param.per_head) for name, param in self.params.items()}
        return parse_expr(self.expr, infos)


Bias = Annotated[
    LinearSlopeBias | LearnedTableBias | KerpleBias | FireBias | SandwichBias | ExprBias,
    Field(discriminator="kind"),
]
UntiedBias = Annotated[LinearSlopeBias | LearnedTableBias, Field(discriminator="kind")]
AnyBias = LinearSlopeBias | LearnedTableBias | KerpleBias | FireBias | SandwichBias | ExprBias


class BiasTerm(SpecModel):
    """position_position replaced by a scalar bias of (i, j), per head."""

    bias: Bias

    @property
    def form(self) -> str:
        return "bias"


# --------------------------------------------------------------------------- untied positions


class TableNorm(SpecModel):
    """Normalisation of the untied table rows before their projections.

    ``none``: the projections see p_i itself (the formula as printed in Ke et al. 2021);
    ``layer_norm``: LayerNorm(p_i) with a trained gain and shift, as the authors' code does.
    """

    kind: Literal["none", "layer_norm"]
    eps: float = Field(1e-5, ge=MIN_EPS, le=0.1, description=_EPS_WHY)

    @model_validator(mode="before")
    @classmethod
    def _from_keyword(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data


class UntiedPositions(SpecModel):
    """An absolute table in model space, NOT added to the input, with its own projections.

    Ke, He and Liu 2021 (TUPE, arXiv:2006.15595): the position-position term is
    (p_i U_q)(p_j U_k)^T per head, with U_q, U_k: model_dim -> heads * head_dim,
    untied from the content projections Wq, Wk. ``projection_bias`` adds a trained
    offset to each projection (the authors' code does; the printed formula does not).

    ``first_token``: ``shared`` treats position 0 like any other; ``reset`` is the paper's
    [CLS] reset (section 3.3): the table gains a leading row, position t reads row t + 1,
    and the scores of query position 0 against every key, and of every query against
    key position 0, are per-head constants computed from rows 0 and 1, as the authors'
    code does (query row wins where both hold).
    """

    table: AbsoluteTable
    norm: TableNorm
    projection_bias: bool
    first_token: Literal["shared", "reset"]

    @model_validator(mode="after")
    def _learned_only(self) -> UntiedPositions:
        if self.table.kind != "learned":
            raise cross_field_error(
                "table.kind",
                f"an untied table is trained together with its projections: only kind "
                f"'learned' is supported here (got {self.table.kind!r})",
            )
        return self


class UntiedTerm(SpecModel):
    """position_position as an untied absolute term, plus an optional bias of (i, j)."""

    untied: UntiedPositions
    bias: UntiedBias | None = None

    @model_validator(mode="after")
    def _reset_needs_a_spare_bucket(self) -> UntiedTerm:
        if self.untied.first_token != "reset" or self.bias is None:
            return self
        if not isinstance(self.bias, LearnedTableBias):
            raise cross_field_error(
                "bias.kind",
                "the first-token reset gives the first position its own bias entries: it "
                f"needs a 'learned_table' bias (got {self.bias.kind!r})",
            )
        if not self.bias.index.bidirectional:
            raise cross_field_error(
                "bias.index.bidirectional",
                "the first-token reset uses the bucket that bidirectional buckets leave "
                "unused (buckets / 2) for the first query: set bidirectional: true",
            )
        return self

    @property
    def form(self) -> str:
        return "untied"


# --------------------------------------------------------------------------- relative tables

Sign = Literal["key_minus_query", "query_minus_key"]
Placement = Literal["after_scale", "before_scale"]
Projection = Literal["none", "key", "query", "relative"]


class ClipIndex(SpecModel):
    """index = clip(r, -max_distance, max_distance) + max_distance (Shaw et al. 2018).

    r is the signed relative position named by each term's ``sign``; the table has
    2 · max_distance + 1 rows, and every distance beyond the clip shares an edge row.
    """

    kind: Literal["clip"]
    max_distance: int = Field(
        ge=1,
        le=1 << 20,
        description="clip distance k, 1 to 1,048,576 (2^20; Shaw 16, BERT 511): the table "
        "has 2k + 1 rows",
    )

    @property
    def rows(self) -> int:
        return 2 * self.max_distance + 1


class SymmetricLogBuckets(SpecModel):
    """Signed log buckets of the DeBERTa-v2 recipe (He et al. 2021, arXiv:2006.03654).

    With mid = buckets / 2: |r| <= mid keeps r; larger |r| maps to
    sign(r) · (mid + ceil(log(|r| / mid) / log((max_distance - 1) / mid) · (mid - 1))).
    The row is clamp(bucket + buckets, 0, 2 · buckets - 1): the table has 2 · buckets rows
    (``position_buckets`` and ``max_relative_positions`` in Hugging Face DebertaV2Config).
    """

    kind: Literal["log_buckets"]
    recipe: Literal["deberta"]
    buckets: int = Field(
        ge=4,
        le=1 << 16,
        description="position_buckets, 4 to 65,536 (DeBERTa-v3 256): the table has "
        "2 x buckets rows",
    )
    max_distance: int = Field(
        ge=2,
        le=1 << 24,
        description="max_relative_positions, up to 16,777,216 (2^24; DeBERTa-v3 512): only "
        "the bucket formula reads it",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> SymmetricLogBuckets:
        if self.buckets % 2:
            raise cross_field_error(
                "buckets",
                f"log buckets are split evenly between the two signs, so the count must "
                f"be even (got {self.buckets})",
            )
        if self.max_distance <= self.buckets:
            raise cross_field_error(
                "max_distance",
                f"max_distance must be greater than buckets ({self.buckets}) so that the "
                f"log-spaced range is not empty; got {self.max_distance}",
            )
        return self

    @property
    def rows(self) -> int:
        return 2 * self.buckets


class DistanceIndex(SpecModel):
    """The raw signed distance r itself: only for computed (sinusoidal) tables."""

    kind: Literal["distance"]

    @property
    def rows(self) -> None:
        return None


RelativeIndex = Annotated[
    ClipIndex | SymmetricLogBuckets | DistanceIndex, Field(discriminator="kind")
]


class LayerNormSpec(SpecModel):
    """LayerNorm over the table rows before projection (DeBERTa-v2 norm_rel_ebd)."""

    kind: Literal["layer_norm"]
    eps: float = Field(ge=MIN_EPS, le=0.1, description=_EPS_WHY)


class LearnedRelativeTable(SpecModel):
    """A trained table R, one row per index value.

    ``width: head_dim``: rows are used as they are, shared by every head
    (``heads: shared``, [rows, head_dim]) or one per head (``per_head``,
    [rows, heads · head_dim]). ``width: model_dim``: rows live in model space
    [rows, model_dim] (optionally layer-normed) and each term projects them.
    """

    kind: Literal["learned"]
    width: Literal["head_dim", "model_dim"]
    heads: Literal["shared", "per_head"] | None = None
    norm: LayerNormSpec | None = None
    init_std: float = _init_std(0.02)

    @model_validator(mode="after")
    def _check_width(self) -> LearnedRelativeTable:
        if self.width == "head_dim":
            if self.heads is None:
                raise cross_field_error(
                    "heads",
                    "a head_dim table must say whether heads share it: 'shared' or 'per_head'",
                )
            if self.norm is not None:
                raise cross_field_error(
                    "norm", "only model_dim tables are normalised before their projection"
                )
        elif self.heads is not None:
            raise cross_field_error(
                "heads",
                "a model_dim table is split into heads by its projections; remove 'heads'",
            )
        return self


class SinusoidalRelativeTable(SpecModel):
    """R_r computed from the signed distance r (Dai et al. 2019): [rows, model_dim].

    ``split``: [sin(r·w_0) … sin(r·w_{D/2-1}) | cos(r·w_0) … cos(r·w_{D/2-1})],
    w_k = base^(-2k/D) (Transformer-XL); ``interleaved``: sin on even, cos on odd features.
    """

    kind: Literal["sinusoidal"]
    base: float = Field(gt=1, le=MAX_BASE, description=_BASE_WHY)
    layout: Literal["interleaved", "split"]


RelativeTable = Annotated[
    LearnedRelativeTable | SinusoidalRelativeTable, Field(discriminator="kind")
]


class RelativeSection(SpecModel):
    """The relative table R and its index map, shared by every relative term.

    ``table`` is required when a term reads it; a spec whose only relative part is the
    value term (which has its own table) states just the ``index``. A relative term is
    term_ij = x · P(R)[index(r)], with r the signed relative position of (i, j), x the
    term's query-side vector and P its projection.
    """

    index: RelativeIndex
    table: RelativeTable | None = None

    @property
    def width(self) -> str | None:
        table = self.table
        if table is None:
            return None
        return table.width if isinstance(table, LearnedRelativeTable) else "model_dim"


class RelativeTermSpec(SpecModel):
    """How one term reads the relative table.

    ``sign``: r = j - i (``key_minus_query``) or i - j (``query_minus_key``).
    ``projection``: ``none`` (head_dim table used as it is), ``key`` / ``query`` (the
    module's ``pos_key_proj`` / ``pos_query_proj``: Linear model_dim → heads · head_dim
    with bias, copies of the attention's key / query projections) or ``relative`` (the
    module's ``r_net``: a separate Linear without bias, W_R of Transformer-XL).
    ``placement``: inside the 1/sqrt(d) scale (``before_scale``) or added after it.
    """

    sign: Sign
    projection: Projection
    placement: Placement


class RelativeTerm(SpecModel):
    """content_position: q_i · P(R)[index(r)]; position_content: k_j · P(R)[index(r)]."""

    relative: RelativeTermSpec

    @property
    def form(self) -> str:
        return "relative"


class GlobalContentSpec(SpecModel):
    """A trained vector u per head dotted with every key: u_h · k_j (parameter r_w_bias)."""

    placement: Placement
    init_std: float = _init_std(0.02)


class GlobalContentTerm(SpecModel):
    """position_content replaced by a global content bias (Transformer-XL term (c))."""

    global_: GlobalContentSpec = Field(alias="global")

    @property
    def form(self) -> str:
        return "global"


class GlobalPositionSpec(SpecModel):
    """A trained vector v per head dotted with the relative rows: v_h · P(R)[index(r)]."""

    sign: Sign
    projection: Projection
    placement: Placement
    init_std: float = _init_std(0.02)


class GlobalPositionTerm(SpecModel):
    """position_position replaced by a global position bias (Transformer-XL term (d))."""

    global_: GlobalPositionSpec = Field(alias="global")

    @property
    def form(self) -> str:
        return "global"


class RelativeValuesSpec(SpecModel):
    """z_i = Σ_j α_ij (v_j + R^V[index(r)]): a second trained head-space table on values.

    Uses the index of the ``relative`` section with its own ``sign``; the table is
    [rows, value_dim] (``shared``) or [rows, heads · value_dim] (``per_head``).
    """

    sign: Sign
    heads: Literal["shared", "per_head"]
    init_std: float = _init_std(0.02)


class RelativeValues(SpecModel):
    """values: a relative value term (Shaw et al. 2018)."""

    relative: RelativeValuesSpec

    @property
    def form(self) -> str:
        return "relative"


# --------------------------------------------------------------------------- contextual


class ContextualPositions(SpecModel):
    """CoPE, contextual position encoding (Golovneva et al. 2024, arXiv:2405.18719), as
    x-transformers' ``CoPE`` (integer-position interpolation, no talking heads).

    With s_ij = q_i · k_j · scale the content logits, gates g_ij = sigmoid(s_ij) for keys at
    or before the query (0 for later keys), the contextual position
    p_ij = min(sum_{t=j..} g_it, max_positions - 1), and e a trained table
    [max_positions, head_dim] shared by the heads, the term added after the scale is
    (1 - w) q_i · e[floor p_ij] + w q_i · e[ceil p_ij], w = p_ij - floor p_ij.
    """

    kind: Literal["cope"]
    max_positions: int = Field(
        ge=2,
        le=1 << 16,
        description="rows of the position table, 2 to 65,536 (x-transformers' default "
        "cope_max_pos 16); contextual positions are clamped below it",
    )
    init_std: float = _init_std(0.02)


class ContextualTerm(SpecModel):
    """content_position from contextual (counted) positions: CoPE."""

    contextual: ContextualPositions

    @property
    def form(self) -> str:
        return "contextual"


# --------------------------------------------------------------------------- the terms


ContentContent = Annotated[
    Annotated[Literal["keep"], Tag("keep")] | Annotated[RotateTerm, Tag("rotate")],
    _tagged("keep", "rotate", what="content_content"),
]
ContentPosition = Annotated[
    Annotated[Literal["drop"], Tag("drop")]
    | Annotated[Literal["absolute"], Tag("absolute")]
    | Annotated[RelativeTerm, Tag("relative")]
    | Annotated[ContextualTerm, Tag("contextual")],
    _tagged("drop", "absolute", "relative", "contextual", what="content_position"),
]
PositionContent = Annotated[
    Annotated[Literal["drop"], Tag("drop")]
    | Annotated[Literal["absolute"], Tag("absolute")]
    | Annotated[RelativeTerm, Tag("relative")]
    | Annotated[GlobalContentTerm, Tag("global")],
    _tagged("drop", "absolute", "relative", "global", what="position_content"),
]
PositionPosition = Annotated[
    Annotated[Literal["drop"], Tag("drop")]
    | Annotated[Literal["absolute"], Tag("absolute")]
    | Annotated[BiasTerm, Tag("bias")]
    | Annotated[UntiedTerm, Tag("untied_term")]
    | Annotated[GlobalPositionTerm, Tag("global")],
    _tagged(
        "drop",
        "absolute",
        "bias",
        "global",
        what="position_position",
        leading=("untied", "untied_term"),
    ),
]
Values = Annotated[
    Annotated[Literal["plain"], Tag("plain")] | Annotated[RelativeValues, Tag("relative")],
    _tagged("plain", "relative", what="values"),
]


class Terms(SpecModel):
    """The four query-key terms of the decomposition, each stated explicitly."""

    content_content: ContentContent
    content_position: ContentPosition
    position_content: PositionContent
    position_position: PositionPosition


class Defaults(SpecModel):
    """Constructor defaults of the generated module (all overridable by the caller)."""

    heads: int = Field(
        ge=1, le=1024, description="attention heads, 1 to 1024 (published models: up to 128)"
    )
    head_dim: int = Field(
        ge=1, le=1024, description="features per head, 1 to 1024 (published models: up to 256)"
    )
    model_dim: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="model width, 1 to 65,536 (published models: up to about 25,600); "
        "tables hold rows x model_dim floats",
    )


class RandomizedPositions(SpecModel):
    """Randomized positional encodings (Ruoss et al. 2023, "Randomized Positional
    Encodings Boost Length Generalization of Transformers", arXiv:2305.16843).

    In training, a sequence of length M gets the positions of a sorted random subset of
    size M of 0 .. max_positions − 1 (drawn afresh each call, from the module's
    ``position_generator`` when it is set), so the model sees the position values of
    long sequences on short ones; in evaluation it gets the plain range 0 .. M − 1.
    """

    kind: Literal["randomized"]
    max_positions: int = Field(
        ge=2,
        le=MAX_TABLE_ROWS,
        description=f"the range positions are drawn from in training, 2 to {MAX_TABLE_ROWS:,}: "
        "longer than any training sequence, as long as the lengths to generalise to",
    )


class Claims(SpecModel):
    """What the encoding claims; ``posgen check`` tests stated claims, measures the rest."""

    unique: bool | None = None
    relative: bool | None = None
    decay: bool | None = None
    extrapolates: bool | None = None


class Spec(SpecModel):
    """One positional encoding: its metadata and its row of the decomposition table."""

    name: Annotated[str, Field(min_length=1, max_length=64)]
    title: Text
    references: list[Text] = Field(
        min_length=1, max_length=32, description="1 to 32 references, one line each"
    )
    models: list[Text] = Field(
        default_factory=list,
        max_length=64,
        description="up to 64 models that use exactly this encoding, one line each",
    )
    defaults: Defaults
    scale: Scale
    input: InputForm | None = None
    relative: RelativeSection | None = None
    terms: Terms
    values: Values = "plain"
    positions: RandomizedPositions | None = None
    claims: Claims

    @field_validator("name")
    @classmethod
    def _module_name(cls, name: str) -> str:
        if not MODULE_NAME.fullmatch(name):
            raise PydanticCustomError(
                "module_name",
                "got {shown}; a spec name is lower-case ASCII words (letters and digits) "
                "joined by single underscores, starting with a letter, e.g. 'rope_yarn'",
                {"shown": quoted(name)},
            )
        if name in RESERVED_MODULE_NAMES:
            raise PydanticCustomError(
                "module_name",
                "'{name}' is the name of a standard-library or required module; a generated "
                "module of that name would shadow it",
                {"name": name},
            )
        problem = reserved_name_problem(name)
        if problem is not None:
            raise PydanticCustomError("module_name", "{problem}", {"problem": problem})
        return name

    def _trained_tables(self) -> list[tuple[str, int, int]]:
        """(field, rows, width) of every trained table and table projection the spec's
        defaults create."""
        model_dim = self.defaults.model_dim or 0
        heads, head_dim = self.defaults.heads, self.defaults.head_dim
        tables: list[tuple[str, int, int]] = []
        table = getattr(self.input, "table", None)
        if isinstance(table, LearnedTable):
            tables.append(("input.table.max_positions", table.max_positions, model_dim))
        elif isinstance(table, HierarchicalTable):
            tables.append(("input.table.base_positions", table.base_positions, model_dim))
        untied = self.untied
        if untied is not None and isinstance(untied.table, LearnedTable):
            untied_rows = untied.table.max_positions + 1
            at = "terms.position_position.untied.table.max_positions"
            tables.append((at, untied_rows, model_dim))
        if untied is not None:  # its query and key projections, model_dim -> heads x head_dim
            tables.append(("defaults.model_dim", model_dim, heads * head_dim))
        for name in ("content_position", "position_content", "position_position"):
            term = getattr(self.terms, name)
            spec = getattr(term, "relative", None) or getattr(term, "global_", None)
            if getattr(spec, "projection", "none") != "none":  # a Linear model_dim -> H x D
                tables.append((f"terms.{name}", model_dim, heads * head_dim))
        section = self.relative
        rows = section.index.rows if section is not None else None
        if section is not None and rows is not None:
            relative = section.table
            if isinstance(relative, LearnedRelativeTable):
                width = model_dim if relative.width == "model_dim" else head_dim
                if relative.heads == "per_head":
                    width *= heads
                tables.append(("relative.index", rows, width))
            if isinstance(self.values, RelativeValues):
                per_head = self.values.relative.heads == "per_head"
                tables.append(
                    ("values.relative.heads", rows, head_dim * (heads if per_head else 1))
                )
        return tables

    def _check_randomized_range(self) -> None:
        """Randomized positions must stay inside every trained table they index."""
        if self.positions is None:
            return
        limits = [rows for at, rows, _ in self._trained_tables() if "max_positions" in at]
        if limits and self.positions.max_positions > min(limits):
            raise cross_field_error(
                "positions.max_positions",
                f"randomized positions up to {self.positions.max_positions - 1} would index "
                f"past a learned table of {min(limits)} rows: use at most {min(limits)}",
            )

    def _check_table_sizes(self) -> None:
        for at, rows, width in self._trained_tables():
            if rows * width > MAX_TABLE_ELEMENTS:
                raise cross_field_error(
                    at,
                    f"this makes a trained table (or projection) of {rows:,} rows x "
                    f"{width:,} features = {rows * width:,} floats, past the limit of "
                    f"{MAX_TABLE_ELEMENTS:,} (2^27, 512 MiB in float32): use fewer rows or "
                    "a narrower table",
                )

    @model_validator(mode="after")
    def _check_consistency(self) -> Spec:
        if keyword.iskeyword(self.name) or keyword.issoftkeyword(self.name):
            raise cross_field_error("name", f"{self.name!r} is a Python keyword")
        if hasattr(builtins, self.name):
            raise cross_field_error("name", f"{self.name!r} is a Python builtin name")
        position_terms = {
            "content_position": self.terms.content_position,
            "position_content": self.terms.position_content,
            "position_position": self.terms.position_position,
        }
        if self.input is not None:
            for term, value in position_terms.items():
                if value != "absolute" and not isinstance(value, RELATIVE_FORMS):
                    raise cross_field_error(
                        f"terms.{term}",
                        "positions added to the input reach every position term: "
                        f"state it as 'absolute' (got {_describe(value)!r})",
                    )
            if self.defaults.model_dim is None:
                raise cross_field_error("defaults", "an input-level table needs defaults.model_dim")
            table = getattr(self.input, "table", None)
            if table is not None and table.kind == "sinusoidal" and self.defaults.model_dim % 2:
                raise cross_field_error(
                    "defaults.model_dim",
                    f"sinusoidal tables pair sin and cos features, so model_dim must be "
                    f"even (got {self.defaults.model_dim})",
                )
        else:
            for term, value in position_terms.items():
                if value == "absolute":
                    raise cross_field_error(
                        f"terms.{term}",
                        "'absolute' terms come from an input-level table: add an "
                        "'input' section or choose another form",
                    )
        if self.untied is not None and self.defaults.model_dim is None:
            raise cross_field_error(
                "defaults",
                "an untied position table lives in model space: it needs defaults.model_dim",
            )
        self._check_relative()
        self._check_bias()
        self._check_table_sizes()
        self._check_randomized_range()
        if self.rotation is not None:
            self._check_rotation(self.rotation)
        if self.contextual is not None and (self._relative_readers() or self.relative):
            raise cross_field_error(
                "terms.content_position",
                "CoPE's contextual term renders the module's content-dependent terms: it "
                "cannot share them with relative-table terms (drop those, or the relative "
                "section)",
            )
        return self

    def _check_rotation(self, rotation: Rotation) -> None:
        """Rotation fields that depend on head_dim, and combinations that have no meaning."""
        at = "terms.content_content.rotate"
        problem = rotation_problem(rotation, self.defaults.head_dim)
        if problem is not None:
            field, message = problem
            raise cross_field_error(f"{at}.{field}", message)
        if rotation.axes is not None and self.positions is not None:
            raise cross_field_error(
                f"{at}.axes",
                "randomized positions draw one position per token; M-RoPE "
                "takes a position per axis: use one or the other",
            )

    def _check_bias(self) -> None:
        """Per-head sizes of a bias against defaults.heads."""
        bias = self.bias
        at = "terms.position_position.bias"
        heads = self.defaults.heads
        if isinstance(bias, LinearSlopeBias):
            if bias.values is not None and len(bias.values) != heads:
                raise cross_field_error(
                    f"{at}.values",
                    f"{len(bias.values)} custom slopes for {heads} heads (defaults.heads): "
                    "give one per head",
                )
            if bias.heads_with_bias is not None and bias.heads_with_bias > heads:
                raise cross_field_error(
                    f"{at}.heads_with_bias",
                    f"{bias.heads_with_bias} heads with a bias, but defaults.heads is {heads}",
                )
        if isinstance(bias, FireBias) and bias.hidden * heads > MAX_TABLE_ELEMENTS:
            raise cross_field_error(f"{at}.hidden", "the MLP is too large for these heads")

    def _relative_readers(self) -> list[tuple[str, RelativeTermSpec | GlobalPositionSpec]]:
        """(path, term) of every term that reads the relative table."""
        readers: list[tuple[str, RelativeTermSpec | GlobalPositionSpec]] = []
        for term in ("content_position", "position_content", "position_position"):
            value = getattr(self.terms, term)
            if isinstance(value, RelativeTerm):
                readers.append((f"terms.{term}.relative", value.relative))
            elif isinstance(value, GlobalPositionTerm):
                readers.append((f"terms.{term}.global", value.global_))
        return readers

    def _check_relative(self) -> None:
        readers = self._relative_readers()
        value_term = self.values if isinstance(self.values, RelativeValues) else None
        section = self.relative
        if section is None:
            if readers:
                raise cross_field_error(
                    readers[0][0],
                    "relative terms read the table of a top-level 'relative' section "
                    "(index and table): add one",
                )
            if value_term is not None:
                raise cross_field_error(
                    "values.relative",
                    "relative values use the index of a top-level 'relative' section: add one",
                )
            return
        if not readers and value_term is None:
            raise cross_field_error(
                "relative", "no term reads the relative table: remove the section"
            )
        if readers and section.table is None:
            raise cross_field_error(
                "relative.table", f"{readers[0][0]} reads the relative table: add 'table'"
            )
        if section.table is not None and not readers:
            raise cross_field_error(
                "relative.table",
                "no term reads the relative table (the value term has its own): remove it",
            )
        if value_term is not None and isinstance(section.index, DistanceIndex):
            raise cross_field_error(
                "values.relative",
                "relative values are a learned table with finitely many rows: use index "
                "kind 'clip' or 'log_buckets'",
            )
        width = section.width
        for path, reader in readers:
            if width == "head_dim" and reader.projection != "none":
                raise cross_field_error(
                    f"{path}.projection",
                    "a head_dim table is used as it is, so projection must be 'none' "
                    f"(got {reader.projection!r})",
                )
            if width == "model_dim" and reader.projection == "none":
                raise cross_field_error(
                    f"{path}.projection",
                    "a model_dim table must be projected into the heads: choose 'key', "
                    "'query' or 'relative'",
                )
        table, index = section.table, section.index
        if isinstance(table, SinusoidalRelativeTable) and not isinstance(index, DistanceIndex):
            raise cross_field_error(
                "relative.index.kind",
                "a sinusoidal table is computed for every distance: use index kind 'distance'",
            )
        if isinstance(index, DistanceIndex) and isinstance(table, LearnedRelativeTable):
            raise cross_field_error(
                "relative.index.kind",
                "a learned table has finitely many rows: use index kind 'clip' or 'log_buckets'",
            )
        if width == "model_dim":
            if self.defaults.model_dim is None:
                raise cross_field_error(
                    "defaults", "a model_dim relative table needs defaults.model_dim"
                )
            if isinstance(table, SinusoidalRelativeTable) and self.defaults.model_dim % 2:
                raise cross_field_error(
                    "defaults.model_dim",
                    f"sinusoidal tables pair sin and cos features, so model_dim must be "
                    f"even (got {self.defaults.model_dim})",
                )

    @property
    def rotation(self) -> Rotation | None:
        """The rotation of content_content, if the spec rotates."""
        term = self.terms.content_content
        return term.rotate if isinstance(term, RotateTerm) else None

    @property
    def bias(self) -> AnyBias | None:
        """The position_position bias, if the spec has one (alone or beside an untied term)."""
        term = self.terms.position_position
        return term.bias if isinstance(term, (BiasTerm, UntiedTerm)) else None

    @property
    def contextual(self) -> ContextualPositions | None:
        """The CoPE term, if content_position is contextual."""
        term = self.terms.content_position
        return term.contextual if isinstance(term, ContextualTerm) else None

    @property
    def untied(self) -> UntiedPositions | None:
        """The untied absolute position_position term, if the spec has one."""
        term = self.terms.position_position
        return term.untied if isinstance(term, UntiedTerm) else None


RELATIVE_FORMS = (RelativeTerm, GlobalContentTerm, GlobalPositionTerm)


def rotary_dim_for(head_dim: int, fraction: float) -> int:
    """Number of rotated features: fraction · head_dim, rounded to the nearest integer."""
    return int(round(head_dim * fraction))


def kind_tags() -> frozenset[str]:
    """Every ``kind`` value of the spec's models: the tags their unions report in error
    locations (the loader drops them to find the YAML position)."""
    tags: set[str] = set()
    pending: list[type[SpecModel]] = [SpecModel]
    while pending:
        for model in pending.pop().__subclasses__():
            pending.append(model)
            field = model.model_fields.get("kind")
            if field is not None:
                tags.update(a for a in typing.get_args(field.annotation) if isinstance(a, str))
    return frozenset(tags)


def kinds_at(path: tuple[str | int, ...], data: Any = None) -> list[str]:
    """The ``kind`` values allowed at a field of the spec (``path`` of keys and list
    indices from the top, as in the YAML), sorted; empty where the field is no union
    of kinds. For the message of a mapping that lacks its ``kind``.

    ``data``, the spec's parsed YAML, picks among a union's models the ones whose
    fields hold the mapping's keys there (an untied term's ``bias`` allows fewer kinds
    than a bias term's)."""
    annotations: list[Any] = [Spec]
    node = data
    for part in path:
        annotations = [inner for a in annotations for inner in _field_types(a, part, node)]
        node = _child(node, part)
    tags: set[str] = set()
    for annotation in annotations:
        for model in _alternatives(annotation):
            field = model.model_fields.get("kind") if _is_model(model) else None
            if field is not None:
                tags.update(a for a in typing.get_args(field.annotation) if isinstance(a, str))
    return sorted(tags)


def _child(node: Any, part: str | int) -> Any:
    """``node[part]`` of parsed YAML, or None where there is none."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _alternatives(annotation: Any) -> list[Any]:
    """The types an annotation admits, through Annotated and unions (one level of each)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _alternatives(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _alternatives(arg)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    """Whether ``annotation`` is one of the spec's models."""
    return isinstance(annotation, type) and issubclass(annotation, SpecModel)


def _yaml_keys(model: type[SpecModel]) -> set[str]:
    """The keys a model's mapping may hold in YAML (aliases where set)."""
    return {field.alias or name for name, field in model.model_fields.items()}


def _field_types(annotation: Any, part: str | int, node: Any = None) -> list[Any]:
    """The annotations of field ``part`` (a key, or a list index) of a value annotated
    ``annotation`` whose parsed YAML is ``node``: a model's field (of the models whose
    fields hold every key of ``node``, where any does), a dict's values, a list's or
    tuple's items."""
    alternatives = _alternatives(annotation)
    if isinstance(node, dict):
        fitting = [a for a in alternatives if _is_model(a) and set(node) <= _yaml_keys(a)]
        alternatives = fitting or alternatives
    found: list[Any] = []
    for alternative in alternatives:
        origin = typing.get_origin(alternative)
        if _is_model(alternative) and isinstance(part, str):
            named = alternative.model_fields.items()  # found by YAML key: alias or name
            field = next((f for n, f in named if (f.alias or n) == part), None)
            found.extend([] if field is None else [field.annotation])
        elif origin is dict and isinstance(part, str):
            found.append(typing.get_args(alternative)[1])
        elif origin in (list, tuple) and isinstance(part, int):
            found.extend(a for a in typing.get_args(alternative) if a is not Ellipsis)
    return found


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
    return None


def _describe(value: object) -> str:
    """A term's form for an error message: its keyword, or its model's ``form``."""
    return value if isinstance(value, str) else getattr(value, "form", type(value).__name__)
