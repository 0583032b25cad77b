"""Encodings in words: what ``posgen explain`` prints and generated docstrings quote.

Each function reads a validated spec and returns plain text (never code); the code
generator escapes it before it reaches a docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from posgen.spec.model import (
    AnyBias,
    AxialAxes,
    ClipIndex,
    ComplexOrderInput,
    ExprBias,
    ExprFrequencies,
    ExprParam,
    FireBias,
    FloorLogQueryScale,
    GlobalContentTerm,
    GlobalPositionTerm,
    KerpleBias,
    LearnedRelativeTable,
    LearnedTable,
    LearnedTableBias,
    LinearSlopeBias,
    LogLengthQueryScale,
    MultimodalSections,
    RelativeTerm,
    RelativeValues,
    Rotation,
    SandwichBias,
    Spec,
    SymmetricLogBuckets,
    UntiedPositions,
    rotary_dim_for,
)


@dataclass(frozen=True)
class TermLine:
    """One row of the decomposition table, as words for docstrings and ``explain``."""

    term: str
    form: str
    formula: str


def _slope_formula(bias: LinearSlopeBias) -> str:
    if bias.slopes == "alibi_geometric" and bias.heads_with_bias is None:
        return "-slope_h * |i - j|, slopes: alibi_geometric"
    words = {
        "alibi_geometric": "alibi_geometric",
        "learned": "learned (initially alibi_geometric)",
        "custom": f"custom {list(bias.values or [])}",
    }
    text = f"-slope_h * |i - j|, slopes: {words[bias.slopes]}"
    if bias.heads_with_bias is not None:
        text += f", on the first {bias.heads_with_bias} heads only (others: no bias)"
    return text


def _bias_formula(bias: AnyBias) -> str:
    if isinstance(bias, LinearSlopeBias):
        return _slope_formula(bias)
    if isinstance(bias, KerpleBias):
        if bias.variant == "log":
            return "-r1_h * log(1 + r2_h * |i - j|), KERPLE-log, r1 and r2 trained (> 0)"
        return "-r1_h * |i - j|^r2_h, KERPLE-power, r1 and r2 trained (0 < r2 <= 2)"
    if isinstance(bias, FireBias):
        return (
            f"f(psi(max(i - j, 0)) / psi(max(i, L)))_h, FIRE: psi(x) = log(c x + 1), MLP "
            f"1 -> {bias.hidden} -> heads, c and L trained"
        )
    if isinstance(bias, SandwichBias):
        return (
            f"sum_{{k=1}}^{{{bias.dim // 2}}} cos((i - j) / {bias.base:g}^(2k / {bias.dim})), "
            + (
                f"less {bias.dim // 2}, divided by 8h/H for head h = 1 .. H, Sandwich"
                if bias.per_head == "divided"
                else "Sandwich, every head alike"
            )
        )
    if isinstance(bias, ExprBias):
        names = ", ".join(_parameter_text(name, param) for name, param in bias.params.items())
        return f"{bias.expr} (expression; trained parameters: {names or 'none'})"
    index = bias.index
    relative = "j - i" if index.sign == "key_minus_query" else "i - j"
    direction = "bidirectional" if index.bidirectional else "unidirectional"
    return (
        f"table[bucket({relative}), h], {index.recipe} log buckets: {index.buckets} "
        f"{direction}, max_distance {index.max_distance}"
    )


def _parameter_text(name: str, param: ExprParam) -> str:
    """An expression parameter and how it is read: ``a = softplus(stored)``, clamped."""
    reads = []
    if param.positive:
        reads.append("softplus of the stored value")
    if param.bounds is not None:
        reads.append(f"clamped to [{_number(param.bounds[0])}, {_number(param.bounds[1])}]")
    if isinstance(param.init, list):
        reads.append("a start per head")
    return f"{name} ({', '.join(reads)})" if reads else name


def _table_length(untied: UntiedPositions) -> int:
    """The untied table's length (the model only admits learned untied tables)."""
    assert isinstance(untied.table, LearnedTable)
    return untied.table.max_positions


