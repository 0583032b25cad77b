"""Biases of the logits by position (ALiBi-style slopes, learned tables over log
buckets, KERPLE, FIRE, Sandwich, expressions) and TUPE's untied positions.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from posgen.spec.diagnostics import quoted
from posgen.spec.expr import (
    PARAM_NAME,
    RESERVED_PARAM_NAMES,
    ExprError,
    ParamInfo,
    Parsed,
    parse_expr,
)
from posgen.spec.expr_values import (
    NonFiniteGradient,
    first_non_finite,
    first_non_finite_gradient,
    guarded_form,
)
from posgen.spec.model.base import (
    BASE_WHY,
    EPS_WHY,
    MAX_BASE,
    MAX_EXPR_INIT,
    MIN_EPS,
    KeywordModel,
    SpecModel,
    cross_field_error,
    expression_error,
    init_std,
)
from posgen.spec.model.inputs import AbsoluteTable

CHECKED_POSITIONS = 17
"""An expression bias is refused where it is not finite at some i, j < this (distances
up to 16 each way, 0 included), with the parameters at their initial values and heads
read as the spec's defaults.heads."""
CHECKED_EDGE_HEADS = 8
"""... and at some head h where the expression reads h: every head where the spec has
at most twice this many, else the first and the last this many."""
MAX_EXPR_INIT_HEADS = 128
"""The most initial values a per-head expression parameter lists (one per head): each
head with values of its own is checked for finiteness on its own."""
ExprInit = Annotated[float, Field(ge=-MAX_EXPR_INIT, le=MAX_EXPR_INIT)]
"""An expression parameter's initial value or bound."""


def checked_heads(heads: int) -> list[int]:
    """The head indices an expression bias is checked at, for ``heads`` heads."""
    if heads <= 2 * CHECKED_EDGE_HEADS:
        return list(range(heads))
    return [*range(CHECKED_EDGE_HEADS), *range(heads - CHECKED_EDGE_HEADS, heads)]


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
    init_std: float = init_std(1.0)


