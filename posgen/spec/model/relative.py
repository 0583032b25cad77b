"""Relative tables read by key-minus-query distance (Shaw, BERT, DeBERTa,
Transformer-XL), their global vectors and value-side term, and CoPE's contextual
positions.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from posgen.spec.model.base import (
    BASE_WHY,
    EPS_WHY,
    MAX_BASE,
    MIN_EPS,
    SpecModel,
    cross_field_error,
    init_std,
)

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
        json_schema_extra={"multipleOf": 2},  # even: checked by _check_ranges
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
    eps: float = Field(ge=MIN_EPS, le=0.1, description=EPS_WHY)


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
    init_std: float = init_std(0.02)

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
    base: float = Field(gt=1, le=MAX_BASE, description=BASE_WHY)
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
    init_std: float = init_std(0.02)


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
    init_std: float = init_std(0.02)


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
    init_std: float = init_std(0.02)


class RelativeValues(SpecModel):
    """values: a relative value term (Shaw et al. 2018)."""

    relative: RelativeValuesSpec

    @property
    def form(self) -> str:
        return "relative"


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
    init_std: float = init_std(0.02)


class ContextualTerm(SpecModel):
    """content_position from contextual (counted) positions: CoPE."""

    contextual: ContextualPositions

    @property
    def form(self) -> str:
        return "contextual"