def _untied_formula(spec: Spec, untied: UntiedPositions) -> str:
    row = "LN(p_i)" if untied.norm.kind == "layer_norm" else "p_i"
    key_row = "LN(p_j)" if untied.norm.kind == "layer_norm" else "p_j"
    offset_q = " + b_q" if untied.projection_bias else ""
    offset_k = " + b_k" if untied.projection_bias else ""
    text = (
        f"scale * ({row} U_q{offset_q}) . ({key_row} U_k{offset_k}) per head, untied "
        f"learned table of {_table_length(untied)} positions (no extrapolation)"
    )
    bias = spec.bias
    if bias is not None:
        where = "inside" if bias.placement == "before_scale" else "after"
        text += f"; plus, {where} the scale, {_bias_formula(bias)}"
    if untied.first_token == "reset":
        text += (
            "; first-token reset: position t reads row t + 1, and query position 0 / key "
            "position 0 get per-head constants from rows 0 / 1"
        )
        if isinstance(bias, LearnedTableBias):
            text += f" and bias rows {bias.index.buckets // 2} / {bias.index.buckets}"
    return text


def _relative_term_lines(spec: Spec, term: str, value: object) -> TermLine | None:
    """Words for a relative or global term, or None for other forms."""
    section = spec.relative
    if isinstance(value, GlobalContentTerm):
        return TermLine(term, "global", "u_h . k_j (u: trained vector per head, r_w_bias)")
    if not isinstance(value, (RelativeTerm, GlobalPositionTerm)) or section is None:
        return None
    reader = value.relative if isinstance(value, RelativeTerm) else value.global_
    r = "j - i" if reader.sign == "key_minus_query" else "i - j"
    index = section.index
    if isinstance(index, ClipIndex):
        where = f"R[clip({r}, -{index.max_distance}, {index.max_distance})]"
    elif isinstance(index, SymmetricLogBuckets):
        where = (
            f"R[logbucket({r})], deberta log buckets: {index.buckets}, max_distance "
            f"{index.max_distance}"
        )
    else:
        where = f"R_({r})"
        if term == "content_position" and reader.sign == "query_minus_key":
            where += " (relative shift at default positions, gather otherwise)"
    table = section.table
    if isinstance(table, LearnedRelativeTable):
        what = "learned" + (" per-head" if table.heads == "per_head" else "")
        if table.norm is not None:
            what += " layer-normed"
    elif table is not None:
        what = f"{table.layout} sinusoid"
    else:
        what = "no"
    projected = {
        "none": where,
        "key": f"W_k {where}",
        "query": f"W_q {where}",
        "relative": f"W_R {where}",
    }[reader.projection]
    side = {"content_position": "q_i", "position_content": "k_j"}.get(term, "v_h")
    form = "relative" if isinstance(value, RelativeTerm) else "global"
    inside = "inside" if reader.placement == "before_scale" else "after"
    return TermLine(term, form, f"{side} . {projected} ({what} table, {inside} the scale)")


def values_description(spec: Spec) -> str:
    """The value side in words."""
    if not isinstance(spec.values, RelativeValues) or spec.relative is None:
        return "plain"
    reader = spec.values.relative
    r = "j - i" if reader.sign == "key_minus_query" else "i - j"
    index = spec.relative.index
    if isinstance(index, ClipIndex):
        r = f"clip({r}, -{index.max_distance}, {index.max_distance})"
    sharing = "per-head" if reader.heads == "per_head" else "shared"
    return f"relative: z_i = sum_j a_ij (v_j + R^V[{r}]) ({sharing} learned table)"


def value_lines(spec: Spec) -> list[TermLine]:
    """The value term as a decomposition row (only when it is not plain)."""
    if not isinstance(spec.values, RelativeValues):
        return []
    text = values_description(spec).removeprefix("relative: ")
    text += (
        "; a_ij the attention weights, which SDPA does not return: backend auto takes "
        "sdpa on the CPU, which forms them a second time, and eager on CUDA"
    )
    return [TermLine("values", "relative", text)]


