"""The ``buckets`` block: buckets lie in range, are monotone in |i - j| and follow the recipe.

The bucket of every (query, key) cell is read through ``score_bias`` alone: the module's
single [buckets, heads] table parameter (or [buckets + r, heads], r spare rows such as a
first-token reset's) is set to its row index, and the bias with a zero table is
subtracted, so other position terms cancel. Every bucket must be an integer in [0,
buckets); on each side of the query, buckets must move in one direction as |i - j|
grows; where the recipe is known (``BUCKET_RECIPES``: T5, written here from Raffel et al.
2020), every bucket must equal it. hypothesis draws query rows; keys cover every distance
up to ``EXACT_DISTANCES`` and log-spaced ones past it, up to 4 × max_distance (never past
a table). Under a first-token reset, query and key position 0 are not buckets.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.contract import F64, Encoding
from posgen.check.probe import Probe, bias_of, stated
from posgen.check.search import (
    EXACT_DISTANCES,
    Violation,
    distance_sample,
    fmt,
    run_search,
)
from posgen.check.verdicts import Outcome, failed

BucketRecipe = Callable[[int, bool, int, int], int]


def t5_bucket(relative: int, bidirectional: bool, buckets: int, max_distance: int) -> int:
    """T5's bucket of a relative position (key - query), written from Raffel et al. 2020."""
    if bidirectional:
        per_direction = buckets // 2
        offset = per_direction if relative > 0 else 0
        distance = abs(relative)
    else:
        per_direction, offset, distance = buckets, 0, max(-relative, 0)
    exact = per_direction // 2
    if distance < exact:
        return offset + distance
    grown = math.log(distance / exact) / math.log(max_distance / exact) * (per_direction - exact)
    return offset + min(exact + int(math.floor(grown)), per_direction - 1)


BUCKET_RECIPES: dict[str, BucketRecipe] = {"t5": t5_bucket}


@dataclass
class _Reader:
    """Reads bucket ids from two copies of the module: table = row index, table = 0."""

    pe: Encoding
    zero_pe: Encoding
    count: int  # buckets
    rows: int  # table rows (buckets + spare rows)
    reset: bool  # first-token reset: query and key position 0 are not buckets

    def ids(self, query: int, keys: Tensor) -> Tensor:
        """bias(table = arange) - bias(table = 0) at (query, keys): every head alike."""
        q = torch.tensor([query])
        return bias_of(self.pe, q, keys)[0, 0] - bias_of(self.zero_pe, q, keys)[0, 0]


@dataclass
class _Recipe:
    """An independent recipe with the spec's arguments, its answers cached."""

    recipe: BucketRecipe
    name: str
    sign: int
    bidirectional: bool
    count: int
    max_distance: int
    known: dict[int, int] = field(default_factory=dict)

    def bucket(self, relative: int) -> int:
        """The recipe's bucket of key - query = ``relative``."""
        if relative not in self.known:
            self.known[relative] = self.recipe(
                self.sign * relative, self.bidirectional, self.count, self.max_distance
            )
        return self.known[relative]