class KerpleBias(SpecModel):
    """KERPLE (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for
    Length Extrapolation", arXiv:2205.09921): a conditionally positive definite kernel of
    the distance, with two trained positive scalars per head.

    ``log``:   bias[h, i, j] = -r1_h · log(1 + r2_h · |i - j|)
    ``power``: bias[h, i, j] = -r1_h · |i - j|^r2_h, with 0 < r2_h ≤ 2

    As the authors' code (chijames/KERPLE), the factor r1 and the other parameter r2 are
    drawn uniform in [0, 2) and [0, 1) for ``log`` (ParallelKerpleLog's bias_p, bias_a),
    and in [0, 1) and [0, 2) for ``power`` (ParallelKerplePower's bias_a, bias_p: its
    exponent starts up to 2); the forward pass reads them clamped to at least 0.01 (r2 of
    ``power`` also to at most 2); unlike that code, the clamp is not written back into
    the parameters (the forward pass has no side effects).
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
    sinusoidal embeddings of ``dim`` (d') features, without trained parameters,

        S(i - j) = sum_{k=1}^{d'/2} cos((i - j) / base^(2k / d'))

    (base 10000 in the paper), given to the heads as ``per_head`` says: ``same``, S for
    every head; ``divided``, head h = 1 .. H takes (S - d'/2) / (8h / H), the ALiBi-like
    ratio of NVIDIA NeMo's SandwichRelativePositionEmbedding (the d'/2 shifts a row
    alike, so only the ratio changes attention). Implementations differ here, so the
    spec names it.
    """

    kind: Literal["sandwich"]
    dim: int = Field(
        ge=2,
        le=4096,
        description="d', the (even) sinusoid width the bias sums over, 2 to 4096",
        json_schema_extra={"multipleOf": 2},  # even: checked by _even
    )
    base: float = Field(10000.0, gt=1, le=MAX_BASE, description=BASE_WHY)
    per_head: Literal["same", "divided"] = Field(
        description="same: every head takes the sum; divided: head h of H takes "
        "(sum - d'/2) / (8h / H), as NeMo's SandwichRelativePositionEmbedding"
    )
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

    ``init``: the initial value, or for a ``[heads]`` parameter a list of one per head
    (as many as ``defaults.heads``; a module built with another head count raises
    ``ValueError``). ``positive``: stored unconstrained and read through softplus (init
    is the value after softplus); ``bounds``: read clamped to [lo, hi].
    """

    shape: list[Literal["heads"]] = Field(
        max_length=1, description="[heads] (one value per head, read as name[h]) or [] (scalar)"
    )
    init: ExprInit | list[ExprInit] = Field(
        description=f"initial value, within ±{MAX_EXPR_INIT:g}; for a [heads] parameter also "
        f"a list of one per head (defaults.heads of them, at most {MAX_EXPR_INIT_HEADS})",
    )
    positive: bool = False
    bounds: list[ExprInit] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description=f"[lo, hi], each within ±{MAX_EXPR_INIT:g}: the value is read clamped "
        "(with the gradient that brings a value outside them back)",
    )

    @model_validator(mode="after")
    def _check_init(self) -> ExprParam:
        if isinstance(self.init, list):
            if not self.per_head:
                raise cross_field_error(
                    "init", "a list of initial values needs shape [heads] (one per head)"
                )
            if not 1 <= len(self.init) <= MAX_EXPR_INIT_HEADS:
                raise cross_field_error(
                    "init",
                    f"a list of initial values holds 1 to {MAX_EXPR_INIT_HEADS} (one per head),"
                    f" got {len(self.init)}: for more heads, spread one init in the expression",
                )
        for at, value in self._initial_values():
            if self.positive and value < 1e-6:
                raise cross_field_error(
                    at, f"a positive parameter needs init ≥ 1e-6 (got {value!r})"
                )
        if self.bounds is not None:
            lo, hi = self.bounds
            if not lo < hi:
                raise cross_field_error(
                    "bounds", f"bounds must be [lo, hi] with lo < hi (got {self.bounds})"
                )
            for at, value in self._initial_values():
                if not lo <= value <= hi:
                    raise cross_field_error(at, f"init {value!r} lies outside bounds {self.bounds}")
        return self

    def _initial_values(self) -> list[tuple[str, float]]:
        """(path, value) of each initial value: ``init``, or ``init.K`` per head."""
        if isinstance(self.init, list):
            return [(f"init.{index}", value) for index, value in enumerate(self.init)]
        return [("init", self.init)]

    @property
    def per_head(self) -> bool:
        return bool(self.shape)

    @property
    def initial(self) -> float | tuple[float, ...]:
        """The initial value, or one per head (a tuple) where the spec lists them."""
        return tuple(self.init) if isinstance(self.init, list) else self.init


class ExprBias(SpecModel):
    """A bias written as a safe expression of i, j, h, heads and declared parameters.

    The grammar (posgen/spec/expr.py, docs/reference.md): names i, j (float positions),
    h (head index), heads (the module's head count) and the parameters; numbers;
    + - * / ** % and unary -, +; comparisons; abs log log1p exp sqrt sin cos sign floor
    minimum maximum clamp where. Parsed with ``ast`` against that whitelist and rendered
    from a fixed table of torch calls.
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
                    "underscores (at most 31, starting with a letter), and not i, j, h, heads, a "
                    "function name, a Python keyword or a Python builtin (type, len, ...)",
                )
        infos = {name: ParamInfo(per_head=param.per_head) for name, param in self.params.items()}
        try:
            parsed = parse_expr(self.expr, infos)
        except ExprError as error:
            raise expression_error(error) from None
        unused = [name for name in self.params if name not in parsed.params]
        if unused:
            raise cross_field_error(
                f"params.{unused[0]}", f"parameter {quoted(unused[0])} is declared but never used"
            )
        return self

    def finiteness_problem(self, heads: int) -> str | None:
        """Where the bias is first NaN or infinite for a module of ``heads`` heads (the
        spec's defaults.heads), at the initial parameters, over i, j < CHECKED_POSITIONS
        and the heads of ``checked_heads``; else where the gradient of a parameter is
        first NaN or infinite there (``gradient_problem``: a where() branch that is -inf,
        NaN or infinitely steep where it is not selected, say); None where both are
        finite."""
        parsed = self.parsed()
        initial: dict[str, float | tuple[float, ...]] = {
            name: param.initial for name, param in self.params.items()
        }
        initial["heads"] = float(heads)  # read as a name, like the parameters
        at = self._heads_to_check(parsed.uses_h, heads)
        bad = first_non_finite(parsed.tree, initial, positions=range(CHECKED_POSITIONS), heads=at)
        at_heads = f", heads = {heads} (defaults.heads)" if parsed.uses_heads else ""
        if bad is not None:
            precision = " in float32 (finite in float64)" if bad.float32 else ""
            where = f"i = {bad.i}, j = {bad.j}, h = {bad.h}"
            return (
                f"the bias is {bad.value}{precision} at {where}{at_heads} with the parameters "
                "at their initial values: a logit of ±inf or NaN masks or poisons its row "
                "instead of biasing it (mask with causal=True, window or attn_mask instead)"
            )
        steep = first_non_finite_gradient(
            parsed.tree,
            initial,
            trained=parsed.params,
            positions=range(CHECKED_POSITIONS),
            heads=at,
        )
        return None if steep is None else gradient_problem(steep, at_heads)

    def _heads_to_check(self, uses_h: bool, heads: int) -> list[int]:
        """The heads ``finiteness_problem`` evaluates: where every parameter starts from
        one value, the heads of ``checked_heads`` if the expression reads h, else head 0;
        where some list one value per head (as many as ``heads``), every head that differs
        from those before it, in its values or, if the expression reads h, in h."""
        lists = [param.initial for param in self.params.values()]
        per_head = [values for values in lists if isinstance(values, tuple)]
        if not per_head:
            return checked_heads(heads) if uses_h else [0]
        seen: set[tuple[float, ...]] = set()
        distinct = []
        for head in range(heads):
            key = tuple(values[head] for values in per_head) + ((head,) if uses_h else ())
            if key not in seen:
                seen.add(key)
                distinct.append(head)
        return distinct

    def parsed(self) -> Parsed:
        """The checked expression (validated already, so this cannot fail)."""
        infos = {name: ParamInfo(per_head=param.per_head) for name, param in self.params.items()}
        return parse_expr(self.expr, infos)


