"""The resolved decomposition: the builders that turn a spec into typed blocks.

A plan decides everything about how an encoding's terms compose: which blocks the
module has (classes in ``posgen.codegen.blocks``, each naming its macro file), in which
order they are built, which flags the shared runtime reads, which methods each block
renders, and every convention inside a block, as a boolean or a small typed value.
Templates only iterate over the blocks, test booleans and None, and render values.

A plan holds only typed values, so no spec can inject code:
- identifiers checked by ``posgen.spec.names.identifier``;
- finite numbers, booleans, None, words from a fixed set, and tuples of these, all
  rendered by one filter, ``literal`` (``py`` in the templates);
- free text escaped for a docstring by ``docstring_lines`` (the only path for free text).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Literal

from posgen.codegen.blocks import (
    AbsoluteTablePlan,
    Block,
    BucketIndexPlan,
    ClipIndexPlan,
    ComplexOrderPlan,
    ContextualPlan,
    DepthwiseConvPlan,
    DistanceIndexPlan,
    ExprBiasPlan,
    ExprParamPlan,
    FirePlan,
    FloorLogQueryScalePlan,
    GlobalContentPlan,
    HierarchicalTablePlan,
    InputTable,
    KerplePlan,
    LearnedRelativeTablePlan,
    LearnedTablePlan,
    LogLengthQueryScalePlan,
    OdeTablePlan,
    ProjectionPlan,
    QueryScalePlan,
    RandomizedPositionsPlan,
    RelativeIndex,
    RelativePlan,
    RelativeTable,
    RelativeTermPlan,
    RotationPlan,
    SandwichPlan,
    Side,
    SinusoidalRelativeTablePlan,
    SinusoidalTablePlan,
    SlopeBiasPlan,
    SymmetricLogIndexPlan,
    TableBiasPlan,
    TermName,
    TrainedLogQueryScalePlan,
    UntiedPlan,
    ValueTermPlan,
)
from posgen.codegen.expr_cost import DISTANCE_VECTOR_MIN_WORK, per_head_pair_work
from posgen.codegen.rotation_plan import rotation_plan
from posgen.describe import (
    TermLine,
    input_description,
    positions_description,
    query_scale_description,
    scale_description,
    term_lines,
    value_lines,
)
from posgen.spec.expr import render_steps
from posgen.spec.model import (
    AnyBias,
    ClipIndex,
    ComplexOrderInput,
    DepthwiseConvTable,
    DistanceIndex,
    ExprBias,
    ExprParam,
    FireBias,
    FloorLogQueryScale,
    GlobalContentTerm,
    GlobalPositionSpec,
    GlobalPositionTerm,
    HierarchicalTable,
    KerpleBias,
    LearnedRelativeTable,
    LearnedTable,
    LinearSlopeBias,
    LogBuckets,
    LogLengthQueryScale,
    OdeTable,
    RelativeTerm,
    RelativeTermSpec,
    RelativeValues,
    SandwichBias,
    SinusoidalRelativeTable,
    SinusoidalTable,
    Spec,
    SymmetricLogBuckets,
    TableInput,
    UntiedPositions,
)
from posgen.spec.names import class_name_for, identifier

DOCSTRING_WIDTH = 88
LINE_LENGTH = 100  # ruff's line length for generated code


class PlanError(ValueError):
    """A value that cannot be rendered safely (never reached by a validated spec)."""


def literal(value: object, column: int = 0) -> str:
    """A plan value as Python source, formatted as ruff formats it.

    Finite floats and ints by ``repr``, booleans, None, ASCII-escaped double-quoted
    strings, and tuples of these; anything else (or a non-finite float) is refused.
    ``column``: where the literal starts on a module-level line (``NAME = `` before it);
    a tuple that would pass the line length there is written one item per line.
    """
    if isinstance(value, tuple) and len(value) > 1 and column:
        flat = literal(value)
        if column + len(flat) > LINE_LENGTH:
            return "(\n" + "".join(f"    {literal(item)},\n" for item in value) + ")"
        return flat
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PlanError(f"non-finite number {value!r}")
        return repr(value)
    if isinstance(value, str):
        return python_string(value)
    if isinstance(value, tuple):
        items = [literal(item) for item in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    raise PlanError(f"{value!r} cannot be rendered as a literal")


def python_string(value: str) -> str:
    """A double-quoted, pure-ASCII Python string literal for any text."""
    return json.dumps(value, ensure_ascii=True)


def _escape_char(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char == '"':
        return '\\"'
    if " " <= char <= "~":
        return char
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def docstring_lines(text: str, width: int = DOCSTRING_WIDTH) -> list[str]:
    """Escape free text for a docstring body and wrap it to ``width`` escaped columns.

    Every character outside printable ASCII becomes an escape sequence, and backslashes
    and double quotes are escaped, so the text cannot close the docstring, start a new
    line of code, or smuggle a line separator. Wrapping never splits an escape.
    """
    lines: list[str] = []
    current = ""
    for raw_word in text.split():
        pieces: list[str] = [""]
        for token in (_escape_char(ch) for ch in raw_word):
            if pieces[-1] and len(pieces[-1]) + len(token) > width:
                pieces.append("")
            pieces[-1] += token
        for word in pieces:
            if current and len(current) + 1 + len(word) > width:
                lines.append(current)
                current = word
            else:
                current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return lines


@dataclass(frozen=True)
class ConstructorArgument:
    """An encoding-specific constructor argument beside heads and head_dim."""

    name: str
    annotation: str  # a type written in the template's own words: "int" or "int | None"
    default: int | None
    doc: str
    most: str = "MAX_MODEL_DIM"  # the runtime's constant bounding it


#: a composition flag's value: a switch, a distance, attribute names, or None (unset)
FlagValue = bool | int | tuple[str, ...] | None


@dataclass(frozen=True)
class ModulePlan:
    """Everything module.py.jinja renders for one spec."""

    module_name: str
    class_name: str
    spec_file: str  # the spec's file name (printable ASCII): bytes never depend on the cwd
    spec_sha256: str  # validated lowercase hex
    title_lines: tuple[str, ...]
    reference_lines: tuple[tuple[str, ...], ...]
    model_lines: tuple[str, ...]
    decomposition_lines: tuple[str, ...]
    input_lines: tuple[str, ...]
    query_scale_lines: tuple[str, ...]  # the query scale in words, or ()
    positions_lines: tuple[str, ...]  # default positions in words where not 0 .. M - 1, or ()
    scale_text: str
    heads: int
    head_dim: int
    scale_factor: float | None  # logits scaled by 1/sqrt(factor * head_dim); None: unscaled
    arguments: tuple[ConstructorArgument, ...]
    blocks: tuple[Block, ...]
    flags: tuple[tuple[str, FlagValue], ...]  # PositionalAttention's composition flags

    @property
    def patch_grid(self) -> bool:
        """2-D axial RoPE: the usage example passes ``grid_positions``."""
        return any(isinstance(block, RotationPlan) and block.patch_grid for block in self.blocks)


# --------------------------------------------------------------------------- builders
#
# One builder per block: each reads the validated spec and computes every decision its
# macro file needs, as a boolean or a small typed value (see posgen.codegen.blocks).

# The layer that projects model_dim rows for each projection word, and whether it has
# a bias; in this order (key, query, relative) the layers are built.
PROJECTION_LAYERS: dict[Literal["key", "query", "relative"], tuple[str, bool]] = {
    "key": ("pos_key_proj", True),
    "query": ("pos_query_proj", True),
    "relative": ("r_net", False),
}


def _complex_order_plan(form: ComplexOrderInput) -> ComplexOrderPlan:
    learned = form.module_parameters == "learned_per_feature"
    base = float(form.frequency_base) if form.frequency_base is not None else None
    return ComplexOrderPlan(learned=learned, frequency_base=base)


def _ode_table_plan(table: OdeTable) -> OdeTablePlan:
    return OdeTablePlan(
        max_positions=table.max_positions,
        init_std=float(table.init_std),
        hidden=table.hidden,
        activation=table.activation,
        uses_rk4=table.integrator == "rk4",
        position_step=float(table.position_step),
        steps_per_position=table.steps_per_position,
        learns_initial_position=table.initial == "learned",
    )


def _input_table_plan(
    table: LearnedTable | SinusoidalTable | HierarchicalTable | DepthwiseConvTable | OdeTable,
) -> InputTable:
    """The variant plan of an input-level table, one class per table kind."""
    if isinstance(table, LearnedTable):
        return LearnedTablePlan(
            max_positions=table.max_positions,
            init_std=float(table.init_std),
            init_mean=float(table.init_mean),
        )
    if isinstance(table, OdeTable):
        return _ode_table_plan(table)
    if isinstance(table, DepthwiseConvTable):
        return DepthwiseConvPlan(
            kernel_size=table.kernel_size,
            padding=table.padding,
            bias=table.bias,
            grid_2d=table.layout == "grid_2d",
        )
    if isinstance(table, HierarchicalTable):
        return HierarchicalTablePlan(
            base_positions=table.base_positions,
            alpha=float(table.alpha),
            init_std=float(table.init_std),
        )
    return SinusoidalTablePlan(base=float(table.base), layout=table.layout)


def _absolute_table_plan(form: TableInput) -> AbsoluteTablePlan:
    return AbsoluteTablePlan(table=_input_table_plan(form.table), multiply=form.kind == "multiply")


def _bucket_plan(index: LogBuckets) -> BucketIndexPlan:
    return BucketIndexPlan(
        buckets=index.buckets,
        max_distance=index.max_distance,
        max_exact=index.max_exact,
        bidirectional=index.bidirectional,
        key_minus_query=index.sign == "key_minus_query",
    )


BiasBlock = SlopeBiasPlan | TableBiasPlan | KerplePlan | FirePlan | SandwichPlan | ExprBiasPlan
BIAS_BLOCKS = (SlopeBiasPlan, TableBiasPlan, KerplePlan, FirePlan, SandwichPlan, ExprBiasPlan)
# biases of j - i alone: the runtime's sdpa path takes them per distance (``_distance_bias``)


def _inverse_softplus(value: float) -> float:
    """x with softplus(x) = value > 0 (exact for large values, stable for small ones)."""
    return value + math.log(-math.expm1(-value))


def _raw_initial(param: ExprParam) -> float | tuple[float, ...]:
    """The value a parameter is stored at (softplus^-1 of a positive one's init), or one
    per head where the spec lists them."""

    def stored(value: float) -> float:
        return float(_inverse_softplus(value) if param.positive else value)

    initial = param.initial
    return (
        tuple(stored(value) for value in initial) if isinstance(initial, tuple) else stored(initial)
    )


def _expr_plan(bias: ExprBias, inside_scale: bool) -> ExprBiasPlan:
    parsed = bias.parsed()
    steps, result = render_steps(parsed)
    per_head = frozenset(name for name, param in bias.params.items() if param.per_head)
    params = tuple(
        ExprParamPlan(
            name=identifier(name),
            per_head=param.per_head,
            raw_init=_raw_initial(param),
            positive=param.positive,
            bounds=(float(param.bounds[0]), float(param.bounds[1])) if param.bounds else None,
        )
        for name, param in bias.params.items()
    )
    return ExprBiasPlan(
        inside_scale=inside_scale,
        expression=bias.expr,
        params=params,
        steps=steps,
        result=result,
        uses_i=parsed.uses_i,
        uses_j=parsed.uses_j,
        uses_h=parsed.uses_h,
        uses_heads=parsed.uses_heads,
        of_difference=parsed.of_difference,
        read_per_distance=parsed.of_difference
        and per_head_pair_work(parsed.tree.body, per_head) >= DISTANCE_VECTOR_MIN_WORK,
    )


def _bias_plan(bias: AnyBias, untied: UntiedPositions | None) -> BiasBlock:
    """The bias block; beside an untied term it is read by that term, not by the runtime."""
    name, public = ("_relative_bias", False) if untied is not None else ("_position_bias", True)
    method = identifier(name)
    inside_scale = bias.placement == "before_scale"
    if isinstance(bias, LinearSlopeBias):
        values = tuple(float(v) for v in bias.values) if bias.values is not None else None
        return SlopeBiasPlan(
            inside_scale=inside_scale,
            slopes=bias.slopes,
            method=method,
            public=public,
            custom_values=values,
            heads_with_bias=bias.heads_with_bias,
        )
    if isinstance(bias, KerpleBias):
        return KerplePlan(inside_scale=inside_scale, variant=bias.variant)
    if isinstance(bias, FireBias):
        return FirePlan(
            inside_scale=inside_scale,
            hidden=bias.hidden,
            init_c=float(bias.init_c),
            init_threshold=float(bias.init_threshold),
        )
    if isinstance(bias, SandwichBias):
        return SandwichPlan(
            inside_scale=inside_scale,
            dim=bias.dim,
            base=float(bias.base),
            divided=bias.per_head == "divided",
        )
    if isinstance(bias, ExprBias):
        return _expr_plan(bias, inside_scale)
    return TableBiasPlan(
        inside_scale=inside_scale,
        index=_bucket_plan(bias.index),
        init_std=float(bias.init_std),
        method=method,
        public=public,
        spare_row=untied is not None and untied.first_token == "reset",
        document_weights=untied is None,
    )


def _untied_plan(
    untied: UntiedPositions, bias: BiasBlock | None, beside_content_terms: bool
) -> UntiedPlan:
    table = untied.table
    if bias is not None and not isinstance(bias, (SlopeBiasPlan, TableBiasPlan)):
        raise PlanError("a bias beside an untied term is linear_slopes or learned_table")
    if not isinstance(table, LearnedTable):
        raise PlanError(f"an untied table must be learned, got {table.kind!r}")
    return UntiedPlan(
        max_positions=table.max_positions,
        init_std=float(table.init_std),
        layer_norm=untied.norm.kind == "layer_norm",
        norm_eps=float(untied.norm.eps),
        projection_bias=untied.projection_bias,
        first_token_reset=untied.first_token == "reset",
        bias=bias,
        beside_content_terms=beside_content_terms,
    )


Reader = tuple[TermName, Side, RelativeTermSpec | GlobalPositionSpec]  # (term, side, its spec)


def _relative_readers(spec: Spec) -> tuple[list[Reader], GlobalContentPlan | None]:
    """The terms that read the relative table, in term order, and the global content term."""
    readers: list[Reader] = []
    global_content = None
    names: tuple[TermName, ...] = ("content_position", "position_content", "position_position")
    sides: dict[TermName, Side] = {"content_position": "query", "position_content": "key"}
    for term in names:
        value = getattr(spec.terms, term)
        if isinstance(value, RelativeTerm):
            readers.append((term, sides[term], value.relative))
        elif isinstance(value, GlobalPositionTerm):
            readers.append((term, "global", value.global_))
        elif isinstance(value, GlobalContentTerm):
            global_content = GlobalContentPlan(
                scaled_inside=value.global_.placement == "before_scale",
                init_std=float(value.global_.init_std),
            )
    return readers, global_content


def _relative_term_plans(
    readers: list[Reader], distance_index: bool
) -> tuple[RelativeTermPlan, ...]:
    """One plan per reader; consecutive terms share the index map and rows they can."""
    plans: list[RelativeTermPlan] = []
    last_sign: str | None = None
    last_projection: str | None = None
    for term, side, reader in readers:
        new_index = reader.sign != last_sign
        plans.append(
            RelativeTermPlan(
                term=term,
                side=side,
                sign=reader.sign,
                projection=reader.projection,
                scaled_inside=reader.placement == "before_scale",
                init_std=float(reader.init_std if isinstance(reader, GlobalPositionSpec) else 0.02),
                new_index=new_index,
                new_rows=new_index or reader.projection != last_projection,
                relative_shift=(
                    distance_index and side == "query" and reader.sign == "query_minus_key"
                ),
            )
        )
        last_sign, last_projection = reader.sign, reader.projection
    return tuple(plans)


def _relative_index_plan(index: ClipIndex | SymmetricLogBuckets | DistanceIndex) -> RelativeIndex:
    """The variant plan of a relative index, one class per index kind."""
    if isinstance(index, ClipIndex):
        return ClipIndexPlan(max_distance=index.max_distance, rows=index.rows)
    if isinstance(index, SymmetricLogBuckets):
        return SymmetricLogIndexPlan(
            max_distance=index.max_distance, buckets=index.buckets, rows=index.rows
        )
    return DistanceIndexPlan()


def _relative_table_plan(
    table: LearnedRelativeTable | SinusoidalRelativeTable | None,
) -> RelativeTable | None:
    """The variant plan of the relative table, one class per table kind."""
    if table is None:
        return None
    if isinstance(table, LearnedRelativeTable):
        return LearnedRelativeTablePlan(
            model_width=table.width == "model_dim",
            per_head=table.heads == "per_head",
            norm_eps=float(table.norm.eps) if table.norm else None,
            init_std=float(table.init_std),
        )
    return SinusoidalRelativeTablePlan(base=float(table.base), layout=table.layout)


def _projection_plans(terms: tuple[RelativeTermPlan, ...]) -> tuple[ProjectionPlan, ...]:
    """The projection layers the terms use, each built once."""
    used = {term.projection for term in terms}
    return tuple(
        ProjectionPlan(name=name, layer=identifier(layer), has_bias=has_bias)
        for name, (layer, has_bias) in PROJECTION_LAYERS.items()
        if name in used
    )


def _value_term_plan(spec: Spec) -> ValueTermPlan | None:
    values: object = spec.values  # "plain" or RelativeValues
    if not isinstance(values, RelativeValues):
        return None
    return ValueTermPlan(
        sign=values.relative.sign,
        per_head=values.relative.heads == "per_head",
        init_std=float(values.relative.init_std),
    )


def _relative_plan(spec: Spec, has_bias: bool) -> RelativePlan | None:
    readers, global_content = _relative_readers(spec)
    values = _value_term_plan(spec)
    if not readers and global_content is None and values is None:
        return None
    section = spec.relative
    index = _relative_index_plan(section.index) if section is not None else None
    table = _relative_table_plan(section.table) if section is not None else None
    terms = _relative_term_plans(readers, index is not None and index.rows_are_distances)
    return RelativePlan(
        index=index,
        table=table,
        terms=terms,
        global_content=global_content,
        values=values,
        projections=_projection_plans(terms),
        renders_score_bias=any(t.side == "global" for t in terms) and not has_bias,
        contextual=spec.contextual is not None,
    )


def decomposition_table(rows: list[TermLine], width: int = DOCSTRING_WIDTH) -> list[str]:
    """The four terms as aligned, escaped, wrapped text lines."""
    lines: list[str] = []
    indent = 18 + 1 + 9 + 1
    for row in rows:
        formula = docstring_lines(row.formula, width - indent)
        lines.append(f"{row.term:<18} {row.form:<9} {formula[0]}")
        lines.extend(" " * indent + rest for rest in formula[1:])
    return lines


def _blocks(spec: Spec) -> tuple[Block, ...]:
    """The module's blocks in construction order (which fixes parameter init order)."""
    blocks: list[Block] = []
    form = spec.input
    if isinstance(form, TableInput):
        blocks.append(_absolute_table_plan(form))
    elif isinstance(form, ComplexOrderInput):
        blocks.append(_complex_order_plan(form))
    if spec.rotation is not None:
        blocks.append(rotation_plan(spec.rotation))
    bias = _bias_plan(spec.bias, spec.untied) if spec.bias is not None else None
    relative = _relative_plan(spec, has_bias=bias is not None or spec.untied is not None)
    if spec.contextual is not None:
        blocks.append(
            ContextualPlan(
                max_positions=spec.contextual.max_positions,
                init_std=float(spec.contextual.init_std),
                beside_relative=relative is not None,
            )
        )
    if bias is not None:
        blocks.append(bias)
    if spec.untied is not None:
        # relative, global and CoPE terms read q and k: the untied term must not fold
        content_terms = relative is not None or spec.contextual is not None
        blocks.append(_untied_plan(spec.untied, bias, content_terms))
    if relative is not None:
        blocks.append(relative)
    if spec.positions is not None:  # last: no parameters, so init order is unchanged
        blocks.append(RandomizedPositionsPlan(max_positions=spec.positions.max_positions))
    if spec.query_scale is not None:  # last: its parameter draws no random numbers
        blocks.append(_query_scale_plan(spec))
    return tuple(blocks)


def _query_scale_plan(spec: Spec) -> QueryScalePlan:
    scale = spec.query_scale
    assert scale is not None
    if isinstance(scale, FloorLogQueryScale):
        return FloorLogQueryScalePlan(
            floor_scale=scale.floor_scale, attn_scale=float(scale.attn_scale)
        )
    if isinstance(scale, LogLengthQueryScale):
        return LogLengthQueryScalePlan(original_max_positions=scale.original_max_positions)
    return TrainedLogQueryScalePlan(init=float(scale.init))


def _flags(blocks: tuple[Block, ...]) -> tuple[tuple[str, FlagValue], ...]:
    """The composition flags the runtime's PositionalAttention reads."""
    untied_block = next((b for b in blocks if isinstance(b, UntiedPlan)), None)
    untied = untied_block is not None
    bias = next((b for b in blocks if isinstance(b, BIAS_BLOCKS)), None)
    relative = next((b for b in blocks if isinstance(b, RelativePlan)), None)
    has_position_bias = untied or bias is not None
    return (
        (
            "checks_heads",
            has_position_bias
            or relative is not None
            or any(isinstance(block, TrainedLogQueryScalePlan) for block in blocks),
        ),
        ("has_position_bias", has_position_bias),
        (
            "position_bias_inside_scale",
            not untied and bias is not None and bias.inside_scale,
        ),
        # a bias of j - i alone gives its per-distance vector (``_distance_bias``)
        ("bias_by_distance", not untied and bias is not None and bias.shift_invariant),
        # c_h |j - i|: ALiBi's slopes, which a fused kernel computes per score
        ("bias_linear_in_distance", not untied and isinstance(bias, SlopeBiasPlan)),
        # the per-distance vector's trained scalars, one per head each
        (
            "distance_bias_parameters",
            bias.distance_bias_parameters if bias is not None and not untied else (),
        ),
        # its entries at most 0, 0 at distance 0: no half-precision shift to find
        (
            "distance_bias_at_most_zero",
            bias is not None and not untied and bias.distance_bias_at_most_zero,
        ),
        # the position bias finite for finite parameters: a row the masks leave a key
        # reads one
        (
            "position_bias_finite",
            untied_block.position_bias_finite
            if untied_block is not None
            else bias is not None and bias.position_bias_finite,
        ),
        (
            # every bucket past max_distance is the last of its direction
            "clipped_distance",
            bias.index.max_distance if isinstance(bias, TableBiasPlan) and not untied else None,
        ),
        (
            "folds_position_bias",
            any(isinstance(block, UntiedPlan) and block.folds for block in blocks),
        ),
        ("has_rotation", any(isinstance(block, RotationPlan) for block in blocks)),
        # the call's largest position sets the frequencies, a masked key's too
        (
            "length_sets_frequencies",
            any(isinstance(b, RotationPlan) and b.frequencies.by_length for b in blocks),
        ),
        (
            "has_relative_terms",
            relative is not None or any(isinstance(b, ContextualPlan) for b in blocks),
        ),
        # CoPE with no other position term: the counted node adds no other term
        (
            "counted_terms_alone",
            any(isinstance(b, ContextualPlan) for b in blocks)
            and not has_position_bias
            and relative is None,
        ),
        ("has_value_term", relative is not None and relative.values is not None),
        ("relative_clip", _relative_clip(relative)),
        ("shift_invariant", all(block.shift_invariant for block in blocks)),
        ("has_query_scale", any(isinstance(block, QueryScalePlan) for block in blocks)),
    )


def _relative_clip(relative: RelativePlan | None) -> int | None:
    """The distance K past which every relative term's index reads one row per side.

    A clip index reads row clip(r, -K, K) + K. DeBERTa's log buckets with K =
    max_distance: for |r| >= K, log(|r| / mid) / log((K - 1) / mid) > 1, so the bucket's
    magnitude is at least mid + mid = buckets and the row clamps to 0 or 2 * buckets -
    1. A raw-distance index never repeats a row.
    """
    if relative is None or not isinstance(relative.index, (ClipIndexPlan, SymmetricLogIndexPlan)):
        return None
    return relative.index.max_distance


def _arguments(spec: Spec, blocks: tuple[Block, ...]) -> tuple[ConstructorArgument, ...]:
    """Constructor arguments beside heads and head_dim, with their docstring lines."""
    arguments: list[ConstructorArgument] = []
    model_dim = spec.defaults.model_dim
    if model_dim:
        if any(isinstance(block, UntiedPlan) for block in blocks):
            doc = "width of the untied position table, projected to heads * head_dim."
        elif any(isinstance(block, (AbsoluteTablePlan, ComplexOrderPlan)) for block in blocks):
            doc = "width of the token embeddings that ``embed`` adds positions to."
        else:
            doc = "width of the model-space relative position table."
        arguments.append(ConstructorArgument("model_dim", "int", model_dim, doc))
    relative = next((b for b in blocks if isinstance(b, RelativePlan)), None)
    if relative is not None and relative.values is not None:
        doc = "width of v and of the value-side table (default head_dim)."
        arguments.append(ConstructorArgument("value_dim", "int | None", None, doc, "MAX_HEAD_DIM"))
    return tuple(arguments)


def build_plan(spec: Spec, spec_file: str, spec_sha256: str) -> ModulePlan:
    """Resolve a validated spec into the plan that templates render.

    ``spec_file`` is the spec's file name alone (no folder), so that the generated
    bytes depend only on the spec's name and content.
    """
    module_name = identifier(spec.name)
    blocks = _blocks(spec)
    return ModulePlan(
        module_name=module_name,
        class_name=class_name_for(module_name),
        spec_file=printable(spec_file),
        spec_sha256=choice_hex(spec_sha256),
        title_lines=tuple(docstring_lines(spec.title)),
        reference_lines=tuple(
            tuple(docstring_lines(ref, DOCSTRING_WIDTH - 6)) for ref in spec.references
        ),
        model_lines=tuple(docstring_lines(", ".join(spec.models))) if spec.models else (),
        decomposition_lines=tuple(decomposition_table(term_lines(spec) + value_lines(spec))),
        input_lines=tuple(docstring_lines(input_description(spec) or "", DOCSTRING_WIDTH - 4)),
        query_scale_lines=tuple(
            docstring_lines(query_scale_description(spec) or "", DOCSTRING_WIDTH - 4)
        ),
        positions_lines=tuple(
            docstring_lines(positions_description(spec) or "", DOCSTRING_WIDTH - 4)
        ),
        scale_text=" ".join(docstring_lines(scale_description(spec), 10_000)),
        heads=spec.defaults.heads,
        head_dim=spec.defaults.head_dim,
        scale_factor=None if spec.scale.kind == "none" else float(spec.scale.factor),
        arguments=_arguments(spec, blocks),
        blocks=blocks,
        flags=_flags(blocks),
    )


def printable(value: str) -> str:
    """Text for a comment line: printable ASCII only, so it cannot end the comment."""
    if not all(" " <= char <= "~" for char in value):
        raise PlanError(f"{value!r} is not printable ASCII")
    return value


def choice_hex(value: str) -> str:
    """A lowercase hex digest."""
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise PlanError(f"{value!r} is not a sha256 hex digest")
    return value
