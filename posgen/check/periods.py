"""Where a rotation turns back: the distances d at which R_d is (nearly) the identity.

A rotation R_m turns pair k by m·θ_k. Where every θ_k·d is a multiple of 2π, R_d = I
and R_m = R_{m+d} for every m: positions d apart get the same encoding (``unique``), and
the RoFormer bound (1/(d/2)) Σ_j |S_j| is back at its maximum at distance d (``decay``).
Such a d can lie far past the positions the checks read directly: θ_k = 2π(k + 1)/1000
repeats every 1000 positions, while ``unique`` compared positions within the span.

``turns_back`` finds every such d up to a reach exactly, without trying every d: d must
turn the angle θ_g (the ``generator``: whichever angle gives the fewest candidates,
typically the smallest, of the longest wavelength 2π/θ_g) back to within the tolerance δ
of a multiple 2πj, so d lies in [(2πj - δ)/θ_g, (2πj + δ)/θ_g] for j = 0, 1, …: a few
integers per j, about reach·θ_g/2π values of j. Those candidates are filtered on every
angle (vectorised, a chunk at a time, each angle on the survivors of the one before),
so the search up to 2^24 takes milliseconds for RoPE (base 10^4: 356 turns of its
slowest pair) and a tenth of a second where every angle is high (p-RoPE).

The angles are measured from the module (the eigen-angles of R_1, ``measured_angles``),
so the search needs nothing of the spec: it is exact for a rotation whose angles grow
linearly with the position (R_m = R_1^m, every fixed schedule). ``linear_reach`` checks
that at every power of two: a schedule that changes with the positions of the call
(dynamic NTK, LongRoPE past ``original_max_positions``) is not R_1^m past its switch,
and the search then stops below it.

Why 2^24 (``PERIOD_REACH``): float32 holds every integer up to 2^24 and no farther (m + 1
rounds to m past it), so no rotation computed from float32 positions keeps positions
apart past it; and ``decay``'s curve reaches at most 2^24 (``MAX_DECAY_REACH``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from posgen.check.contract import F64
from posgen.check.probe import Probe

PERIOD_REACH = 1 << 24
TWO_PI = 2 * math.pi
CANDIDATE_CHUNK = 1 << 20  # candidates filtered at once (8 MiB of float64 each)
# Slack on the measured angles, per unit of distance: the eigen-angles of R_1 are within
# about head_dim·eps (3e-14 at head_dim 128) of the module's θ_k, and d·θ_k and its
# reduction mod 2π round by a few eps·d·π more; d times that error is covered up to
# head_dim ~ 4000.
ANGLE_SLACK = 1e-12

Tolerance = Callable[[Tensor], Tensor]  # distances d (float64) -> the angle tolerance at d


def wrapped(distances: Tensor, angle: float) -> Tensor:
    """|d·θ mod 2π|, taken in (-π, π]: how far d turns the angle θ from a whole turn."""
    turned = distances * angle
    return (turned - TWO_PI * torch.round(turned / TWO_PI)).abs()


def turns_back(
    angles: Tensor, reach: int, tolerance: Tolerance, limit: int, start: int = 1
) -> list[int]:
    """The first ``limit`` distances d in [start, reach], ascending, at which every
    angle θ_k of ``angles`` is within ``tolerance(d)`` of a multiple of 2π
    (``tolerance`` non-decreasing in d). Exact: every such d is a candidate of the
    generator angle (module docstring), and each candidate is then judged on every
    angle."""
    start = max(1, start)
    if reach < start or limit < 1:
        return []
    thetas = torch.unique(angles.to(F64)).abs()
    if thetas.numel() == 0:  # nothing turns: R_d = I at every d
        return list(range(start, min(reach, start + limit - 1) + 1))
    widest = float(tolerance(torch.tensor([float(reach)], dtype=F64))[0])
    generator = _generator(thetas, reach, widest)
    # judge the generator first, then the others from the largest (the most selective)
    order = [generator, *sorted((float(t) for t in thetas if float(t) != generator), reverse=True)]
    # the turns' intervals are disjoint and ascending (each widened by one integer on
    # either side): the first ``limit`` found are then the first of all
    disjoint = 2 * widest + 2 * generator < TWO_PI
    found: list[int] = []
    for candidates in _candidates(generator, widest, start, reach):
        for angle in order:
            if candidates.numel() == 0:
                break
            candidates = candidates[wrapped(candidates, angle) <= tolerance(candidates)]
        found.extend(int(d) for d in candidates.tolist())
        if disjoint and len(found) >= limit:
            break
    return sorted(set(found))[:limit]


def _generator(thetas: Tensor, reach: int, widest: float) -> float:
    """The angle whose turns give the fewest candidates up to ``reach``: (⌊reach·θ/2π⌋
    + 1) turns of ⌈2δ/θ⌉ + 3 integers each."""
    counts = (torch.floor(reach * thetas / TWO_PI) + 1) * (torch.ceil(2 * widest / thetas) + 3)
    return float(thetas[int(counts.argmin())])


def _candidates(angle: float, widest: float, start: int, reach: int) -> Iterator[Tensor]:
    """Every integer d in [start, reach] within ``widest`` / θ of 2πj/θ for some turn j
    (widened by one on each side against rounding), in blocks of at most about
    ``CANDIDATE_CHUNK``, each ascending, turn after turn."""
    per_turn = math.ceil(2 * widest / angle) + 3
    step = max(1, CANDIDATE_CHUNK // per_turn)
    first = max(0, math.floor((start * angle - widest) / TWO_PI))
    last = math.floor((reach * angle + widest) / TWO_PI)
    for begin in range(first, last + 1, step):
        turns = torch.arange(begin, min(last, begin + step - 1) + 1, dtype=F64)
        low = torch.floor((TWO_PI * turns - widest) / angle).clamp(min=start)
        high = torch.ceil((TWO_PI * turns + widest) / angle).clamp(max=reach)
        if per_turn > CANDIDATE_CHUNK:  # one wide turn (every angle tiny): split it
            for a, b in zip(low.long().tolist(), high.long().tolist(), strict=True):
                for piece in range(a, b + 1, CANDIDATE_CHUNK):
                    yield torch.arange(piece, min(b, piece + CANDIDATE_CHUNK - 1) + 1).to(F64)
            continue
        counts = (high - low + 1).clamp(min=0).long()
        total = int(counts.sum())
        if total == 0:
            continue
        offsets = torch.arange(total) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        yield torch.unique(torch.repeat_interleave(low, counts) + offsets.to(F64))


def rotations_at(probe: Probe, position: int) -> tuple[Tensor, Tensor]:
    """R_m on the query and on the key side, [head_dim, head_dim] each (one call)."""
    eye = torch.eye(probe.head_dim, dtype=F64).view(1, 1, probe.head_dim, probe.head_dim)
    where = torch.full((probe.head_dim,), position, dtype=torch.int64)
    query, key = probe.pe64.rotate(eye, eye, where, where)
    return query[0, 0], key[0, 0]


def eigen_angles(matrix: Tensor) -> Tensor:
    """Every eigen-angle of a (scaled) rotation, in (-π, π]: ±θ per turning pair, 0 per
    feature left alone. A scale (YaRN's attention factor) leaves them unchanged."""
    return torch.linalg.eigvals(matrix).angle()


def measured_angles(matrix: Tensor) -> Tensor:
    """The angles one position turns the pairs by: the positive eigen-angles of R_1."""
    angles = eigen_angles(matrix)
    return angles[angles > 1e-12]


def linear_reach(probe: Probe, reach: int) -> tuple[int, int | None]:
    """(how far R_m = R_1^m was seen to hold, the first position where it does not, or
    None): the eigen-angles of R_m, on both sides, against m times those of R_1 (mod
    2π, as multisets), at every power of two m up to ``reach``; the reach is the last
    power of two that agreed (``reach`` itself where all did). A schedule chosen by the
    positions of the call (dynamic NTK, LongRoPE) is not R_1^m past its switch."""
    first = [eigen_angles(side) for side in rotations_at(probe, 1)]
    agreed, position = 1, 2
    while position <= reach:
        for one, side in zip(first, rotations_at(probe, position), strict=True):
            predicted = wrapped(one * position, 1.0).sort().values
            got = eigen_angles(side).abs().sort().values
            if not bool(((got - predicted).abs() <= 1e-10 + ANGLE_SLACK * position).all()):
                return agreed, position
        agreed, position = position, 2 * position
    return reach, None
