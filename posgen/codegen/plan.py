"""The resolved decomposition: what the templates render, and nothing else.

A plan holds only three kinds of value, so no spec can inject code:
- identifiers checked against ``^[A-Za-z_][A-Za-z0-9_]*$`` (ASCII, not a keyword, soft
  keyword or builtin);
- Python literals already rendered with ``repr()`` (finite numbers, booleans), or one of a
  fixed set of choice words that the spec model enumerates;
- free text escaped for a docstring by ``docstring_lines`` (the only path for free text).
"""

from __future__ import annotations

import builtins
import json
import keyword
import math
import re
from dataclasses import dataclass, field

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

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DOCSTRING_WIDTH = 88


class PlanError(ValueError):
    """A value that cannot be rendered safely (never reached by a validated spec)."""


def identifier(name: str) -> str:
    """Return ``name`` if it is a safe Python identifier for generated code."""
    if not _IDENTIFIER.match(name) or not name.isascii():
        raise PlanError(f"{name!r} is not an ASCII identifier")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or hasattr(builtins, name):
        raise PlanError(f"{name!r} is a Python keyword or builtin")
    return name


def literal(value: bool | int | float) -> str:
    """A finite number or boolean rendered as Python source."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PlanError(f"non-finite number {value!r}")
        return repr(value)
    raise PlanError(f"{value!r} is not a number or boolean")


def python_string(value: str) -> str:
    """A double-quoted, pure-ASCII Python string literal for any text."""
    return json.dumps(value, ensure_ascii=True)


def choice(value: str, allowed: tuple[str, ...]) -> str:
    """One of a fixed set of words (spec enums); anything else is rejected."""
    if value not in allowed:
        raise PlanError(f"{value!r} is not one of {allowed}")
    return value


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


@dataclass(frozen=True)
class AbsoluteTablePlan:
    kind: str  # learned | sinusoidal
    combine: str = "add"  # add | multiply
    max_positions: str = "None"
    init_std: str = "None"
    init_mean: str = "0.0"
    base: str = "None"
    layout: str = "interleaved"
    base_positions: str = "None"
    alpha: str = "None"
    kernel_size: str = "None"
    hidden: str = "None"
    activation: str = "relu"  # relu | tanh | gelu | sigmoid
    integrator: str = "rk4"  # euler | rk4
    position_step: str = "None"
    steps_per_position: str = "None"
    initial: str = "zero"  # learned | zero
    padding: str = "same"  # same | causal
    conv_bias: str = "True"
    conv_layout: str = "sequence"  # sequence | grid_2d


@dataclass(frozen=True)
class ComplexOrderPlan:
    learned: str  # "True" | "False": module-owned per-feature frequency and phase
    frequency_base: str = "None"


@dataclass(frozen=True)
class RotationPlan:
    base: str
    pairing: str  # half | interleaved
    fraction: str


@dataclass(frozen=True)
class BucketIndexPlan:
    buckets: str
    max_distance: str
    max_exact: str
    bidirectional: str
    sign: str  # key_minus_query | query_minus_key


@dataclass(frozen=True)
class BiasPlan:
    kind: str  # linear_slopes | learned_table
    placement: str  # after_scale | before_scale
    slopes: str = ""
    index: BucketIndexPlan | None = None
    init_std: str = "None"


@dataclass(frozen=True)
class UntiedPlan:
    max_positions: str
    init_std: str
    norm: str  # none | layer_norm
    norm_eps: str
    projection_bias: str  # True | False
    first_token: str  # shared | reset


@dataclass(frozen=True)
class RelativeIndexPlan:
    kind: str  # clip | log_buckets | distance
    rows: str  # repr int, or "None" for distance
    max_distance: str = "None"
    buckets: str = "None"


@dataclass(frozen=True)
class RelativeTablePlan:
    kind: str  # learned | sinusoidal
    width: str  # head_dim | model_dim
    per_head: bool = False
    norm_eps: str | None = None
    init_std: str = "None"
    base: str = "None"
    layout: str = "split"


@dataclass(frozen=True)
class RelativeTermPlan:
    """One term that reads the relative table: (query-side vector) . P(R)[index(r)]."""

    term: str  # content_position | position_content | position_position
    side: str  # query | key | global
    sign: str  # key_minus_query | query_minus_key
    projection: str  # none | key | query | relative
    placement: str  # after_scale | before_scale
    init_std: str = "None"


@dataclass(frozen=True)
class GlobalContentPlan:
    placement: str
    init_std: str


@dataclass(frozen=True)
class ValueTermPlan:
    sign: str
    per_head: bool
    init_std: str


@dataclass(frozen=True)
class RelativePlan:
    index: RelativeIndexPlan | None
    table: RelativeTablePlan | None
    terms: list[RelativeTermPlan]
    global_content: GlobalContentPlan | None
    values: ValueTermPlan | None
    projections: list[str]  # sorted projection words used (key, query, relative)
    shift: bool  # distance index read with query_minus_key: the pad-and-reshape shift

    @property
    def position_only(self) -> RelativeTermPlan | None:
        """The global position_position term, the only position-only relative term."""
        return next((term for term in self.terms if term.side == "global"), None)




@dataclass(frozen=True)
class ModulePlan:
    module_name: str
    class_name: str
    spec_path: str  # repr literal
    spec_sha256: str  # validated lowercase hex
    title_lines: list[str]
    reference_lines: list[list[str]]
    model_lines: list[str]
    decomposition_lines: list[str]
    input_lines: list[str]
    heads: str
    head_dim: str
    model_dim: str | None
    scale_kind: str  # none | inv_sqrt_head_dim
    scale_factor: str
    scale_text: str
    absolute_table: AbsoluteTablePlan | None
    rotation: RotationPlan | None
    bias: BiasPlan | None
    relative: RelativePlan | None = None
    blocks: list[str] = field(default_factory=list)
    untied: UntiedPlan | None = None

    @property
    def has_position_bias(self) -> bool:
        """Whether a position-only [heads, N, M] term exists (a bias or an untied term)."""
        return self.bias is not None or self.untied is not None

    @property
    def scale_position_bias(self) -> bool:
        """Whether _position_bias must still be multiplied by the logit scale.

        An untied term applies the scale itself (and places its bias), so its
        _position_bias is already in logit units.
        """
        return (
            self.untied is None
            and self.bias is not None
            and (self.bias.placement == "before_scale")
        )

    complex_order: ComplexOrderPlan | None = None


def class_name_for(module_name: str) -> str:
    """``rope_gptj`` → ``RopeGptj``; a leading digit part keeps its case (``t5`` → ``T5``)."""
    parts = [part for part in module_name.split("_") if part]
    return identifier("".join(part[:1].upper() + part[1:] for part in parts))


def _complex_order_plan(form: ComplexOrderInput) -> ComplexOrderPlan:
    learned = form.module_parameters == "learned_per_feature"
    base = literal(float(form.frequency_base)) if form.frequency_base is not None else "None"
    return ComplexOrderPlan(learned=literal(learned), frequency_base=base)


def _absolute_table_plan(form: TableInput) -> AbsoluteTablePlan:
    table = form.table
    combine = choice(form.kind, ("add", "multiply"))
    if isinstance(table, LearnedTable):
        return AbsoluteTablePlan(
            kind="learned",
            combine=combine,
            max_positions=literal(table.max_positions),
            init_std=literal(table.init_std),
            init_mean=literal(float(table.init_mean)),
        )
    if isinstance(table, OdeTable):
        return AbsoluteTablePlan(
            kind="ode",
            combine=combine,
            max_positions="None" if table.max_positions is None else literal(table.max_positions),
            init_std=literal(table.init_std),
            hidden=literal(table.hidden),
            activation=choice(table.activation, ("relu", "tanh", "gelu", "sigmoid")),
            integrator=choice(table.integrator, ("euler", "rk4")),
            position_step=literal(float(table.position_step)),
            steps_per_position=literal(table.steps_per_position),
            initial=choice(table.initial, ("learned", "zero")),
        )
    if isinstance(table, DepthwiseConvTable):
        return AbsoluteTablePlan(
            kind="depthwise_conv",
            combine=combine,
            kernel_size=literal(table.kernel_size),
            padding=choice(table.padding, ("same", "causal")),
            conv_bias=literal(table.bias),
            conv_layout=choice(table.layout, ("sequence", "grid_2d")),
        )
    if isinstance(table, HierarchicalTable):
        return AbsoluteTablePlan(
            kind="hierarchical",
            combine=combine,
            base_positions=literal(table.base_positions),
            alpha=literal(float(table.alpha)),
            init_std=literal(table.init_std),
        )
    return AbsoluteTablePlan(
        kind="sinusoidal",
        combine=combine,
        base=literal(float(table.base)),
        layout=choice(table.layout, ("interleaved", "split")),
    )


def _rotation_plan(rotation: Rotation) -> RotationPlan:
    return RotationPlan(
        base=literal(float(rotation.base)),
        pairing=choice(rotation.pairing, ("half", "interleaved")),
        fraction=literal(float(rotation.rotary_dims.fraction)),
    )


def _bucket_plan(index: LogBuckets) -> BucketIndexPlan:
    return BucketIndexPlan(
        buckets=literal(index.buckets),
        max_distance=literal(index.max_distance),
        max_exact=literal(index.max_exact),
        bidirectional=literal(index.bidirectional),
        sign=choice(index.sign, ("key_minus_query", "query_minus_key")),
    )


def _bias_plan(bias: LinearSlopeBias | LearnedTableBias) -> BiasPlan:
    placement = choice(bias.placement, ("after_scale", "before_scale"))
    if isinstance(bias, LinearSlopeBias):
        return BiasPlan(
            kind="linear_slopes",
            placement=placement,
            slopes=choice(bias.slopes, ("alibi_geometric",)),
        )
    return BiasPlan(
        kind="learned_table",
        placement=placement,
        index=_bucket_plan(bias.index),
        init_std=literal(bias.init_std),
    )


def _untied_plan(untied: UntiedPositions) -> UntiedPlan:
    return UntiedPlan(
        max_positions=literal(untied.table.max_positions),
        init_std=literal(untied.table.init_std),
        norm=choice(untied.norm.kind, ("none", "layer_norm")),
        norm_eps=literal(float(untied.norm.eps)),
        projection_bias=literal(untied.projection_bias),
        first_token=choice(untied.first_token, ("shared", "reset")),
    )






_SIGNS = ("key_minus_query", "query_minus_key")
_PLACEMENTS = ("after_scale", "before_scale")
_PROJECTIONS = ("none", "key", "query", "relative")


def _relative_plan(spec: Spec) -> RelativePlan | None:
    terms: list[RelativeTermPlan] = []
    global_content = None
    sides = {"content_position": "query", "position_content": "key"}
    for term in ("content_position", "position_content", "position_position"):
        value = getattr(spec.terms, term)
        if isinstance(value, RelativeTerm):
            reader = value.relative
            side = sides[term]
        elif isinstance(value, GlobalPositionTerm):
            reader = value.global_
            side = "global"
        elif isinstance(value, GlobalContentTerm):
            global_content = GlobalContentPlan(
                placement=choice(value.global_.placement, _PLACEMENTS),
                init_std=literal(value.global_.init_std),
            )
            continue
        else:
            continue
        terms.append(
            RelativeTermPlan(
                term=choice(term, ("content_position", "position_content", "position_position")),
                side=side,
                sign=choice(reader.sign, _SIGNS),
                projection=choice(reader.projection, _PROJECTIONS),
                placement=choice(reader.placement, _PLACEMENTS),
                init_std=literal(getattr(reader, "init_std", 0.02)),
            )
        )
    values = None
    if isinstance(spec.values, RelativeValues):
        values = ValueTermPlan(
            sign=choice(spec.values.relative.sign, _SIGNS),
            per_head=spec.values.relative.heads == "per_head",
            init_std=literal(spec.values.relative.init_std),
        )
    if not terms and global_content is None and values is None:
        return None
    section = spec.relative
    index_plan = table_plan = None
    if section is not None:
        index = section.index
        if isinstance(index, ClipIndex):
            index_plan = RelativeIndexPlan(
                "clip", literal(index.rows), max_distance=literal(index.max_distance)
            )
        elif isinstance(index, SymmetricLogBuckets):
            index_plan = RelativeIndexPlan(
                "log_buckets",
                literal(index.rows),
                max_distance=literal(index.max_distance),
                buckets=literal(index.buckets),
            )
        else:
            assert isinstance(index, DistanceIndex)
            index_plan = RelativeIndexPlan("distance", "None")
        table = section.table
        if table is None:
            table_plan = None
        elif isinstance(table, LearnedRelativeTable):
            table_plan = RelativeTablePlan(
                kind="learned",
                width=choice(table.width, ("head_dim", "model_dim")),
                per_head=table.heads == "per_head",
                norm_eps=literal(float(table.norm.eps)) if table.norm else None,
                init_std=literal(table.init_std),
            )
        else:
            table_plan = RelativeTablePlan(
                kind="sinusoidal",
                width="model_dim",
                base=literal(float(table.base)),
                layout=choice(table.layout, ("interleaved", "split")),
            )
    projections = sorted({t.projection for t in terms} - {"none"})
    shift = (
        index_plan is not None
        and index_plan.kind == "distance"
        and any(t.side == "query" and t.sign == "query_minus_key" for t in terms)
    )
    return RelativePlan(
        index=index_plan,
        table=table_plan,
        terms=terms,
        global_content=global_content,
        values=values,
        projections=projections,
        shift=shift,
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


def build_plan(spec: Spec, spec_path: str, spec_sha256: str) -> ModulePlan:
    """Resolve a validated spec into the plan that templates render."""
    module_name = identifier(spec.name)
    form = spec.input
    absolute_table = _absolute_table_plan(form) if isinstance(form, TableInput) else None
    complex_order = _complex_order_plan(form) if isinstance(form, ComplexOrderInput) else None
    rotation = _rotation_plan(spec.rotation) if spec.rotation else None
    bias = _bias_plan(spec.bias) if spec.bias else None
    untied = _untied_plan(spec.untied) if spec.untied else None
    relative = _relative_plan(spec)
    blocks = []
    if absolute_table is not None:
        blocks.append("absolute_table")
    if untied is not None:
        blocks.append("untied_absolute")
    if complex_order is not None:
        blocks.append("complex_order")
    if rotation is not None:
        blocks.append("rotation")
    if bias is not None:
        blocks.append(bias.kind)
    if relative is not None:
        blocks.append("relative_table")
    if rotation is not None:
        rotary_dim_for(spec.defaults.head_dim, spec.rotation.rotary_dims.fraction)
    return ModulePlan(
        module_name=module_name,
        class_name=class_name_for(module_name),
        spec_path=python_string(str(spec_path)),
        spec_sha256=choice_hex(spec_sha256),
        title_lines=docstring_lines(spec.title),
        reference_lines=[docstring_lines(ref, DOCSTRING_WIDTH - 6) for ref in spec.references],
        model_lines=docstring_lines(", ".join(spec.models)) if spec.models else [],
        decomposition_lines=decomposition_table(term_lines(spec) + value_lines(spec)),
        input_lines=docstring_lines(input_description(spec) or "", DOCSTRING_WIDTH - 4),
        heads=literal(spec.defaults.heads),
        head_dim=literal(spec.defaults.head_dim),
        model_dim=literal(spec.defaults.model_dim) if spec.defaults.model_dim else None,
        scale_kind=choice(spec.scale.kind, ("none", "inv_sqrt_head_dim")),
        scale_factor=literal(float(spec.scale.factor)),
        scale_text=" ".join(docstring_lines(scale_description(spec), 10_000)),
        absolute_table=absolute_table,
        rotation=rotation,
        bias=bias,
        relative=relative,
        blocks=blocks,
        untied=untied,
        complex_order=complex_order,
    )


def choice_hex(value: str) -> str:
    """A lowercase hex digest."""
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise PlanError(f"{value!r} is not a sha256 hex digest")
    return value
