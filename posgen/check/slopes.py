"""The ``slopes`` block: slopes are positive, follow the named recipe, and the bias is
linear in distance.

Slopes are read through ``score_bias`` alone: slope_h = bias(i, i) - bias(i, i - 1).
hypothesis draws head counts from 1 to 64 (a scan adds the spec's own count, 1, 3 and
12); for each, a fresh module is built, every slope must be positive and, where the
recipe is known (``SLOPE_RECIPES``: ALiBi's geometric slopes, written here from Press et
al. 2022), equal to it; and bias(i, i ± d) - bias(i, i) must be d times the step at
distance 1 on each side that is not masked.

Fresh modules are the initialisation. The module the probe judges (``probe.pe64``: with
``posgen check --weights``, as trained) is measured too; where its slopes differ from the
initialisation's (trained ``learned`` slopes), they must be positive and linear in
distance (a trained value follows no recipe), and the evidence shows them, with the
fresh modules' checks labelled as the initialisation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from posgen.check.contract import Encoding
from posgen.check.probe import Probe, bias_of, float64_encoding
from posgen.check.search import Search, Violation, fmt, run_search, short_list
from posgen.check.verdicts import Outcome, failed

DISTANCES = [1, 2, 3, 5, 8, 13, 21, 40]  # distances the linearity is checked at
ANCHOR = 64  # the query position of the linearity check


def alibi_geometric_slopes(heads: int) -> list[float]:
    """Press et al. 2022: 2^(-8h/n) for n a power of two; else interleave the next one."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    power = 1
    while power * 2 <= heads:
        power *= 2
    slopes = geometric(power)
    return slopes + geometric(2 * power)[::2][: heads - power]


SLOPE_RECIPES: dict[str, Callable[[int], list[float]]] = {"alibi_geometric": alibi_geometric_slopes}


def _expected(bias: object, heads: int) -> list[float] | None:
    """The slopes a fresh module of ``heads`` heads must have, or None if unknown.

    ``learned`` slopes start at the geometric recipe; ``custom`` ones are the spec's
    values; with ``heads_with_bias: N`` the first N heads follow the recipe for N heads
    and the others have slope 0.
    """
    values = getattr(bias, "values", None)
    if values is not None:
        return [float(v) for v in values]
    recipe = SLOPE_RECIPES.get("alibi_geometric")
    if getattr(bias, "slopes", None) not in ("alibi_geometric", "learned") or recipe is None:
        return None
    with_bias = getattr(bias, "heads_with_bias", None) or heads
    return recipe(with_bias) + [0.0] * (heads - with_bias)


def slopes(probe: Probe) -> Outcome:
    """Positive slopes equal to the recipe for 1-64 heads, and a bias linear in distance."""
    bias = probe.spec.bias
    recipe_name = getattr(bias, "slopes", None)
    if bias is None or not isinstance(recipe_name, str):
        return Outcome("slopes", "block", None, None, "no slope bias in this spec")
    custom = getattr(bias, "values", None) is not None
    with_bias = getattr(bias, "heads_with_bias", None)
    lowest = with_bias or 1

    def check(heads: int) -> float:
        got = _measured(probe, heads)
        _linear(probe, heads)
        expected = _expected(bias, heads)
        biased = [h for h in range(heads) if expected is None or expected[h] > 0]
        if not custom and biased and min(got[h] for h in biased) <= 0:
            h = min(biased, key=lambda h: got[h])
            raise Violation(
                f"{heads} heads: head {h} has slope {fmt(got[h])} ≤ 0",
                heads=heads,
                head=h,
                values=got,
            )
        if expected is not None:
            _follows_recipe(got, expected, recipe_name, heads)
        return min(got[h] for h in biased) if biased else 0.0

    if custom:
        strategy = st.just(probe.heads)  # the spec's values fix the head count
    else:
        strategy = st.integers(lowest, 64)
    scan = [h for h in (probe.heads, 1, 3, 12) if h >= lowest and (not custom or h == probe.heads)]
    search = run_search(check, strategy, probe.budget, lambda: scan)
    if search.violation is not None:
        return failed("slopes", "block", None, search)
    judged = _slopes_of(probe.pe64)  # the module the probe judges (as trained, if loaded)
    trained = judged != _measured(probe, probe.heads)
    if trained:
        try:
            _judged_slopes_hold(probe, judged, custom, _expected(bias, probe.heads))
        except Violation as violation:
            return failed("slopes", "block", None, Search(violation, "scan", search.examples, 0.0))
    known = _expected(bias, probe.heads) is not None
    label = recipe_name
    if recipe_name == "learned":
        label = (
            "alibi_geometric" if trained else "alibi_geometric (the learned slopes' initialisation)"
        )
    how = (
        f"equal to an independent {label} recipe"
        if known
        else f"no independent implementation of {recipe_name!r}"
    )
    counts = f"{probe.heads} heads" if custom else f"{lowest}-64 heads"
    linear = f"linear in distance on both sides (distances {short_list(DISTANCES, 9)})"
    shown = short_list(fmt(s) for s in judged)
    if trained:
        return Outcome(
            "slopes",
            "block",
            None,
            True,
            f"the module as loaded, {probe.heads} heads: {shown}; positive and {linear}. "
            f"Its initialisation (fresh modules, {counts}): positive; {how}; linear in distance",
        )
    return Outcome(
        "slopes",
        "block",
        None,
        True,
        f"positive; {how} for {counts}; {linear}; {probe.heads} heads: {shown}",
    )


