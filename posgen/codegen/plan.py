"""The resolved decomposition: typed building blocks that the templates render.

A plan decides everything about how an encoding's terms compose: which blocks the
module has, in which order they are built, which flags the shared runtime reads, which
methods each block renders. Templates only iterate over the blocks and render values.

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
from typing import ClassVar, Literal

from posgen.describe import (
    TermLine,
    input_description,
    scale_description,
    term_lines,
    value_lines,
)
from posgen.spec.model import (
    ClipIndex,
    ComplexOrderInput,
    DepthwiseConvTable,
    DistanceIndex,
    GlobalContentTerm,
    GlobalPositionTerm,
    HierarchicalTable,
    LearnedRelativeTable,
    LearnedTable,
    LearnedTableBias,
    LinearSlopeBias,
    LogBuckets,
    OdeTable,
    RelativeTerm,
    RelativeValues,
    Rotation,
    Spec,
    SymmetricLogBuckets,
    TableInput,
    UntiedPositions,
    rotary_dim_for,
)
from posgen.spec.names import class_name_for, identifier

DOCSTRING_WIDTH = 88


class PlanError(ValueError):
    """A value that cannot be rendered safely (never reached by a validated spec)."""


def literal(value: object) -> str:
    """A plan value as Python source, formatted as ruff formats it.

    Finite floats and ints by ``repr``, booleans, None, ASCII-escaped double-quoted
    strings, and tuples of these; anything else (or a non-finite float) is refused.
    """
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


# --------------------------------------------------------------------------- block plans
#
# Every field is a typed Python value (bool, int, float, None, a word from a fixed set,
# or a tuple of those); templates render each through the one ``py`` filter
# (``literal``). Each block class names the macro file that renders it; that file
# exposes four macros, ``helpers`` (module level), ``init`` (constructor lines),
# ``methods`` and ``weights`` (checkpoint notes for the docstring), each taking the
# block.

Pairing = Literal["half", "interleaved"]
SinusoidLayout = Literal["interleaved", "split"]
Sign = Literal["key_minus_query", "query_minus_key"]
Placement = Literal["after_scale", "before_scale"]
Projection = Literal["none", "key", "query", "relative"]


@dataclass(frozen=True)
class Block:
    """A building block of a generated module; ``template`` is its macro file."""

    template: ClassVar[str]


@dataclass(frozen=True)
class AbsoluteTablePlan(Block):
    """An input-level table p combined with x (``embed``): x + p or x * p."""

    template: ClassVar[str] = "blocks/absolute_table.jinja"
    kind: Literal["learned", "sinusoidal", "hierarchical", "depthwise_conv", "ode"]
    combine: Literal["add", "multiply"] = "add"
    max_positions: int | None = None
    init_std: float | None = None
    init_mean: float = 0.0
    base: float | None = None
    layout: SinusoidLayout = "interleaved"
    base_positions: int | None = None
    alpha: float | None = None
    kernel_size: int | None = None
    hidden: int | None = None
    activation: Literal["relu", "tanh", "gelu", "sigmoid"] = "relu"
    integrator: Literal["euler", "rk4"] = "rk4"
    position_step: float | None = None
    steps_per_position: int | None = None
    initial: Literal["learned", "zero"] = "zero"
    padding: Literal["same", "causal"] = "same"
    conv_bias: bool = True
    conv_layout: Literal["sequence", "grid_2d"] = "sequence"


@dataclass(frozen=True)
class ComplexOrderPlan(Block):
    """Complex word-order embeddings (``embed`` returns real and imaginary parts)."""

    template: ClassVar[str] = "blocks/complex_order.jinja"
    learned: bool  # module-owned per-feature frequency and phase
    frequency_base: float | None = None


@dataclass(frozen=True)
class RotationPlan(Block):
    """Rotary position embedding of q and k."""

    template: ClassVar[str] = "blocks/rotation.jinja"
    base: float
    pairing: Pairing
    fraction: float


@dataclass(frozen=True)
class BucketIndexPlan:
    """T5's log-spaced buckets of a signed relative position."""

    buckets: int
    max_distance: int
    max_exact: int
    bidirectional: bool
    sign: Sign


@dataclass(frozen=True)
class SlopeBiasPlan(Block):
    """bias[h, i, j] = -slope_h * |i - j| with ALiBi's geometric slopes."""

    template: ClassVar[str] = "blocks/slope_bias.jinja"
    placement: Placement
    slopes: Literal["alibi_geometric"]
    method: str = "_position_bias"  # the method that returns the [heads, N, M] bias
    public: bool = True  # also render ``score_bias`` (False inside an untied term)


