"""Rotation blocks: ``rotation_norm`` and ``rotation_pairing``.

``rotation_norm``: rotations keep norms (|R_m x| = |x| for positions m up to 2^20) and
are the identity at position 0, on both outputs of rotate (query and key); and the
eigen-angles of R_1 are the spec's frequencies θ_k = base^(-2k / d_rot) (RoFormer, Su et
al. 2021, eq. 15), or a frequency expression's θ_k, measured on both sides.

``rotation_pairing``: the half and the interleaved pairing differ by a fixed permutation
P (``half_to_interleaved``): half(x)[P] = interleaved(x[P]). The other pairing's module
is built in memory from the same spec with only the pairing changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from hypothesis import strategies as st

from posgen.check.contract import F64, Encoding
from posgen.check.probe import Probe, float64_encoding
from posgen.check.search import FAR, SEEDS, Violation, fmt, generator, run_search, short_list
from posgen.check.verdicts import Outcome, failed
from posgen.spec.loader import LoadedSpec
from posgen.spec.model import (
    AxialAxes,
    ExprFrequencies,
    Rotation,
    Spec,
    rotated_features,
    turning_pairs,
)

# a position, a seed for the rotated vectors
Example = tuple[int, int]


@st.composite
def _positions_and_seeds(draw: st.DrawFn) -> Example:
    """A position in [0, 2^20] and a seed for the vectors rotated there."""
    return draw(st.integers(0, FAR)), draw(SEEDS)


def rotation_norm(probe: Probe) -> Outcome:
    """|R_m x| = |x|, R_0 = I on both sides, and R_1's angles are the spec's frequencies."""
    rotation = probe.spec.rotation
    if rotation is None:
        return Outcome("rotation_norm", "block", None, None, "no rotation in this spec")

    def check(example: Example) -> float:
        return _keeps_norms(probe, example)

    search = run_search(check, _positions_and_seeds(), probe.budget)
    if search.violation is not None:
        return failed("rotation_norm", "block", None, search)
    frequencies = _rotation_frequencies(probe, rotation)
    if isinstance(frequencies, Outcome):
        return frequencies
    return Outcome(
        "rotation_norm",
        "block",
        None,
        True,
        f"|R_m x| = |x| for m up to 2^20 and R_0 = I, query and key sides "
        f"({search.examples} examples){frequencies}",
    )


def _feature_scale(rotation: Rotation, head_dim: int) -> torch.Tensor:
    """[head_dim]: the attention factor on the rotated features, 1 on the others.

    YaRN and LongRoPE multiply cos and sin by it (Hugging Face's attention scaling), so
    R_m = a · (a rotation) there; dividing it out leaves the rotation."""
    scale = torch.ones(head_dim, dtype=F64)
    scale[: rotated_features(rotation, head_dim)] = rotation.attention_factor
    return scale


def _keeps_norms(probe: Probe, example: Example) -> float:
    """The margin by which rotate keeps norms at one position (and is I at 0), once the
    attention factor is divided out."""
    position, example_seed = example
    x = torch.randn(1, 1, 3, probe.head_dim, generator=generator(example_seed), dtype=F64)
    y = torch.randn(1, 1, 3, probe.head_dim, generator=generator(example_seed + 1), dtype=F64)
    where = torch.full((3,), position)
    zero = torch.zeros(3, dtype=torch.int64)
    assert probe.spec.rotation is not None
    scale = _feature_scale(probe.spec.rotation, probe.head_dim)
    rotated = [out / scale for out in probe.pe64.rotate(x, y, where, where)]
    at_zero = [out / scale for out in probe.pe64.rotate(x, y, zero, zero)]
    tol = 1e-12 * float(torch.cat((x, y)).norm(dim=-1).max())
    norm_error = 0.0
    for side, inputs in (("query", x), ("key", y)):  # both outputs of rotate
        out = rotated[0 if side == "query" else 1]
        error = float((out.norm(dim=-1) - inputs.norm(dim=-1)).abs().max())
        if error > tol:
            raise Violation(
                f"position {position}, {side} side: |R x| - |x| = {fmt(error)} (tol {fmt(tol)})",
                position=position,
                side=side,
            )
        zero_error = float((at_zero[0 if side == "query" else 1] - inputs).abs().max())
        if zero_error > 1e-15 * float(inputs.abs().max()) * 4:
            raise Violation(
                f"{side} side: R_0 x differs from x by {fmt(zero_error)}",
                position=0,
                side=side,
            )
        norm_error = max(norm_error, error)
    return tol - norm_error


def _rotation_frequencies(probe: Probe, rotation: Rotation) -> Outcome | str:
    """The eigen-angles of R_1 (query and key side) against the spec's frequencies:
    θ_k = base^(-2k / d_rot), d_rot = round(fraction · head_dim), k < d_rot / 2
    (RoFormer, Su et al. 2021, eq. 15), or a frequency expression's θ_k evaluated here in
    Python floats (posgen/spec/expr_values.py). Evidence text, or a failed Outcome."""
    rotary_dim = rotated_features(rotation, probe.head_dim)
    expected = _expected_frequencies(rotation, rotary_dim, probe.head_dim)
    if isinstance(expected, str):
        return expected
    by_expression = isinstance(rotation.frequencies, ExprFrequencies)
    formula = "the expression's θ_k" if by_expression else "base^(-2k/d_rot)"
    for side, name in ((0, "query"), (1, "key")):
        angles = torch.linalg.eigvals(probe.rotation_matrix(1, side)).angle()
        got = angles[angles > 1e-12].sort(descending=True).values
        if got.shape != expected.shape or not bool(
            ((got - expected).abs() <= 1e-9 * expected).all()
        ):
            worst = int((got - expected).abs().argmax()) if got.shape == expected.shape else None
            shown = (
                f"θ_{worst} = {fmt(float(got[worst]))}, {formula} gives "
                f"{fmt(float(expected[worst]))}"
                if worst is not None
                else f"{got.shape[0]} rotating pairs, expected {expected.shape[0]}"
            )
            return Outcome(
                "rotation_norm",
                "block",
                None,
                False,
                f"{name} side: the angles of R_1 are not {formula} with base "
                f"{rotation.base:g}, d_rot {rotary_dim}: {shown}",
                counterexample={
                    "side": name,
                    "measured": got.tolist()[:8],
                    "expected": expected.tolist()[:8],
                },
            )
    return (
        f"; angles of R_1 equal {formula} (base {rotation.base:g}, "
        f"d_rot {rotary_dim}) on both sides"
    )


def _expected_frequencies(rotation: Rotation, rotary_dim: int, head_dim: int) -> torch.Tensor | str:
    """The angles R_1 should turn its pairs by, highest first (pairs that do not turn
    left out), or the evidence text saying why they are not compared."""
    turning = turning_pairs(rotation, head_dim)  # p-RoPE keeps the highest only
    frequencies = rotation.frequencies
    if isinstance(frequencies, ExprFrequencies) and rotation.axes is None:
        theta = frequencies.values(rotary_dim, rotation.base)
        kept = sorted(theta, reverse=True)[:turning]
        if max(kept) >= math.pi - 1e-6:  # an angle past π reads back as another one
            return "; frequencies 'expr' not compared (an angle of π or more at position 1)"
        expected = torch.tensor([value for value in kept if value > 1e-12], dtype=F64)
        return expected.sort(descending=True).values
    if getattr(frequencies, "kind", None) != "standard":
        return f"; frequencies {frequencies.kind!r} not compared"
    expected = torch.tensor(
        [rotation.base ** (-2.0 * k / rotary_dim) for k in range(turning)],
        dtype=F64,
    )
    if isinstance(rotation.axes, AxialAxes):  # each axis: the schedule over its share
        share = rotary_dim // rotation.axes.count
        one_axis = [rotation.base ** (-2.0 * k / share) for k in range(share // 2)]
        expected = torch.tensor(one_axis * rotation.axes.count, dtype=F64)
    return expected.sort(descending=True).values


def _variant(
    loaded: LoadedSpec, update: Callable[[dict[str, Any]], None], suffix: str
) -> LoadedSpec:
    """The same spec with one field changed, validated again, under another name."""
    data = loaded.spec.model_dump(mode="python")
    update(data)
    data["name"] = f"{loaded.spec.name[:40]}_{suffix}"
    spec = Spec.model_validate(data)
    return replace(loaded, spec=spec)


def half_to_interleaved(head_dim: int, rotary_dim: int) -> list[int]:
    """P[2k] = k, P[2k+1] = k + D/2 on the rotated features; the rest stay in place."""
    half = rotary_dim // 2
    perm = [index for k in range(half) for index in (k, k + half)]
    return perm + list(range(rotary_dim, head_dim))


def rotation_pairing(probe: Probe) -> Outcome:
    """half(x)[P] = interleaved(x[P]), the other pairing's module built in memory."""
    rotation = probe.spec.rotation
    if rotation is None:
        return Outcome("rotation_pairing", "block", None, None, "no rotation in this spec")
    if rotation.pairing not in ("half", "interleaved"):
        return Outcome(
            "rotation_pairing",
            "block",
            None,
            None,
            f"pairing {rotation.pairing!r} has no known permutation",
        )
    other = "interleaved" if rotation.pairing == "half" else "half"

    def update(data: dict[str, Any]) -> None:
        data["terms"]["content_content"]["rotate"]["pairing"] = other

    variant = _variant(probe.loaded, update, other)
    other_pe = float64_encoding(Probe.variant_class(variant), probe.heads, probe.head_dim)
    half_pe, inter_pe = (
        (probe.pe64, other_pe) if rotation.pairing == "half" else (other_pe, probe.pe64)
    )
    rotary_dim = rotated_features(rotation, probe.head_dim)
    perm = torch.tensor(half_to_interleaved(probe.head_dim, rotary_dim))

    def check(example: Example) -> float:
        return _pairings_agree(half_pe, inter_pe, perm, probe.head_dim, example)

    search = run_search(check, _positions_and_seeds(), probe.budget)
    if search.violation is not None:
        return failed("rotation_pairing", "block", None, search)
    return Outcome(
        "rotation_pairing",
        "block",
        None,
        True,
        f"half(x)[P] = interleaved(x[P]) with P = {short_list(perm.tolist())} "
        f"({other} module built in memory; {search.examples} examples)",
    )


def _pairings_agree(
    half_pe: Encoding, inter_pe: Encoding, perm: torch.Tensor, head_dim: int, example: Example
) -> float:
    """The margin by which half(x)[P] and interleaved(x[P]) agree, or a Violation."""
    position, example_seed = example
    x = torch.randn(1, 1, 2, head_dim, generator=generator(example_seed), dtype=F64)
    where = torch.full((2,), position)
    by_half, _ = half_pe.rotate(x, x, where, where)
    by_inter, _ = inter_pe.rotate(x[..., perm], x[..., perm], where, where)
    error = float((by_half[..., perm] - by_inter).abs().max())
    tol = 1e-12 * float(x.abs().max())
    if error > tol:
        raise Violation(
            f"position {position}: half(x)[P] and interleaved(x[P]) differ by {fmt(error)}",
            position=position,
        )
    return tol - error
