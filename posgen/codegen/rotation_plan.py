"""The rotation's plan: frequency schedule, attention factor, xPos scale and axes."""

from __future__ import annotations

from posgen.codegen.blocks import (
    DynamicNtkFrequencyPlan,
    ExprFrequencyPlan,
    FrequencyPlan,
    LinearFrequencyPlan,
    Llama3FrequencyPlan,
    LongRopeFrequencyPlan,
    NtkFrequencyPlan,
    RotationPlan,
    StandardFrequencyPlan,
    YarnFrequencyPlan,
)
from posgen.spec.expr import FREQUENCY_NAMES, render_steps
from posgen.spec.model import (
    AxialAxes,
    DynamicNtkFrequencies,
    ExprFrequencies,
    Frequencies,
    LinearFrequencies,
    Llama3Frequencies,
    LongRopeFrequencies,
    MultimodalSections,
    NtkFrequencies,
    Rotation,
    StandardFrequencies,
    YarnFrequencies,
)

# ``FREQUENCY_EXPR = "..."`` fits a 100-column line up to this many characters; past
# it the text goes in pieces of PIECE_CHARS, one indented line each
ONE_LINE_CHARS = 80
PIECE_CHARS = 70


def line_pieces(expression: str) -> tuple[str, ...]:
    """The expression whole where it fits one line, else in pieces of ``PIECE_CHARS``
    (an expression holds no quote or backslash, so a piece never splits an escape)."""
    if len(expression) <= ONE_LINE_CHARS:
        return (expression,)
    return tuple(expression[i : i + PIECE_CHARS] for i in range(0, len(expression), PIECE_CHARS))


def rotation_plan(rotation: Rotation) -> RotationPlan:
    """The rotation block of a spec's plan."""
    axes = rotation.axes
    return RotationPlan(
        base=float(rotation.base),
        pairing=rotation.pairing,
        fraction=float(rotation.rotary_dims.fraction),
        proportional=rotation.rotary_dims.layout == "proportional",
        frequencies=frequency_plan(rotation.frequencies),
        attention_factor=rotation.attention_factor,
        xpos_scale_base=(
            float(rotation.position_scale.scale_base) if rotation.position_scale else None
        ),
        sections=tuple(axes.sections) if isinstance(axes, MultimodalSections) else None,
        section_layout=axes.layout if isinstance(axes, MultimodalSections) else "consecutive",
        axial_count=axes.count if isinstance(axes, AxialAxes) else None,
    )


def frequency_plan(frequencies: Frequencies) -> FrequencyPlan:
    """The plan class of a frequency schedule, with its parameters as plain numbers."""
    if isinstance(frequencies, StandardFrequencies):
        return StandardFrequencyPlan()
    if isinstance(frequencies, LinearFrequencies):
        return LinearFrequencyPlan(factor=float(frequencies.factor))
    if isinstance(frequencies, NtkFrequencies):
        return NtkFrequencyPlan(factor=float(frequencies.factor))
    if isinstance(frequencies, DynamicNtkFrequencies):
        return DynamicNtkFrequencyPlan(
            factor=float(frequencies.factor),
            original_max_positions=frequencies.original_max_positions,
        )
    if isinstance(frequencies, YarnFrequencies):
        return YarnFrequencyPlan(
            factor=float(frequencies.factor),
            original_max_positions=frequencies.original_max_positions,
            beta_fast=float(frequencies.beta_fast),
            beta_slow=float(frequencies.beta_slow),
            truncate=frequencies.truncate,
        )
    if isinstance(frequencies, Llama3Frequencies):
        return Llama3FrequencyPlan(
            factor=float(frequencies.factor),
            low_freq_factor=float(frequencies.low_freq_factor),
            high_freq_factor=float(frequencies.high_freq_factor),
            original_max_positions=frequencies.original_max_positions,
        )
    if isinstance(frequencies, ExprFrequencies):
        parsed = frequencies.parsed()
        steps, result = render_steps(parsed, FREQUENCY_NAMES)
        return ExprFrequencyPlan(
            expression=frequencies.expr,
            expression_parts=line_pieces(frequencies.expr),
            steps=steps,
            result=result,
            uses_d="d" in parsed.reads,
            uses_base="base" in parsed.reads,
        )
    if isinstance(frequencies, LongRopeFrequencies):
        return LongRopeFrequencyPlan(
            short_factor=tuple(float(f) for f in frequencies.short_factor),
            long_factor=tuple(float(f) for f in frequencies.long_factor),
            original_max_positions=frequencies.original_max_positions,
        )
    raise AssertionError(f"unplanned frequency kind {frequencies!r}")