@dataclass(frozen=True)
class TableBiasPlan(Block):
    """bias[h, i, j] = table[bucket(i, j), h], a trained scalar per (bucket, head)."""

    template: ClassVar[str] = "blocks/bias_table.jinja"
    placement: Placement
    index: BucketIndexPlan
    init_std: float
    method: str = "_position_bias"
    public: bool = True
    spare_row: bool = False  # one extra row for the untied first-token reset
    document_weights: bool = True  # False where the untied block documents the table


@dataclass(frozen=True)
class UntiedPlan(Block):
    """TUPE's untied absolute term, with an optional relative bias beside it."""

    template: ClassVar[str] = "blocks/untied_absolute.jinja"
    max_positions: int
    init_std: float
    norm: Literal["none", "layer_norm"]
    norm_eps: float
    projection_bias: bool
    first_token: Literal["shared", "reset"]
    bias: SlopeBiasPlan | TableBiasPlan | None = None


@dataclass(frozen=True)
class RelativeIndexPlan:
    kind: Literal["clip", "log_buckets", "distance"]
    rows: int | None  # None for distance: as many rows as distances present
    max_distance: int | None = None
    buckets: int | None = None


@dataclass(frozen=True)
class RelativeTablePlan:
    kind: Literal["learned", "sinusoidal"]
    width: Literal["head_dim", "model_dim"]
    per_head: bool = False
    norm_eps: float | None = None
    init_std: float | None = None
    base: float | None = None
    layout: SinusoidLayout = "split"


@dataclass(frozen=True)
class RelativeTermPlan:
    """One term that reads the relative table: (query-side vector) . P(R)[index(r)]."""

    term: Literal["content_position", "position_content", "position_position"]
    side: Literal["query", "key", "global"]
    sign: Sign
    projection: Projection
    placement: Placement
    init_std: float = 0.02


@dataclass(frozen=True)
class GlobalContentPlan:
    placement: Placement
    init_std: float


@dataclass(frozen=True)
class ValueTermPlan:
    sign: Sign
    per_head: bool
    init_std: float


@dataclass(frozen=True)
class RelativePlan(Block):
    """Relative terms gathered from a table of relative rows, and a value term."""

    template: ClassVar[str] = "blocks/relative_table.jinja"
    index: RelativeIndexPlan | None
    table: RelativeTablePlan | None
    terms: tuple[RelativeTermPlan, ...]
    global_content: GlobalContentPlan | None
    values: ValueTermPlan | None
    projections: tuple[Projection, ...]  # sorted projection words used (key, query, relative)
    shift: bool  # distance index read with query_minus_key: the pad-and-reshape shift
    renders_score_bias: bool  # its global position term is the module's position-only bias

    @property
    def position_only(self) -> RelativeTermPlan | None:
        """The global position_position term, the only position-only relative term."""
        return next((term for term in self.terms if term.side == "global"), None)


@dataclass(frozen=True)
class ConstructorArgument:
    """An encoding-specific constructor argument beside heads and head_dim."""

    name: str
    annotation: str  # a type written in the template's own words: "int" or "int | None"
    default: int | None
    doc: str


@dataclass(frozen=True)
class ModulePlan:
    module_name: str
    class_name: str
    spec_file: str  # the spec's file name: generated bytes never depend on the cwd
    spec_sha256: str  # validated lowercase hex
    title_lines: tuple[str, ...]
    reference_lines: tuple[tuple[str, ...], ...]
    model_lines: tuple[str, ...]
    decomposition_lines: tuple[str, ...]
    input_lines: tuple[str, ...]
    scale_text: str
    heads: int
    head_dim: int
    scale_factor: float | None  # logits scaled by 1/sqrt(factor * head_dim); None: unscaled
    arguments: tuple[ConstructorArgument, ...]
    blocks: tuple[Block, ...]
    flags: tuple[tuple[str, bool], ...]  # PositionalAttention's composition flags


def _complex_order_plan(form: ComplexOrderInput) -> ComplexOrderPlan:
    learned = form.module_parameters == "learned_per_feature"
    base = float(form.frequency_base) if form.frequency_base is not None else None
    return ComplexOrderPlan(learned=learned, frequency_base=base)