SAFE_FORM_EXAMPLE = "log(where(i > j, i - j, 1))"
"""The guard a message shows where it cannot write one for the expression at hand."""


def gradient_problem(bad: NonFiniteGradient, at_heads: str = "") -> str:
    """The refusal of an expression bias whose parameter ``bad.param`` has a NaN or
    infinite gradient at a checked point, at the initial parameters (the rule of
    ``first_non_finite_gradient``): training would make that parameter NaN at its first
    step. Where the cause lies in a where() branch that the condition does not select,
    the message says so and shows the guarded form, the argument selected instead of
    the result (log(where(i > j, i - j, 1)))."""
    precision = " in float32 (finite in float64)" if bad.float32 else ""
    head = (
        f"the gradient of parameter {quoted(bad.param)} is {bad.gradient}{precision} at "
        f"i = {bad.i}, j = {bad.j}, h = {bad.h}{at_heads} with the parameters at their "
        "initial values, so training turns it into NaN at the first step"
    )
    if bad.culprit is None:
        return f"{head}; keep the expression's intermediate values within float range"
    culprit = ast.unparse(bad.culprit)
    if math.isfinite(bad.culprit_value):
        meets = f"{culprit} = {bad.culprit_value}, whose slope there is not finite"
    else:
        meets = f"{culprit} = {bad.culprit_value}"
    if bad.masked_by is None:
        return (
            f"{head}: {meets}; keep each function's argument where its value and slope "
            f"are finite, e.g. {SAFE_FORM_EXAMPLE}"
        )
    branch = ast.unparse(bad.masked_by.args[bad.branch])
    safe = guarded_form(bad.culprit, bad.masked_by, bad.branch)
    return (
        f"{head}: torch computes both branches of where(), and here the unselected one, "
        f"{branch}, meets {meets}; times the zero gradient that branch gets, that is NaN. "
        f"Guard the argument instead: {safe or SAFE_FORM_EXAMPLE}"
    )


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


class TableNorm(KeywordModel):
    """Normalisation of the untied table rows before their projections.

    ``none``: the projections see p_i itself (the formula as printed in Ke et al. 2021);
    ``layer_norm``: LayerNorm(p_i) with a trained gain and shift, as the authors' code does.
    """

    kind: Literal["none", "layer_norm"]
    eps: float = Field(1e-5, ge=MIN_EPS, le=0.1, description=EPS_WHY)


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

    # any kind of table, so that _learned_only names the kind given; the schema says learned
    table: AbsoluteTable = Field(json_schema_extra={"properties": {"kind": {"const": "learned"}}})
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