def term_lines(spec: Spec) -> list[TermLine]:
    """The decomposition of one spec in words (docstrings and ``posgen explain``)."""
    terms = spec.terms
    lines: list[TermLine] = []
    rotation = spec.rotation
    if rotation is not None:
        lines.append(
            TermLine(
                "content_content",
                "rotate",
                f"(R_i q_i) . (R_j k_j) = q_i R_(j-i) k_j, {rotation.pairing} pairing, "
                f"{frequency_text(rotation)}{rotary_share(spec)}{rotation_extras(rotation)}",
            )
        )
    elif _adds_a_table(spec):
        # q and k come from embed's x + p: q_i . k_j holds the three absolute terms too
        lines.append(TermLine("content_content", "keep", _ADDED_CONTENT))
    else:
        lines.append(TermLine("content_content", "keep", "q_i . k_j"))
    absolute = _input_term_texts(spec)
    for term, value in (
        ("content_position", terms.content_position),
        ("position_content", terms.position_content),
    ):
        if term == "content_position" and spec.contextual is not None:
            lines.append(
                TermLine(
                    term,
                    "contextual",
                    "CoPE: q_i . e[p_ij] interpolated (after the scale), p_ij = sum over "
                    "keys t >= j (up to i) of sigmoid(s_it), s_it the scaled logit q_i . k_t, "
                    f"clamped below {spec.contextual.max_positions}",
                )
            )
            continue
        relative = _relative_term_lines(spec, term, value)
        if relative is not None:
            if spec.input is not None:  # the input table's absolute part is still there
                relative = TermLine(term, relative.form, f"{absolute[term]} + {relative.formula}")
            lines.append(relative)
            continue
        form = value if isinstance(value, str) else "other"
        lines.append(TermLine(term, form, absolute[term] if value == "absolute" else "0"))
    bias = spec.bias
    relative = _relative_term_lines(spec, "position_position", terms.position_position)
    if spec.untied is not None:
        lines.append(TermLine("position_position", "untied", _untied_formula(spec, spec.untied)))
    elif relative is not None:
        if spec.input is not None:
            formula = f"{absolute['position_position']} + {relative.formula}"
            relative = TermLine(relative.term, relative.form, formula)
        lines.append(relative)
    elif bias is None:
        pp = terms.position_position
        text = absolute["position_position"] if pp == "absolute" else "0"
        lines.append(TermLine("position_position", str(pp), text))
    else:
        where = "inside" if bias.placement == "before_scale" else "after"
        formula = f"{_bias_formula(bias)} ({where} the scale)"
        lines.append(TermLine("position_position", "bias", formula))
    return lines


def frequency_text(rotation: Rotation) -> str:
    """The frequency schedule in words: ``theta_k = 10000^(-2k/d_rot) / 4 (linear ...)``;
    axial RoPE's axes each turn their own share of the pairs, its schedule over d_rot /
    count features (``theta_k = 100^(-2k/(d_rot/2))``)."""
    width = "d_rot"
    if isinstance(rotation.axes, AxialAxes):
        width = f"(d_rot/{rotation.axes.count})"
    standard = f"theta_k = {_number(rotation.base)}^(-2k/{width})"
    frequencies = rotation.frequencies
    kind = frequencies.kind
    if kind == "standard":
        return standard
    if isinstance(frequencies, ExprFrequencies):
        return f"theta_k = {frequencies.expr} (an expression of k, d, base)"
    named = {
        "linear": "Position Interpolation",
        "ntk": "NTK-aware base",
        "dynamic_ntk": "dynamic NTK, by the call's length",
        "yarn": "YaRN ramp",
        "llama3": "Llama 3.1 bands",
        "longrope": "LongRoPE per-pair factors",
    }[kind]
    factor = getattr(frequencies, "factor", None)
    scaled = f", factor {_number(factor)}" if factor is not None else ""
    return f"{standard} rescaled ({named}{scaled})"


def rotation_extras(rotation: Rotation) -> str:
    """Attention factor, xPos and position axes in words, or ``""``."""
    parts = []
    if rotation.attention_factor != 1.0:
        parts.append(f"cos and sin times {rotation.attention_factor:.6g}")
    if rotation.position_scale is not None:
        parts.append(f"xPos decay zeta_k^((i-j)/{_number(rotation.position_scale.scale_base)})")
    if isinstance(rotation.axes, MultimodalSections):
        sections = rotation.axes.sections
        axes = " (t, h, w)" if len(sections) == 3 else ""
        dealt = ", pairs dealt out in turn" if rotation.axes.layout == "interleaved" else ""
        parts.append(f"M-RoPE sections {list(sections)}{axes}{dealt}")
    elif isinstance(rotation.axes, AxialAxes):
        count = rotation.axes.count
        parts.append(
            f"axial over {count} position axes (positions [{count}, ..., N]): the pairs in "
            f"{count} equal shares, share a (theta_k, k < d_rot/{2 * count}) turning with "
            "axis a"
        )
    return "".join(f"; {part}" for part in parts)