def _absolute_table_plan(form: TableInput) -> AbsoluteTablePlan:
    table = form.table
    combine = form.kind
    if isinstance(table, LearnedTable):
        return AbsoluteTablePlan(
            kind="learned",
            combine=combine,
            max_positions=table.max_positions,
            init_std=float(table.init_std),
            init_mean=float(table.init_mean),
        )
    if isinstance(table, OdeTable):
        return AbsoluteTablePlan(
            kind="ode",
            combine=combine,
            max_positions=table.max_positions,
            init_std=float(table.init_std),
            hidden=table.hidden,
            activation=table.activation,
            integrator=table.integrator,
            position_step=float(table.position_step),
            steps_per_position=table.steps_per_position,
            initial=table.initial,
        )
    if isinstance(table, DepthwiseConvTable):
        return AbsoluteTablePlan(
            kind="depthwise_conv",
            combine=combine,
            kernel_size=table.kernel_size,
            padding=table.padding,
            conv_bias=table.bias,
            conv_layout=table.layout,
        )
    if isinstance(table, HierarchicalTable):
        return AbsoluteTablePlan(
            kind="hierarchical",
            combine=combine,
            base_positions=table.base_positions,
            alpha=float(table.alpha),
            init_std=float(table.init_std),
        )
    return AbsoluteTablePlan(
        kind="sinusoidal", combine=combine, base=float(table.base), layout=table.layout
    )


def _rotation_plan(rotation: Rotation) -> RotationPlan:
    return RotationPlan(
        base=float(rotation.base),
        pairing=rotation.pairing,
        fraction=float(rotation.rotary_dims.fraction),
    )


def _bucket_plan(index: LogBuckets) -> BucketIndexPlan:
    return BucketIndexPlan(
        buckets=index.buckets,
        max_distance=index.max_distance,
        max_exact=index.max_exact,
        bidirectional=index.bidirectional,
        sign=index.sign,
    )


def _bias_plan(
    bias: LinearSlopeBias | LearnedTableBias, untied: UntiedPositions | None
) -> SlopeBiasPlan | TableBiasPlan:
    """The bias block; beside an untied term it is read by that term, not by the runtime."""
    method, public = ("_relative_bias", False) if untied is not None else ("_position_bias", True)
    if isinstance(bias, LinearSlopeBias):
        return SlopeBiasPlan(
            placement=bias.placement, slopes=bias.slopes, method=method, public=public
        )
    return TableBiasPlan(
        placement=bias.placement,
        index=_bucket_plan(bias.index),
        init_std=float(bias.init_std),
        method=method,
        public=public,
        spare_row=untied is not None and untied.first_token == "reset",
        document_weights=untied is None,
    )


def _untied_plan(untied: UntiedPositions, bias: SlopeBiasPlan | TableBiasPlan | None) -> UntiedPlan:
    return UntiedPlan(
        max_positions=untied.table.max_positions,
        init_std=float(untied.table.init_std),
        norm=untied.norm.kind,
        norm_eps=float(untied.norm.eps),
        projection_bias=untied.projection_bias,
        first_token=untied.first_token,
        bias=bias,
    )


def _relative_terms(spec: Spec) -> tuple[list[RelativeTermPlan], GlobalContentPlan | None]:
    terms: list[RelativeTermPlan] = []
    global_content = None
    sides: dict[str, Literal["query", "key"]] = {
        "content_position": "query",
        "position_content": "key",
    }
    names: tuple[Literal["content_position", "position_content", "position_position"], ...] = (
        "content_position",
        "position_content",
        "position_position",
    )
    for term in names:
        value = getattr(spec.terms, term)
        side: Literal["query", "key", "global"]
        if isinstance(value, RelativeTerm):
            reader = value.relative
            side = sides[term]
        elif isinstance(value, GlobalPositionTerm):
            reader = value.global_
            side = "global"
        elif isinstance(value, GlobalContentTerm):
            global_content = GlobalContentPlan(
                placement=value.global_.placement, init_std=float(value.global_.init_std)
            )
            continue
        else:
            continue
        terms.append(
            RelativeTermPlan(
                term=term,
                side=side,
                sign=reader.sign,
                projection=reader.projection,
                placement=reader.placement,
                init_std=float(getattr(reader, "init_std", 0.02)),
            )
        )
    return terms, global_content