def _judged_slopes_hold(
    probe: Probe, judged: list[float], custom: bool, expected: list[float] | None
) -> None:
    """The judged module's slopes (trained: no recipe applies) are positive on every
    head the bias reaches (custom values are the spec's own) and linear in distance."""
    heads = probe.heads
    _linear_in(probe.pe64, heads, " (the module as loaded)")
    biased = [h for h in range(heads) if expected is None or expected[h] > 0]
    if not custom and biased and min(judged[h] for h in biased) <= 0:
        h = min(biased, key=lambda h: judged[h])
        raise Violation(
            f"the module as loaded, {heads} heads: head {h} has slope {fmt(judged[h])} ≤ 0 "
            f"(slopes {short_list(fmt(s) for s in judged)})",
            heads=heads,
            head=h,
            values=judged,
        )


def _slopes_of(pe: Encoding) -> list[float]:
    """slope_h = bias(i, i) - bias(i, i - 1), read through score_bias."""
    row = bias_of(pe, torch.tensor([5]), torch.tensor([5, 4]))[:, 0]  # [heads, 2]
    return (row[:, 0] - row[:, 1]).tolist()


def _measured(probe: Probe, heads: int) -> list[float]:
    """The slopes of a fresh module of ``heads`` heads (its initialisation)."""
    return _slopes_of(float64_encoding(probe.cls, heads, probe.head_dim))


def _linear(probe: Probe, heads: int) -> None:
    """A fresh module of ``heads`` heads is linear in distance (``_linear_in``)."""
    _linear_in(float64_encoding(probe.cls, heads, probe.head_dim), heads)


def _linear_in(pe: Encoding, heads: int, which: str = "") -> None:
    """bias(i, i ± d) - bias(i, i) = d (bias(i, i ± 1) - bias(i, i)) on each side."""
    for side, sign in (("before", -1), ("after", 1)):
        keys = torch.tensor([ANCHOR] + [ANCHOR + sign * d for d in DISTANCES])
        row = bias_of(pe, torch.tensor([ANCHOR]), keys)[:, 0]  # [heads, 1 + D]
        if not bool(torch.isfinite(row).all()):
            continue  # a masked side (no bias to compare)
        step = row[:, 1] - row[:, 0]
        for index, d in enumerate(DISTANCES):
            got = row[:, 1 + index] - row[:, 0]
            error = float((got - d * step).abs().max())
            if error > 1e-9 * (1.0 + float((d * step).abs().max())):
                h = int((got - d * step).abs().argmax())
                raise Violation(
                    f"{heads} heads{which}: head {h}, keys {side} query {ANCHOR}: bias at "
                    f"distance {d} is {fmt(float(got[h]))}, not {d} × the step at "
                    f"distance 1 ({fmt(float(step[h]))}): not linear in distance",
                    heads=heads,
                    head=h,
                    distance=d,
                    side=side,
                )


def _follows_recipe(got: list[float], expected: list[float], name: str, heads: int) -> None:
    """Every measured slope equals the recipe's within 1e-6, or a Violation."""
    for h, (a, b) in enumerate(zip(got, expected, strict=True)):
        if abs(a - b) > 1e-6 * b or (b == 0 and a != 0):
            raise Violation(
                f"{heads} heads: head {h} has slope {fmt(a)}, the {name} recipe gives {fmt(b)}",
                heads=heads,
                head=h,
                values=got,
                expected=expected,
            )