def buckets(probe: Probe) -> Outcome:
    """Range, monotonicity and recipe of the bucket ids, read through score_bias."""
    bias = probe.spec.bias
    index: Any = getattr(bias, "index", None)  # the spec's bucket index, read by name
    count = getattr(index, "buckets", None)
    if bias is None or not isinstance(count, int):
        return Outcome("buckets", "block", None, None, "no bucketed bias in this spec")
    reader = _reader(probe, count)
    if reader is None:
        return Outcome(
            "buckets",
            "block",
            None,
            None,
            f"no single [{count}, heads] table parameter to read buckets from",
        )
    span = 4 * int(getattr(index, "max_distance", probe.span))
    if probe.limit is not None:
        span = min(span, probe.limit)  # never past a table
    found = BUCKET_RECIPES.get(getattr(index, "recipe", ""))
    recipe = None
    if found is not None:
        sign = -1 if getattr(index, "sign", "key_minus_query") == "query_minus_key" else 1
        bidirectional = bool(getattr(index, "bidirectional", True))
        max_distance = int(getattr(index, "max_distance", 0))
        recipe = _Recipe(found, index.recipe, sign, bidirectional, count, max_distance)
    distances = torch.tensor(distance_sample(span))  # all within ±2048, log-spaced past

    def check(query: int) -> float:
        return _check_row(reader, recipe, query, distances, span)

    top = span - 1
    first = 1 if reader.reset else 0
    search = run_search(
        check, st.integers(first, top), probe.budget, lambda: [first, span // 2, top]
    )
    if search.violation is not None:
        return failed("buckets", "block", None, search)
    how = (
        f"equal to an independent {index.recipe} recipe"
        if recipe
        else "no independent implementation of its recipe"
    )
    return Outcome(
        "buckets",
        "block",
        None,
        True,
        f"integer, in [0, {count}), monotone in |i - j| on each side for keys in "
        f"[0, {span}) (every distance up to {EXACT_DISTANCES}, log-spaced past "
        f"it); {how} ({search.examples} query rows)"
        + ("; query and key position 0 excluded (first-token reset)" if reader.reset else ""),
    )


def _reader(probe: Probe, count: int) -> _Reader | None:
    """Two copies of the module whose bucket table reads row index and 0, or None where
    there is no single table parameter of [buckets (+ up to 2 spare rows), heads]."""
    pe = copy.deepcopy(probe.pe64)
    # the bucket table: [buckets, heads], or [buckets + r, heads] with r spare rows (e.g.
    # a first-token reset's row); cells that read a spare row are not buckets
    tables = [
        p
        for p in pe.parameters()
        if p.dim() == 2 and p.shape[1] == probe.heads and count <= p.shape[0] <= count + 2
    ]
    if len(tables) != 1:
        return None
    rows = int(tables[0].shape[0])
    with torch.no_grad():
        tables[0].zero_()
    zero_pe = copy.deepcopy(pe)
    with torch.no_grad():
        tables[0].copy_(torch.arange(rows, dtype=F64).unsqueeze(-1).expand(rows, probe.heads))
    # a first-token reset (spec field first_token: reset) gives query and key position 0
    # constants of their own: those cells are not buckets
    reset = "reset" in stated(probe.spec, "first_token", str)
    return _Reader(pe, zero_pe, count, rows, reset)


def _check_row(
    reader: _Reader, recipe: _Recipe | None, query: int, distances: Tensor, span: int
) -> float:
    """One query row: integer ids in range, the recipe's ids, monotone on each side."""
    keys = (query + distances).unique()  # sorted
    keys = keys[(keys >= 0) & (keys < span)]
    row = reader.ids(query, keys)
    bad = ((row - row.round()).abs() > 1e-9) | (row < 0) | (row >= reader.rows)
    if bool(bad.any()):
        at = int(bad.nonzero()[0])
        raise Violation(
            f"query {query}, key {int(keys[at])}: bucket {fmt(float(row[at]))} "
            f"outside [0, {reader.count})",
            query=query,
            key=int(keys[at]),
            bucket=float(row[at]),
        )
    row = row.round()
    bucketed = row < reader.count  # the rest read a spare row (a reset): not buckets
    if reader.reset:
        bucketed &= keys != 0
        if query == 0:
            bucketed &= False
    keys, row = keys[bucketed], row[bucketed]
    if recipe is not None:
        _follows_recipe(recipe, query, keys, row)
    _monotone(query, keys, row)
    return 0.0


def _follows_recipe(recipe: _Recipe, query: int, keys: Tensor, row: Tensor) -> None:
    """Every bucket equals the independent recipe's, or a Violation."""
    for key, value in zip(keys.tolist(), row.tolist(), strict=True):
        want = recipe.bucket(key - query)
        if int(value) != want:
            raise Violation(
                f"query {query}, key {key}: bucket {int(value)}, the independent "
                f"{recipe.name} recipe gives {want}",
                query=query,
                key=key,
                bucket=int(value),
                expected=want,
            )


def _monotone(query: int, keys: Tensor, row: Tensor) -> None:
    """Buckets move one way as |i - j| grows, on each side of the query, or a Violation."""
    for side, chosen in (("before", keys <= query), ("after", keys >= query)):
        side_keys = keys[chosen]
        seq = row[chosen]
        if side == "before":  # by increasing distance
            side_keys, seq = side_keys.flip(0), seq.flip(0)
        steps = (seq[1:] - seq[:-1]).sign()
        moving = steps[steps != 0]
        if moving.numel() and bool((moving != moving[0]).any()):
            t = int(((steps != 0) & (steps != moving[0])).nonzero()[0]) + 1
            near = [abs(int(side_keys[t - 1]) - query), abs(int(side_keys[t]) - query)]
            pair = [int(seq[t - 1]), int(seq[t])]
            raise Violation(
                f"query {query}, keys {side} it: distances {near} have buckets "
                f"{pair}, against the trend (not monotone in |i - j|)",
                query=query,
                distances=near,
                buckets=pair,
            )