def _relative_index_plan(spec: Spec) -> tuple[RelativeIndexPlan | None, RelativeTablePlan | None]:
    section = spec.relative
    if section is None:
        return None, None
    index = section.index
    index_plan: RelativeIndexPlan
    if isinstance(index, ClipIndex):
        index_plan = RelativeIndexPlan("clip", index.rows, max_distance=index.max_distance)
    elif isinstance(index, SymmetricLogBuckets):
        index_plan = RelativeIndexPlan(
            "log_buckets", index.rows, max_distance=index.max_distance, buckets=index.buckets
        )
    else:
        assert isinstance(index, DistanceIndex)
        index_plan = RelativeIndexPlan("distance", None)
    table = section.table
    table_plan: RelativeTablePlan | None
    if table is None:
        table_plan = None
    elif isinstance(table, LearnedRelativeTable):
        table_plan = RelativeTablePlan(
            kind="learned",
            width=table.width,
            per_head=table.heads == "per_head",
            norm_eps=float(table.norm.eps) if table.norm else None,
            init_std=float(table.init_std),
        )
    else:
        table_plan = RelativeTablePlan(
            kind="sinusoidal", width="model_dim", base=float(table.base), layout=table.layout
        )
    return index_plan, table_plan


def _relative_plan(spec: Spec, has_bias: bool) -> RelativePlan | None:
    terms, global_content = _relative_terms(spec)
    values = None
    if isinstance(spec.values, RelativeValues):
        values = ValueTermPlan(
            sign=spec.values.relative.sign,
            per_head=spec.values.relative.heads == "per_head",
            init_std=float(spec.values.relative.init_std),
        )
    if not terms and global_content is None and values is None:
        return None
    index_plan, table_plan = _relative_index_plan(spec)
    projections = tuple(sorted({t.projection for t in terms} - {"none"}))
    shift = (
        index_plan is not None
        and index_plan.kind == "distance"
        and any(t.side == "query" and t.sign == "query_minus_key" for t in terms)
    )
    has_global_position = any(t.side == "global" for t in terms)
    return RelativePlan(
        index=index_plan,
        table=table_plan,
        terms=tuple(terms),
        global_content=global_content,
        values=values,
        projections=projections,
        shift=shift,
        renders_score_bias=has_global_position and not has_bias,
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
        rotary_dim_for(spec.defaults.head_dim, spec.rotation.rotary_dims.fraction)
        blocks.append(_rotation_plan(spec.rotation))
    bias = _bias_plan(spec.bias, spec.untied) if spec.bias is not None else None
    if bias is not None:
        blocks.append(bias)
    if spec.untied is not None:
        blocks.append(_untied_plan(spec.untied, bias))
    relative = _relative_plan(spec, has_bias=bias is not None or spec.untied is not None)
    if relative is not None:
        blocks.append(relative)
    return tuple(blocks)


def _flags(blocks: tuple[Block, ...]) -> tuple[tuple[str, bool], ...]:
    """The composition flags the runtime's PositionalAttention reads."""
    untied = any(isinstance(block, UntiedPlan) for block in blocks)
    bias = next((b for b in blocks if isinstance(b, (SlopeBiasPlan, TableBiasPlan))), None)
    relative = next((b for b in blocks if isinstance(b, RelativePlan)), None)
    has_position_bias = untied or bias is not None
    return (
        ("checks_heads", has_position_bias or relative is not None),
        ("has_position_bias", has_position_bias),
        (
            "position_bias_inside_scale",
            not untied and bias is not None and bias.placement == "before_scale",
        ),
        ("has_rotation", any(isinstance(block, RotationPlan) for block in blocks)),
        ("has_relative_terms", relative is not None),
        ("has_value_term", relative is not None and relative.values is not None),
    )


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
        arguments.append(ConstructorArgument("value_dim", "int | None", None, doc))
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
        spec_file=spec_file,
        spec_sha256=choice_hex(spec_sha256),
        title_lines=tuple(docstring_lines(spec.title)),
        reference_lines=tuple(
            tuple(docstring_lines(ref, DOCSTRING_WIDTH - 6)) for ref in spec.references
        ),
        model_lines=tuple(docstring_lines(", ".join(spec.models))) if spec.models else (),
        decomposition_lines=tuple(decomposition_table(term_lines(spec) + value_lines(spec))),
        input_lines=tuple(docstring_lines(input_description(spec) or "", DOCSTRING_WIDTH - 4)),
        scale_text=" ".join(docstring_lines(scale_description(spec), 10_000)),
        heads=spec.defaults.heads,
        head_dim=spec.defaults.head_dim,
        scale_factor=None if spec.scale.kind == "none" else float(spec.scale.factor),
        arguments=_arguments(spec, blocks),
        blocks=blocks,
        flags=_flags(blocks),
    )


def choice_hex(value: str) -> str:
    """A lowercase hex digest."""
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise PlanError(f"{value!r} is not a sha256 hex digest")
    return value