def rotary_share(spec: Spec) -> str:
    """``, partial: rotates the leading 25% of each head (16 of 64 features)``, or ``""``.

    Empty when the spec rotates whole heads (or does not rotate).
    """
    rotation = spec.rotation
    if rotation is None or rotation.rotary_dims.fraction >= 1:
        return ""
    fraction = rotation.rotary_dims.fraction
    if rotation.rotary_dims.layout == "proportional":
        return f", p-RoPE: only the highest {fraction * 100:g}% of the frequencies turn"
    head_dim = spec.defaults.head_dim
    rotated = rotary_dim_for(head_dim, fraction)
    return (
        f", partial: rotates the {rotation.rotary_dims.layout} {fraction * 100:g}% of each "
        f"head ({rotated} of {head_dim} features at the default head_dim), the rest pass "
        "through"
    )


def _adds_a_table(spec: Spec) -> bool:
    """Whether the input is x + p for a table p of positions (not a convolution of the
    tokens, a product or complex order): the three absolute terms of ``_ADDED``."""
    form = spec.input
    return (
        form is not None
        and not isinstance(form, ComplexOrderInput)
        and form.kind == "add"
        and form.table.kind != "depthwise_conv"
    )


def _input_term_texts(spec: Spec) -> dict[str, str]:
    """How the input-level positions reach the three position terms, in words."""
    form = spec.input
    if isinstance(form, ComplexOrderInput):
        text = (
            "inside Re/Im of r e^(I (omega pos + theta)) per feature, I^2 = -1 "
            "(position as a phase)"
        )
        return dict.fromkeys(("content_position", "position_content", "position_position"), text)
    if form is not None and form.table.kind == "depthwise_conv":
        text = (
            "inside (x_i + c_i) Wq Wk^T (...)_j^T, c = DWConv(x): content-conditioned, "
            "position only through the zero padding at the edges"
        )
        return dict.fromkeys(("content_position", "position_content", "position_position"), text)
    if form is not None and form.kind == "multiply":
        text = "inside (x_i * p_i) Wq Wk^T (x_j * p_j)^T (input product, not a separate sum)"
        return dict.fromkeys(("content_position", "position_content", "position_position"), text)
    return dict(_ADDED)


_ADDED = {
    "content_position": "x_i Wq Wk^T p_j^T (via the input table)",
    "position_content": "p_i Wq Wk^T x_j^T (via the input table)",
    "position_position": "p_i Wq Wk^T p_j^T (via the input table)",
}
"""The absolute terms of a table added to the input."""
_ADDED_CONTENT = (
    "x_i Wq Wk^T x_j^T; with the three absolute terms below it is q_i . k_j, q and k "
    "projected from embed's x + p (q_i, k_j below are those)"
)


def input_description(spec: Spec) -> str | None:
    """The input-level form in words (``posgen explain``, module docstrings), or None."""
    form = spec.input
    if form is None:
        return None
    if isinstance(form, ComplexOrderInput):
        base = _number(form.frequency_base) if form.frequency_base is not None else "?"
        own = (
            f"learned per-feature omega, theta (base {base}) when none are passed"
            if form.module_parameters == "learned_per_feature"
            else "the caller's per-token omega, theta"
        )
        return f"(r cos(omega pos + theta), r sin(omega pos + theta)), {own}"
    table = form.table
    if table.kind == "depthwise_conv":
        if table.layout == "grid_2d":
            return (
                f"x_i + c_i, c = DWConv2d(x): depthwise {table.kernel_size}x"
                f"{table.kernel_size} convolution over the H x W token grid, same zero "
                "padding (content-conditioned)"
            )
        return (
            f"x_i + c_i, c = DWConv(x): depthwise convolution over the sequence, kernel "
            f"{table.kernel_size}, {table.padding} zero padding (content-conditioned)"
        )
    combine = "x_i * p_i" if form.kind == "multiply" else "x_i + p_i"
    if table.kind == "learned":
        detail = f"{table.max_positions} positions, no extrapolation"
    elif table.kind == "hierarchical":
        n = table.base_positions
        detail = (
            f"{n} trained rows u (a basis) serve {n * n} positions: p_(a*{n}+b) = "
            f"{_number(table.alpha)} u_a + {_number(1 - table.alpha)} u_b"
        )
    elif table.kind == "ode":
        detail = (
            f"p_i = p(i * {_number(table.position_step)}) solving dp/dt = h(p, t), "
            f"{table.activation} network of width {table.hidden}, {table.integrator} with "
            f"{table.steps_per_position} step(s) per position, p(0) {table.initial}"
        )
        if table.max_positions is not None:
            detail += f", horizon {table.max_positions} positions"
    else:
        detail = f"base {_number(table.base)}, {table.layout} sin/cos"
    return f"{combine}, {table.kind} table ({detail})"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def scale_description(spec: Spec) -> str:
    """The logit scale in words."""
    if spec.scale.kind == "none":
        return "none (logits are not scaled)"
    factor = spec.scale.factor
    inner = "head_dim" if factor == 1 else f"{_number(factor)} * head_dim"
    return f"1/sqrt({inner})"


def query_scale_description(spec: Spec) -> str | None:
    """The query scale in words (``posgen explain``, module docstrings), or None."""
    scale = spec.query_scale
    if scale is None:
        return None
    if isinstance(scale, FloorLogQueryScale):
        tau = f"1 + {_number(scale.attn_scale)} ln(1 + floor((i + 1) / {scale.floor_scale}))"
        note = f"1 below position {scale.floor_scale - 1}"
    elif isinstance(scale, LogLengthQueryScale):
        length = scale.original_max_positions
        tau = f"max(1, ln(i + 1) / ln({length}))"
        note = f"1 up to position {length - 1}"
    else:
        return (
            "q_i * tau_h(i) before any term reads it, tau_h(i) = s_h ln(i + 1) (s [heads] "
            f"trained from {_number(scale.init)}; 0 at position 0)"
        )
    return f"q_i * tau(i) before any term reads it, tau(i) = {tau} ({note})"


def positions_description(spec: Spec) -> str | None:
    """How positions are numbered where a call gives none, if not 0 .. M - 1 (randomized
    positions), in words (``posgen explain``, module docstrings); else None."""
    if spec.positions is None:
        return None
    last = spec.positions.max_positions - 1
    return (
        "without positions given, a training call (module.train()) numbers its M keys by a "
        f"sorted random subset of 0 .. {last}, drawn afresh each call (sample_positions), "
        "its N queries taking the last N (Ruoss et al. 2023); an evaluation call by "
        "0 .. M - 1 (Ruoss et al.'s code draws there too: pass sample_positions(M))"
    )


def explanation(spec: Spec) -> list[str]:
    """The decomposition of a spec in words, as printed by ``posgen explain``."""
    lines = [f"{spec.name}: {spec.title}", ""]
    description = input_description(spec)
    if description is not None:
        lines += [f"input      {description}", ""]
    lines.append("a_ij = content_content + content_position + position_content + position_position")
    lines.append(f"scale: {scale_description(spec)}")
    queries = query_scale_description(spec)
    if queries is not None:
        lines.append(f"queries: {queries}")
    numbered = positions_description(spec)
    if numbered is not None:
        lines.append(f"positions: {numbered}")
    lines.append("")
    for row in term_lines(spec):
        lines.append(f"  {row.term:<18} {row.form:<9} {row.formula}")
    lines.append(f"  {'values':<18} {values_description(spec)}")
    lines.append("")
    lines.append("references:")
    lines.extend(f"  - {reference}" for reference in spec.references)
    if spec.models:
        lines.append(f"used by: {', '.join(spec.models)}")
    claims = spec.claims.model_dump(exclude_none=True)
    if claims:
        lines.append("claims: " + ", ".join(f"{k}={str(v).lower()}" for k, v in claims.items()))
    return lines
