"""Property checks for positional encodings (DESIGN.md §5), driven by hypothesis.

``check_spec`` builds a spec's module in memory (nothing is written into generated/) and
tests it through the module contract only (``embed``, ``rotate``, ``score_bias``,
``scores``, ``forward``), never through the spec's name, so a new idea needs nothing but a
YAML file. Which route reaches the positions is decided from the validated ``Spec``:

* ``input`` (``spec.input`` is set): the table p_m = embed(t, m) for a constant token t
  (0, or 1 where embed(0, ·) is 0, as for x ⊙ p); logits are embed(x, i) Wq ·
  (embed(x, j) Wk)ᵀ with random float64 projections and content. An embed returning
  several parts (real, imaginary) is read as their concatenation; one that takes no
  explicit positions is read row by row from embed(x); one that cannot be called with x
  alone makes the properties it would serve "n/a", with the reason;
* ``rotation`` (``content_content`` rotates): R_m = rotate(I, m);
* ``scores`` (everything else, including term forms this file has never heard of): the
  module's ``scores`` with constant content (the same q at every query, the same k at
  every key, q · k = 0 so that a kept content term adds nothing).

The four claims (``unique``, ``relative``, ``decay``, ``extrapolates``) are each a
predicate over examples drawn by hypothesis; a stated claim is judged (a false claim comes
with hypothesis' shrunk counterexample), an absent one is measured and shown. Where a
property is a statement about a finite range, an exhaustive scan follows the random search,
so a claim of ``false`` is only confirmed when a counterexample is actually found.
``unique`` for scores that depend on j - i only compares distances (reaching past every
``max_distance`` the spec states); for other scores, positions as query and as key.
``extrapolates`` covers positions from the training length (the smallest
``max_positions`` stated, else the span) up to 16 times it.

Building-block invariants run where the block is present: rotations keep norms and are the
identity at 0 on both outputs of rotate, and R_1's eigen-angles are the spec's frequencies;
half and interleaved pairings differ by a fixed permutation; buckets lie in range, are
monotone and follow their recipe; slopes are positive, follow their recipe and the bias is
linear in distance; every backend agrees with eager, and causal=True with a mask the
checker builds itself; bf16 stays within bf16 error of fp32 at positions up to 2^20 (n/a
when the module rejects every example); a KV cache (an offset query block) reproduces the
matching rows of the full computation, in float64 scores and float32 forward.

No read goes past a table (``Probe.limit``: every max_positions, n² for n base rows), and
distances past ``EXACT_DISTANCES`` are sampled log-spaced, so work and memory stay bounded.
Every search stops drawing after its share of the time budget (``Budget.seconds`` per
property, ``Budget.spec_seconds`` per spec, slow modules only), and runs on one thread:
the tensors are small, and oversubscribed threads made it 10-20x slower.
"""

from __future__ import annotations

import copy
import math
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from posgen.codegen.inmemory import encoding_class, module_from_loaded
from posgen.spec.loader import LoadedSpec, load_spec
from posgen.spec.model import Spec, SpecModel

F64 = torch.float64
CLAIMS = ("unique", "relative", "decay", "extrapolates")
BLOCKS = (
    "rotation_norm",
    "rotation_pairing",
    "buckets",
    "slopes",
    "backends",
    "bf16",
    "kv_cache",
)
DESCRIPTIONS = {
    "unique": "distinct positions get distinct encodings",
    "relative": "shifting every position by c leaves the logits unchanged",
    "decay": "the position-only score (rotations: RoFormer bound) falls with distance",
    "extrapolates": "positions beyond the training length give finite outputs",
    "rotation_norm": "rotations keep norms and are the identity at position 0",
    "rotation_pairing": "half and interleaved pairings differ by a fixed permutation",
    "buckets": "buckets lie in range, are monotone in |i - j| and follow the recipe",
    "slopes": "slopes are positive and follow the named recipe",
    "backends": "every backend agrees with eager",
    "bf16": "bf16 input stays within bf16 error of fp32 (positions up to 2^20)",
    "kv_cache": "an offset query block reproduces the rows of the full computation",
}
EPS64 = torch.finfo(F64).eps
BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits
FAR = 1 << 20  # positions up to 2^20 for bf16
EXTRAPOLATION_FACTOR = 16  # extrapolation: positions up to 16x the training length


# --------------------------------------------------------------------------- results


@dataclass
class Budget:
    """How hard to look: hypothesis examples per property, its seed, the position span."""

    max_examples: int = 100
    seed: int = 0
    span: int = 512  # positions checked for unique/relative/decay (capped by a table)
    seconds: float = 10.0  # per property: no new examples after this (slow modules)
    spec_seconds: float = 45.0  # per spec: each property gets at most a fair share of it
    timed_out: bool = field(default=False, compare=False, repr=False)  # set by searches


@dataclass
class Outcome:
    """One property's result for one spec."""

    name: str
    kind: str  # "claim" | "block"
    claimed: bool | None
    holds: bool | None  # None: not applicable
    evidence: str
    counterexample: dict[str, Any] | None = None
    found_by: str | None = None  # "hypothesis" | "scan" | None
    curve: dict[str, Any] | None = None
    error: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """False for a refuted claim, a failed building block or an error."""
        if self.error:
            return False
        if self.kind == "claim":
            return self.claimed is None or self.holds is None or self.claimed == self.holds
        return self.holds is not False

    @property
    def verdict(self) -> str:
        if self.error:
            return "ERROR"
        if self.holds is None:
            return "n/a"
        state = "holds" if self.holds else "fails"
        if self.kind == "block":
            return state if self.holds else "FAILS"
        if self.claimed is None:
            return f"measured: {state}"
        return f"confirmed: {state}" if self.claimed == self.holds else f"REFUTED: {state}"

    def as_json(self) -> dict[str, Any]:
        return {
            "property": self.name,
            "kind": self.kind,
            "description": DESCRIPTIONS.get(self.name, ""),
            "claimed": self.claimed,
            "holds": self.holds,
            "verdict": self.verdict,
            "ok": self.ok,
            "evidence": self.evidence,
            "counterexample": self.counterexample,
            "found_by": self.found_by,
            "curve": self.curve,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Report:
    """All outcomes of one spec."""

    name: str
    path: str
    title: str
    route: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(outcome.ok for outcome in self.outcomes)

    def outcome(self, name: str) -> Outcome:
        return next(outcome for outcome in self.outcomes if outcome.name == name)

    def as_json(self) -> dict[str, Any]:
        return {
            "spec": self.name,
            "path": self.path,
            "title": self.title,
            "route": self.route,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "properties": [outcome.as_json() for outcome in self.outcomes],
        }


class Violation(AssertionError):
    """A property failed on one example: a readable message plus the example's facts."""

    def __init__(self, message: str, rank: float | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.rank = rank  # how far from the origin the example is (smaller is simpler)
        self.details = details


class _OutOfTime(Exception):
    """Raised inside a search once its time budget is spent (no failure found yet)."""


@dataclass
class Search:
    """What a search found: the (shrunk) violation, and the worst margin seen otherwise."""

    violation: Violation | None
    found_by: str | None
    examples: int
    worst: float


def _search(
    check: Callable[[Any], float],
    strategy: st.SearchStrategy,
    budget: Budget,
    scan: Callable[[], Iterable[Any]] | None = None,
) -> Search:
    """Run ``check`` on examples from ``strategy``; then, if nothing failed, on ``scan``.

    ``check`` returns a margin (how far from failing; reported as the worst seen) or raises
    Violation. hypothesis shrinks a failure and replays the minimal example last, so the
    last violation recorded is the shrunk counterexample.
    """
    failures: list[Violation] = []
    failing: list[Any] = []
    worst = [math.inf]
    count = [0]
    started = time.perf_counter()

    @seed(budget.seed)
    @settings(
        max_examples=budget.max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
    )
    @given(strategy)
    def run(example: Any) -> None:
        if count[0] and time.perf_counter() - started > budget.seconds:
            # out of time (slow modules): draw no more; while shrinking, keep the smallest
            # failing example found so far and let hypothesis replay only that one
            if not failures:
                raise _OutOfTime  # hypothesis shrinks it in no time; caught below
            if example != failing[-1]:
                return
        count[0] += 1
        try:
            margin = check(example)
        except Violation as violation:
            failures.append(violation)
            failing.append(example)
            raise
        worst[0] = min(worst[0], margin)

    try:
        run()
    except _OutOfTime:
        budget.timed_out = True
    except Violation:
        found = failures[-1]
        if scan is not None:
            # the scan orders candidates closest first: show the closest one as well
            for example in scan():
                try:
                    check(example)
                except Violation as closest:
                    simpler = (closest.rank is None or found.rank is None
                               or closest.rank < found.rank)
                    if closest.message != found.message and simpler:
                        found.message += f"; closest (scan): {closest.message}"
                        found.details["closest"] = closest.details
                    break
        return Search(found, "hypothesis", count[0], worst[0])
    if scan is not None:
        for example in scan():
            count[0] += 1
            try:
                worst[0] = min(worst[0], check(example))
            except Violation as violation:
                return Search(violation, "scan", count[0], worst[0])
    return Search(None, None, count[0], worst[0])


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _list(values: Iterable[Any], limit: int = 6) -> str:
    items = [str(v) for v in values]
    if len(items) > limit:
        items = items[: limit - 1] + ["…", items[-1]]
    return "[" + ", ".join(items) + "]"


def _generator(example_seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(example_seed)
    return generator


SEEDS = st.integers(0, 2**31 - 1)


# --------------------------------------------------------------------------- the probe


def _max_positions(model: Any) -> list[int]:
    """Every ``max_positions`` stated anywhere in the spec: tables that end there."""
    return _stated(model, "max_positions")


def to_float64(module: nn.Module) -> nn.Module:
    """Real floating tensors to float64 and complex ones to complex128, in place
    (``Module.to(torch.float64)`` would drop the imaginary part of complex tensors)."""

    def widen(tensor: Tensor) -> Tensor:
        if tensor.is_complex():
            return tensor.to(torch.complex128)
        return tensor.to(F64) if tensor.is_floating_point() else tensor

    return module._apply(widen)


class Probe:
    """One spec's module, instantiated with the spec's defaults, and its routes."""

    def __init__(self, loaded: LoadedSpec, budget: Budget) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        self.budget = budget
        self.module: types.ModuleType = module_from_loaded(loaded)
        self.cls = encoding_class(self.module)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(budget.seed)
            self.pe32: nn.Module = self.cls().eval()
            self.pe64: nn.Module = to_float64(copy.deepcopy(self.pe32))
        self.heads = int(self.pe32.heads)
        self.head_dim = int(self.pe32.head_dim)
        self.model_dim = int(self.pe32.model_dim) if self.spec.input is not None else None
        if self.spec.input is not None:
            self.route = "input"
        elif self.spec.rotation is not None:
            self.route = "rotation"
        else:
            self.route = "scores"
        # the training length: the smallest max_positions (extrapolation starts there)
        lengths = _max_positions(self.spec)
        self.length: int | None = min(lengths) if lengths else None
        # the positions a table can be read at: every max_positions, and n² for a table
        # of n base rows (hierarchical decomposition); every read stays below it
        limits = lengths + [n * n for n in _stated(self.spec, "base_positions")]
        self.limit: int | None = min(limits) if limits else None
        self.span = min(budget.span, self.limit) if self.limit else budget.span
        self._cache: dict[str, Any] = {}
        # How the input route can be driven: embed(x, positions) ("explicit"), only
        # embed(x) with the default positions 0..L-1 ("default"), or not at all (None,
        # with the reason in input_note; e.g. an embed that needs extra arguments).
        self.input_mode: str | None = None
        self.input_note = ""
        width = self.heads * self.head_dim
        if self.route == "input":
            probe_x = torch.zeros(1, 4, self.model_dim, dtype=F64)
            try:
                width = self.embed(self.pe64, probe_x, torch.arange(4)).shape[-1]
                self.input_mode = "explicit"
            except ValueError:
                try:
                    width = self.embed(self.pe64, probe_x, None).shape[-1]
                    self.input_mode = "default"
                    self.input_note = "embed takes no explicit positions"
                except ValueError as error:
                    self.input_note = f"embed(x) raises ValueError: {error}"
        generator = _generator(budget.seed + 1)
        project = self.heads * self.head_dim
        self.wq = torch.randn(width, project, generator=generator, dtype=F64) / math.sqrt(width)
        self.wk = torch.randn(width, project, generator=generator, dtype=F64) / math.sqrt(width)

    def route_text(self) -> str:
        """How positions are reached, in words (the report's route line)."""
        if self.route == "rotation":
            return "rotation: R_m = rotate(I, m)"
        if self.route == "scores":
            return "scores with constant content (q on even features, k on odd)"
        if self.input_mode is None:
            return f"input-level, not reachable ({self.input_note})"
        token = int(self.table_token)
        how = "embed(t, m)" if self.input_mode == "explicit" else "row m of embed(t)"
        return f"input-level table: p_m = {how}, constant token t = {token}"

    @property
    def through_embed(self) -> bool:
        """Whether logits are formed as (embed(x, positions)) W: input route, explicit."""
        return self.route == "input" and self.input_mode == "explicit"

    @staticmethod
    def embed(pe: nn.Module, x: Tensor, positions: Tensor | None) -> Tensor:
        """pe.embed, with a tuple of parts (e.g. real and imaginary) joined on features."""
        out = pe.embed(x) if positions is None else pe.embed(x, positions=positions)
        if isinstance(out, (tuple, list)):
            out = torch.cat([part for part in out], dim=-1)
        return out

    # ----------------------------------------------------------------- content and logits

    def content(self, generator: torch.Generator, n: int, m: int, dtype=F64):
        """Random content: token embeddings (through embed) or projected q, k; and v."""
        if self.through_embed:
            x_q = torch.randn(1, n, self.model_dim, generator=generator, dtype=F64)
            x_k = torch.randn(1, m, self.model_dim, generator=generator, dtype=F64)
            v = torch.randn(1, self.heads, m, self.head_dim, generator=generator, dtype=F64)
            return x_q.to(dtype), x_k.to(dtype), v.to(dtype)
        q = torch.randn(1, self.heads, n, self.head_dim, generator=generator, dtype=F64)
        k = torch.randn(1, self.heads, m, self.head_dim, generator=generator, dtype=F64)
        v = torch.randn(1, self.heads, m, self.head_dim, generator=generator, dtype=F64)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def project(self, pe: nn.Module, x_q: Tensor, x_k: Tensor, q_pos, k_pos):
        """Input route: embed(x, positions) W, split into heads: [1, heads, seq, head_dim]."""
        h_q = self.embed(pe, x_q, q_pos)
        h_k = self.embed(pe, x_k, k_pos)
        wq, wk = self.wq.to(h_q.dtype), self.wk.to(h_k.dtype)
        q = (h_q @ wq).view(1, -1, self.heads, self.head_dim).transpose(1, 2)
        k = (h_k @ wk).view(1, -1, self.heads, self.head_dim).transpose(1, 2)
        return q, k

    def logits(self, content, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """float64 pre-softmax logits [1, heads, N, M] for content at explicit positions."""
        a, b, _ = content
        if self.through_embed:
            q, k = self.project(self.pe64, a, b, q_pos, k_pos)
        else:
            q, k = a, b
        return self.pe64.scores(q, k, q_positions=q_pos, k_positions=k_pos)

    def forward(self, pe: nn.Module, content, q_pos, k_pos, **kwargs) -> Tensor:
        a, b, v = content
        if self.through_embed:
            q, k = self.project(pe, a, b, q_pos, k_pos)
        else:
            q, k = a, b
        return pe(q, k, v, q_positions=q_pos, k_positions=k_pos, **kwargs)

    # ----------------------------------------------------------------- position-only parts

    @property
    def table_token(self) -> float:
        """The constant token the table is read with: 0 (x + p gives p), or 1 where
        embed(0, m) is identically 0 (a multiplicative form such as x ⊙ p_m)."""
        if "token" not in self._cache:
            self._cache["token"] = 0.0
            silent = not bool(self.table(torch.arange(min(self.span, 64))).any())
            self._cache["token"] = 1.0 if silent else 0.0
        return self._cache["token"]

    def table(self, positions: Tensor) -> Tensor:
        """Input route: p_m = embed(t, m) for the constant token t, [len, width].

        Where embed takes no explicit positions, the rows of embed(t) over 0..max are
        read instead (cached)."""
        token = self._cache["token"] if "token" in self._cache else self.table_token
        if self.input_mode is None:
            raise ValueError(self.input_note)
        size = int(positions.max()) + 1 if positions.numel() else 1
        key = ("table", token)
        cached = self._cache.get(key)
        if cached is None or cached.shape[0] < size:
            # one call for every row up to the largest position (some tables are costly
            # to evaluate, e.g. integrated dynamics); rows are read by index
            size = max(size, 2 * cached.shape[0] if cached is not None else 64)
            if self.limit is not None:  # never read past the table (it raises there)
                size = max(min(size, self.limit), int(positions.max()) + 1)
            x = torch.full((1, size, self.model_dim), token, dtype=F64)
            every = torch.arange(size) if self.input_mode == "explicit" else None
            cached = self.embed(self.pe64, x, every)[0]
            self._cache[key] = cached
        return cached[positions]

    def constant_content(self, example_seed: int | None = None) -> tuple[Tensor, Tensor]:
        """The same q at every query and k at every key: [head_dim] each.

        Rotation route: q = k = 1 (the RoFormer picture: Σ cos((i-j)θ)). Otherwise a
        random q on the even features and a random k on the odd ones, so that a kept
        content term contributes exactly 0 and what remains is the position-only score.
        """
        if self.route == "rotation":
            ones = torch.ones(self.head_dim, dtype=F64)
            return ones, ones
        generator = _generator(self.budget.seed if example_seed is None else example_seed)
        q = torch.randn(self.head_dim, generator=generator, dtype=F64)
        k = torch.randn(self.head_dim, generator=generator, dtype=F64)
        if self.head_dim > 1:  # disjoint supports: q · k is exactly 0
            q[1::2] = 0.0
            k[0::2] = 0.0
        return q, k

    def position_scores(
        self, q_pos: Tensor, k_pos: Tensor, example_seed: int | None = None
    ) -> Tensor:
        """Position-only scores [heads, N, M] (input route: [1, N, M], p_i·p_j / √d)."""
        if self.route == "input":
            p_q, p_k = self.table(q_pos), self.table(k_pos)
            return (p_q @ p_k.T / math.sqrt(self.model_dim)).unsqueeze(0)
        q0, k0 = self.constant_content(example_seed)
        q = q0.expand(1, self.heads, q_pos.shape[0], self.head_dim).contiguous()
        k = k0.expand(1, self.heads, k_pos.shape[0], self.head_dim).contiguous()
        return self.pe64.scores(q, k, q_positions=q_pos, k_positions=k_pos)[0]

    def score_matrix(self, span: int) -> Tensor:
        """position_scores over [0, span)², cached."""
        key = f"scores{span}"
        if key not in self._cache:
            positions = torch.arange(span)
            self._cache[key] = self.position_scores(positions, positions)
        return self._cache[key]

    def rotation_matrix(self, position: int, side: int = 0) -> Tensor:
        """R_m as a [head_dim, head_dim] float64 matrix (row r = R_m e_r); side 0 is the
        query output of rotate, side 1 the key output."""
        eye = torch.eye(self.head_dim, dtype=F64).view(1, 1, self.head_dim, self.head_dim)
        where = torch.full((self.head_dim,), position, dtype=torch.int64)
        return self.pe64.rotate(eye, eye, where, where)[side][0, 0]

    def rotation_angles(self) -> Tensor:
        """θ_k measured from the module: the eigen-angles of R_1, descending."""
        if "angles" not in self._cache:
            angles = torch.linalg.eigvals(self.rotation_matrix(1)).angle()
            positive = angles[angles > 1e-12].sort(descending=True).values
            self._cache["angles"] = positive
        return self._cache["angles"]

    def roformer_bound(self, distances: Tensor) -> Tensor:
        """(1/(d/2)) Σ_j |S_j|, S_j = Σ_{k<j} e^{i r θ_k} (Su et al. 2021, §3.4.3)."""
        theta = self.rotation_angles()
        phases = torch.polar(
            torch.ones(distances.shape[0], theta.shape[0], dtype=F64),
            distances.to(F64).unsqueeze(-1) * theta,
        )
        return phases.cumsum(dim=-1).abs().mean(dim=-1)


# --------------------------------------------------------------------------- claims


def _unique(probe: Probe) -> tuple[Search, str]:
    span = probe.limit if probe.limit is not None else probe.span
    span = min(span, 4096)
    if probe.route == "input":
        table = probe.table(torch.arange(span))
        norms = table.norm(dim=-1)

        def check(example) -> float:
            m, n = example
            distance = float((table[m] - table[n]).norm())
            if distance <= 1e-12 * max(float(norms[m]), float(norms[n])):  # relative
                raise Violation(
                    f"positions {m} and {n} get the same input encoding "
                    f"(|p_{m} - p_{n}| = {_fmt(distance)})",
                    positions=[m, n], distance=distance,
                    values=[table[m][:4].tolist(), table[n][:4].tolist()],
                )
            return distance

        features = table
        what = "p_m"
    elif probe.route == "rotation":
        tol_base = 64 * EPS64 * probe.head_dim

        def check(example) -> float:
            m, n = example
            distance = min(
                float((probe.rotation_matrix(m, side) - probe.rotation_matrix(n, side)).norm())
                for side in (0, 1))  # the query and the key rotation
            tol = tol_base * (1 + max(m, n))
            if distance <= tol:
                raise Violation(
                    f"positions {m} and {n} get the same rotation "
                    f"(|R_{m} - R_{n}| = {_fmt(distance)})",
                    positions=[m, n], distance=distance,
                )
            return distance

        generator = _generator(probe.budget.seed)
        x = torch.randn(1, 1, span, probe.head_dim, generator=generator, dtype=F64)
        x = x[:, :, :1].expand(1, 1, span, probe.head_dim)
        positions = torch.arange(span)
        features, _ = probe.pe64.rotate(x.contiguous(), x.contiguous(), positions, positions)
        features = features[0, 0]
        what = "R_m"
    elif _shift_invariant_scores(probe):
        return _unique_distances(probe)
    else:
        # absolute positions in the scores: position m is its row (as a query) and its
        # column (as a key) of the position-only scores
        span = min(span, 512, max(16, math.isqrt(4_000_000 // probe.heads)))  # memory
        scores = probe.score_matrix(span)  # [heads, span, span]

        def check(example) -> float:
            m, n = example
            gap = max(float((scores[:, m, :] - scores[:, n, :]).abs().max()),
                      float((scores[:, :, m] - scores[:, :, n]).abs().max()))
            size = max(float(scores[:, m, :].abs().max()), float(scores[:, :, m].abs().max()))
            if gap <= 1e-12 * size:  # relative: tiny tables are not collisions
                raise Violation(
                    f"positions {m} and {n} get the same position scores, as a query and "
                    f"as a key, against every position in [0, {span}) in every head",
                    positions=[m, n], values=[scores[0, m, :4].tolist(),
                                              scores[0, n, :4].tolist()],
                )
            return gap

        rows = torch.cat((scores.transpose(0, 1).reshape(span, -1),
                          scores.permute(2, 0, 1).reshape(span, -1)), dim=1)
        generator = _generator(probe.budget.seed)
        features = rows @ torch.randn(rows.shape[1], 64, generator=generator, dtype=F64)
        what = "position scores (rows and columns)"

    def scan() -> Iterable[tuple[int, int]]:
        norms = (features * features).sum(-1)
        gram = norms.unsqueeze(0) + norms.unsqueeze(1) - 2 * features @ features.T
        gram.fill_diagonal_(math.inf)
        scale = torch.maximum(norms.unsqueeze(0), norms.unsqueeze(1))  # relative
        hit = gram <= 1e-9 * scale
        if bool(hit.any()):
            yield _closest_pair(hit, 0)
        else:
            flat = int(gram.argmin())
            yield (flat // span, flat % span)

    pairs = st.tuples(st.integers(0, span - 1), st.integers(0, span - 1)).filter(
        lambda t: t[0] != t[1]
    )
    search = _search(check, pairs, probe.budget, scan)
    return search, f"{what} for positions [0, {span})"


def _stated(model: Any, field_name: str, kind: type | tuple = int) -> list[Any]:
    """Every field called ``field_name`` (of type ``kind``, never bool) in the spec."""
    found: list[Any] = []
    if isinstance(model, SpecModel):
        for name in type(model).model_fields:
            value = getattr(model, name)
            if name == field_name and isinstance(value, kind) and not isinstance(value, bool):
                found.append(value)
            else:
                found.extend(_stated(value, field_name, kind))
    elif isinstance(model, (list, tuple)):
        for item in model:
            found.extend(_stated(item, field_name, kind))
    return found


def _shift_invariant_scores(probe: Probe) -> bool:
    """Whether the position-only scores depend on j - i only (a Toeplitz matrix)."""
    scores = probe.score_matrix(min(probe.span, 96))
    tol = 1e-9 * (1.0 + float(scores.abs().max()))
    return bool(((scores[:, 1:, 1:] - scores[:, :-1, :-1]).abs() <= tol).all())


EXACT_DISTANCES = 2048  # every distance in (-2048, 2048) is compared
FAR_DISTANCES = 512  # past it, this many log-spaced distances on each side


def distance_sample(reach: int) -> list[int]:
    """Distances k - q to compare, ordered by |d| (+d before -d): every one in (-E, E) for
    E = min(reach, EXACT_DISTANCES), then log-spaced ones out to ±reach (bounded work
    and memory however large a stated max_distance is)."""
    exact = min(reach, EXACT_DISTANCES)
    found = set(range(-exact + 1, exact))
    if reach > exact:
        far = torch.logspace(math.log10(exact), math.log10(reach), FAR_DISTANCES, dtype=F64)
        for value in far.round().long().unique().tolist():
            found.update((value, -value))
    return sorted(found, key=lambda d: (abs(d), d < 0))


def _unique_distances(probe: Probe) -> tuple[Search, str]:
    """Relative scores: distinct distances k - q must get distinct position scores.

    Distances run over (-R, R) with R = max(span, 2 × every max_distance the spec states),
    so the range reaches past any clip or bucket range the spec declares; past
    EXACT_DISTANCES they are sampled log-spaced (``distance_sample``).
    """
    reach = max([probe.budget.span] + [2 * d for d in _stated(probe.spec, "max_distance")])
    if probe.limit is not None:
        reach = min(reach, probe.limit // 2)
    reach = min(reach, 1 << 40)
    distances = distance_sample(reach)
    keys = torch.tensor(distances) + reach
    row = probe.position_scores(torch.tensor([reach]), keys)[:, 0, :]  # [heads, D]
    scale = row.abs().amax(dim=0)  # [D]
    tol = 1e-12 * float(scale.max())  # relative; for the scan's first pass only
    count = len(distances)

    def check(example) -> float:
        i1, i2 = sorted(example, key=lambda i: distances[i])
        d1, d2 = distances[i1], distances[i2]
        a, b = row[:, i1], row[:, i2]
        gap = float((a - b).abs().max())
        size = max(float(scale[i1]), float(scale[i2]))
        if gap <= 1e-12 * size:  # relative: a tiny table is not a collision
            raise Violation(
                f"distances k - q = {d1} and {d2} get the same position score in every head "
                f"(head 0: {_fmt(float(a[0]))} and {_fmt(float(b[0]))}; e.g. query {reach}, "
                f"keys {reach + d1} and {reach + d2})",
                rank=max(abs(d1), abs(d2)),
                distances=[d1, d2], query=reach, keys=[reach + d1, reach + d2],
                values=[a.tolist(), b.tolist()],
            )
        return gap

    def scan() -> Iterable[tuple[int, int]]:
        order = row[0].argsort()
        ranked = row[:, order]
        hit = False
        for step in range(1, 9):
            close = (ranked[:, step:] - ranked[:, :-step]).abs().amax(dim=0) <= tol
            if bool(close.any()):
                hit = True
                break
        if not hit:
            return
        # the collision closest to distance 0: walk distances by |d| until one repeats
        for index in range(1, count):
            gaps = (row[:, :index] - row[:, index:index + 1]).abs().amax(dim=0)
            if bool((gaps <= tol).any()):
                yield int((gaps <= tol).nonzero()[0]), index
                return

    @st.composite
    def pairs(draw):  # shrinks towards the smallest distances (the list starts at 0)
        first = draw(st.integers(0, count - 2))
        return first, first + draw(st.integers(1, count - 1 - first))

    search = _search(check, pairs(), probe.budget, scan)
    sampled = "" if reach <= EXACT_DISTANCES else (
        f", every one in (-{EXACT_DISTANCES}, {EXACT_DISTANCES}) and "
        f"{count - 2 * EXACT_DISTANCES + 1} log-spaced past it")
    return search, f"position scores of distinct distances in (-{reach}, {reach}){sampled}"


def _closest_pair(hit: Tensor, anchor: int) -> tuple[int, int]:
    """Among the True cells (a, b) of a square mask, the one with the smallest
    max(|a - anchor|, |b - anchor|), then the smallest (a, b)."""
    size = hit.shape[0]
    index = torch.arange(size)
    reach = (index - anchor).abs()
    order = torch.maximum(reach.unsqueeze(1), reach.unsqueeze(0)) * size * size
    order = order + index.unsqueeze(1) * size + index.unsqueeze(0)
    flat = int(torch.where(hit, order, torch.full_like(order, order.max() + 1)).argmin())
    return flat // size, flat % size


def unique(probe: Probe, claimed: bool | None) -> Outcome:
    unreachable = _input_unreachable(probe, "unique", claimed)
    if unreachable is not None:
        return unreachable
    search, what = _unique(probe)
    if search.violation is not None:
        return _failed("unique", "claim", claimed, search)
    return Outcome(
        "unique", "claim", claimed, True,
        f"no collision of {what} in {search.examples} examples (hypothesis and a scan); "
        f"smallest gap {_fmt(search.worst)}",
    )


def relative(probe: Probe, claimed: bool | None) -> Outcome:
    unreachable = _input_unreachable(probe, "relative", claimed, need_explicit=True)
    if unreachable is not None:
        return unreachable
    limit = probe.span // 2

    @st.composite
    def examples(draw):
        n = draw(st.integers(1, 3))
        m = draw(st.integers(1, 4))
        q_pos = draw(st.lists(st.integers(0, limit - 1), min_size=n, max_size=n))
        k_pos = draw(st.lists(st.integers(0, limit - 1), min_size=m, max_size=m))
        shift = draw(st.integers(1, limit))
        return q_pos, k_pos, shift, draw(SEEDS)

    def check(example) -> float:
        q_pos, k_pos, shift, example_seed = example
        content = probe.content(_generator(example_seed), len(q_pos), len(k_pos))
        q, k = torch.tensor(q_pos), torch.tensor(k_pos)
        before = probe.logits(content, q, k)
        after = probe.logits(content, q + shift, k + shift)
        top = max(q_pos + k_pos) + shift
        tol = 1e-11 * (1.0 + float(before.abs().max())) * (1.0 + top)
        delta = (after - before).abs()
        if float(delta.max()) > tol:
            _, h, i, j = (int(x) for x in divmod_index(int(delta.argmax()), delta.shape))
            raise Violation(
                f"query positions {q_pos}, key positions {k_pos}, shift c = {shift}: "
                f"head {h} logit[{i}, {j}] {_fmt(float(before[0, h, i, j]))} -> "
                f"{_fmt(float(after[0, h, i, j]))} (|Δ| {_fmt(float(delta.max()))} > "
                f"tol {_fmt(tol)})",
                q_positions=q_pos, k_positions=k_pos, shift=shift, head=h,
                values=[float(before[0, h, i, j]), float(after[0, h, i, j])],
                content_seed=example_seed,
            )
        return tol - float(delta.max())

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("relative", "claim", claimed, search)
    return Outcome(
        "relative", "claim", claimed, True,
        f"logits unchanged under {search.examples} random shifts (c ≤ {limit}) of random "
        f"content, float64",
    )


def divmod_index(flat: int, shape: torch.Size) -> list[int]:
    """Unravel a flat index into ``shape``."""
    out = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        out.append(rest)
    return list(reversed(out))


def _windows(span: int) -> list[tuple[int, int]]:
    """Distance windows [0,1), [1,2), [2,4), [4,8), …, up to span."""
    edges = [0, 1]
    while edges[-1] * 2 < span:
        edges.append(edges[-1] * 2)
    edges.append(span)
    return list(zip(edges[:-1], edges[1:], strict=True))


def _window_means(curve: Tensor, windows: list[tuple[int, int]]) -> list[float]:
    return [float(curve[a:b].mean()) for a, b in windows]


def decay_curve(probe: Probe, head: int = 0, query: int | None = None,
                example_seed: int | None = None, span: int | None = None) -> tuple[str, Tensor]:
    """(label, curve[r]) for r in [0, span): keys j = i - r before query i."""
    span = span or probe.span
    if probe.route == "rotation" and probe.spec.bias is None:
        return "RoFormer bound (1/(d/2)) Σ|S_j|", probe.roformer_bound(torch.arange(span))
    query = span - 1 if query is None else query
    keys = query - torch.arange(span)
    scores = probe.position_scores(torch.tensor([query]), keys, example_seed)
    label = "p_i · p_j / √d" if probe.route == "input" else "position-only score"
    return label, scores[min(head, scores.shape[0] - 1), 0]


def decay(probe: Probe, claimed: bool | None) -> Outcome:
    unreachable = _input_unreachable(probe, "decay", claimed)
    if unreachable is not None:
        return unreachable
    span = probe.span
    windows = _windows(span)
    top = (probe.limit or 2 * span) - 1
    bound_route = probe.route == "rotation" and probe.spec.bias is None
    heads = 1 if probe.route == "input" or bound_route else probe.heads

    @st.composite
    def examples(draw):
        return (
            draw(st.integers(0, heads - 1)),
            draw(st.integers(span - 1, max(span - 1, top))),
            draw(SEEDS),
        )

    def check(example) -> float:
        head, query, example_seed = example
        label, curve = decay_curve(probe, head, query, example_seed)
        means = _window_means(curve, windows)
        tol = 1e-9 * (1.0 + float(curve.abs().max()))
        where = "" if bound_route else f"head {head}, query {query}: "
        details = dict(head=None if bound_route else head,
                       query=None if bound_route else query,
                       windows=[list(w) for w in windows], means=means, curve_label=label)
        shown = "; window means " + ", ".join(_fmt(m) for m in means)
        for window in range(len(windows) - 1):
            a, b = windows[window], windows[window + 1]
            if means[window + 1] > means[window] + tol:
                raise Violation(
                    f"{where}{label} rises from distance window [{a[0]}, {a[1]}) to "
                    f"[{b[0]}, {b[1]}): mean {_fmt(means[window])} -> "
                    f"{_fmt(means[window + 1])}{shown}", window=window, **details,
                )
        if means[-1] >= means[0] - tol:
            raise Violation(
                f"{where}{label} does not fall: mean {_fmt(means[0])} at distance 0, "
                f"{_fmt(means[-1])} over [{windows[-1][0]}, {windows[-1][1]}){shown}",
                **details,
            )
        pairs = len(windows) - 1
        falls = sum(1 for x, y in zip(means, means[1:], strict=False) if y < x - tol)
        if 2 * falls < pairs:
            raise Violation(
                f"{where}{label} falls strictly between only {falls} of {pairs} adjacent "
                f"distance windows (at least half must){shown}", **details,
            )
        return min(x - y for x, y in zip(means, means[1:], strict=False))

    search = _search(check, examples(), probe.budget)
    label, curve = decay_curve(probe)
    means = _window_means(curve, windows)
    shown = {
        "label": label,
        "windows": [list(w) for w in windows],
        "means": means,
        "head": 0,
        "query": None if bound_route else span - 1,
        "values": [float(v) for v in curve],  # the curve at distances 0, 1, ..., span - 1
    }
    if search.violation is not None:
        outcome = _failed("decay", "claim", claimed, search)
        outcome.curve = shown
        return outcome
    scale = max(abs(m) for m in means)
    tidy = [0.0 if abs(m) <= 1e-12 * scale else m for m in means]  # q · k = 0 round-off
    over = " over windows" if bound_route else " over heads and query positions"
    tol = 1e-9 * (1.0 + float(curve.abs().max()))
    chain = _fmt(tidy[0])
    for before, after in zip(tidy, tidy[1:], strict=False):  # honest: = where equal
        chain += (" > " if after < before - tol else " < " if after > before + tol
                  else " = ") + _fmt(after)
    return Outcome(
        "decay", "claim", claimed, True,
        f"{label} on log windows of distance: {chain} "
        f"({search.examples} examples{over})",
        curve=shown,
    )


def extrapolates(probe: Probe, claimed: bool | None) -> Outcome:
    unreachable = _input_unreachable(probe, "extrapolates", claimed)
    if unreachable is not None:
        return unreachable
    start = probe.length if probe.length is not None else probe.span
    if probe.limit is not None and probe.limit < start:
        start = probe.limit  # a table that ends before the span: extrapolation starts there
    end = min(FAR, EXTRAPOLATION_FACTOR * start)  # positions in [start, end)
    default_only = probe.route == "input" and probe.input_mode == "default"

    @st.composite
    def examples(draw):
        n = draw(st.integers(1, 3))
        m = draw(st.integers(n, 5))
        if default_only:  # a longer sequence from 0: its last positions are past start
            m = draw(st.integers(start + 1, min(end, 4 * start)))
            n = min(n, m)
            return n, m, 0, draw(st.booleans()), draw(SEEDS)
        base = draw(st.integers(start, end - m))
        return n, m, base, draw(st.booleans()), draw(SEEDS)

    def run(content, q_pos, k_pos, causal, backend) -> Tensor:
        if not default_only:
            return probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal,
                                 backend=backend)
        x = torch.zeros(1, k_pos.shape[0], probe.model_dim).normal_(
            generator=_generator(int(k_pos.shape[0])))
        hidden = probe.embed(probe.pe32, x, None)  # default positions 0..m-1
        q, k, v = content
        return probe.pe32(q, k, v, causal=causal, backend=backend), hidden

    def check(example) -> float:
        n, m, base, causal, example_seed = example
        k_pos = torch.arange(base, base + m)
        q_pos = k_pos[m - n:]
        content = probe.content(_generator(example_seed), n, m, dtype=torch.float32)
        where = (f"a sequence of {m} tokens (positions 0..{m - 1})" if default_only else
                 f"query positions {q_pos.tolist()}, key positions {k_pos.tolist()}")
        top = int(k_pos.max())
        for backend in ("eager", "auto"):
            try:
                out = run(content, q_pos, k_pos, causal, backend)
            except ValueError as error:
                raise Violation(
                    f"{where}: raises ValueError: {error}", positions=k_pos.tolist()[-5:],
                    clear_error=True, backend=backend, rank=top,
                ) from None
            except Exception as error:  # noqa: BLE001 - any other failure is unclear
                raise Violation(
                    f"{where}: raises {type(error).__name__} (not a clear ValueError): "
                    f"{error}", positions=k_pos.tolist()[-5:], clear_error=False,
                    backend=backend, rank=top,
                ) from None
            outs = out if isinstance(out, tuple) else (out,)
            if not all(bool(torch.isfinite(o).all()) for o in outs):
                raise Violation(
                    f"{where}: non-finite output ({backend} backend)",
                    positions=k_pos.tolist()[-5:], backend=backend, rank=top,
                )
        return 0.0

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("extrapolates", "claim", claimed, search)
    where = (f"sequences of {start + 1}-{min(end, 4 * start)} tokens" if default_only
             else f"positions in [{start}, {end})")
    return Outcome(
        "extrapolates", "claim", claimed, True,
        f"finite outputs (eager and auto) at {where} ({EXTRAPOLATION_FACTOR}× the "
        f"training length {start}), {search.examples} examples",
    )


def _input_unreachable(probe: Probe, name: str, claimed: bool | None = None,
                       need_explicit: bool = False) -> Outcome | None:
    """An n/a outcome where positions enter through an embed the checker cannot drive."""
    if probe.route != "input":
        return None
    if probe.input_mode is None or (need_explicit and probe.input_mode != "explicit"):
        kind = "claim" if name in CLAIMS else "block"
        return Outcome(name, kind, claimed, None, f"cannot check: {probe.input_note}")
    return None


def _failed(name: str, kind: str, claimed: bool | None, search: Search) -> Outcome:
    violation = search.violation
    assert violation is not None
    how = "shrunk counterexample" if search.found_by == "hypothesis" else "found by scan"
    return Outcome(
        name, kind, claimed, False, f"{how}: {violation.message}",
        counterexample=_jsonable(violation.details), found_by=search.found_by,
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return value


# --------------------------------------------------------------------------- building blocks


def rotation_norm(probe: Probe) -> Outcome:
    if probe.spec.rotation is None:
        return Outcome("rotation_norm", "block", None, None, "no rotation in this spec")

    @st.composite
    def examples(draw):
        return draw(st.integers(0, FAR)), draw(SEEDS)

    def check(example) -> float:
        position, example_seed = example
        x = torch.randn(1, 1, 3, probe.head_dim, generator=_generator(example_seed), dtype=F64)
        y = torch.randn(1, 1, 3, probe.head_dim, generator=_generator(example_seed + 1),
                        dtype=F64)
        where = torch.full((3,), position)
        zero = torch.zeros(3, dtype=torch.int64)
        rotated = probe.pe64.rotate(x, y, where, where)
        at_zero = probe.pe64.rotate(x, y, zero, zero)
        tol = 1e-12 * float(torch.cat((x, y)).norm(dim=-1).max())
        norm_error = 0.0
        for side, inputs in (("query", x), ("key", y)):  # both outputs of rotate
            out = rotated[0 if side == "query" else 1]
            error = float((out.norm(dim=-1) - inputs.norm(dim=-1)).abs().max())
            if error > tol:
                raise Violation(
                    f"position {position}, {side} side: |R x| - |x| = {_fmt(error)} "
                    f"(tol {_fmt(tol)})", position=position, side=side,
                )
            zero_error = float((at_zero[0 if side == "query" else 1] - inputs).abs().max())
            if zero_error > 1e-15 * float(inputs.abs().max()) * 4:
                raise Violation(f"{side} side: R_0 x differs from x by {_fmt(zero_error)}",
                                position=0, side=side)
            norm_error = max(norm_error, error)
        return tol - norm_error

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("rotation_norm", "block", None, search)
    frequencies = _rotation_frequencies(probe)
    if isinstance(frequencies, Outcome):
        return frequencies
    return Outcome("rotation_norm", "block", None, True,
                   f"|R_m x| = |x| for m up to 2^20 and R_0 = I, query and key sides "
                   f"({search.examples} examples){frequencies}")


def _rotation_frequencies(probe: Probe) -> Outcome | str:
    """The eigen-angles of R_1 (query and key side) against the spec's frequencies:
    θ_k = base^(-2k / d_rot), d_rot = round(fraction · head_dim), k < d_rot / 2
    (RoFormer, Su et al. 2021, eq. 15). Evidence text, or a failed Outcome."""
    rotation = probe.spec.rotation
    if getattr(rotation.frequencies, "kind", None) != "standard":
        return f"; frequencies {rotation.frequencies.kind!r} not compared"
    rotary_dim = int(round(probe.head_dim * rotation.rotary_dims.fraction))
    expected = torch.tensor([rotation.base ** (-2.0 * k / rotary_dim)
                             for k in range(rotary_dim // 2)], dtype=F64)
    expected = expected.sort(descending=True).values
    for side, name in ((0, "query"), (1, "key")):
        angles = torch.linalg.eigvals(probe.rotation_matrix(1, side)).angle()
        got = angles[angles > 1e-12].sort(descending=True).values
        if got.shape != expected.shape or not bool(
                ((got - expected).abs() <= 1e-9 * expected).all()):
            worst = (int((got - expected).abs().argmax()) if got.shape == expected.shape
                     else None)
            shown = (f"θ_{worst} = {_fmt(float(got[worst]))}, base^(-2k/d_rot) gives "
                     f"{_fmt(float(expected[worst]))}" if worst is not None else
                     f"{got.shape[0]} rotating pairs, expected {expected.shape[0]}")
            return Outcome(
                "rotation_norm", "block", None, False,
                f"{name} side: the angles of R_1 are not base^(-2k/d_rot) with base "
                f"{rotation.base:g}, d_rot {rotary_dim}: {shown}",
                counterexample={"side": name, "measured": got.tolist()[:8],
                                "expected": expected.tolist()[:8]})
    return (f"; angles of R_1 equal base^(-2k/d_rot) (base {rotation.base:g}, "
            f"d_rot {rotary_dim}) on both sides")


def _variant(loaded: LoadedSpec, update: Callable[[dict], None], suffix: str) -> LoadedSpec:
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
    rotation = probe.spec.rotation
    if rotation is None:
        return Outcome("rotation_pairing", "block", None, None, "no rotation in this spec")
    if rotation.pairing not in ("half", "interleaved"):
        return Outcome("rotation_pairing", "block", None, None,
                       f"pairing {rotation.pairing!r} has no known permutation")
    other = "interleaved" if rotation.pairing == "half" else "half"

    def update(data: dict) -> None:
        data["terms"]["content_content"]["rotate"]["pairing"] = other

    variant = _variant(probe.loaded, update, other)
    other_pe = to_float64(encoding_class(module_from_loaded(variant))(
        heads=probe.heads, head_dim=probe.head_dim))
    half_pe, inter_pe = (probe.pe64, other_pe) if rotation.pairing == "half" else (
        other_pe, probe.pe64)
    rotary_dim = int(round(probe.head_dim * rotation.rotary_dims.fraction))
    perm = torch.tensor(half_to_interleaved(probe.head_dim, rotary_dim))

    @st.composite
    def examples(draw):
        return draw(st.integers(0, FAR)), draw(SEEDS)

    def check(example) -> float:
        position, example_seed = example
        x = torch.randn(1, 1, 2, probe.head_dim, generator=_generator(example_seed), dtype=F64)
        where = torch.full((2,), position)
        by_half, _ = half_pe.rotate(x, x, where, where)
        by_inter, _ = inter_pe.rotate(x[..., perm], x[..., perm], where, where)
        error = float((by_half[..., perm] - by_inter).abs().max())
        tol = 1e-12 * float(x.abs().max())
        if error > tol:
            raise Violation(
                f"position {position}: half(x)[P] and interleaved(x[P]) differ by "
                f"{_fmt(error)}", position=position,
            )
        return tol - error

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("rotation_pairing", "block", None, search)
    return Outcome(
        "rotation_pairing", "block", None, True,
        f"half(x)[P] = interleaved(x[P]) with P = {_list(perm.tolist())} "
        f"({other} module built in memory; {search.examples} examples)",
    )


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


BUCKET_RECIPES = {"t5": t5_bucket}


def buckets(probe: Probe) -> Outcome:
    bias = probe.spec.bias
    index = getattr(bias, "index", None)
    count = getattr(index, "buckets", None)
    if bias is None or not isinstance(count, int):
        return Outcome("buckets", "block", None, None, "no bucketed bias in this spec")
    pe = copy.deepcopy(probe.pe64)
    # the bucket table: [buckets, heads], or [buckets + r, heads] with r spare rows (e.g.
    # a first-token reset's row); cells that read a spare row are not buckets
    tables = [p for p in pe.parameters() if p.dim() == 2 and p.shape[1] == probe.heads
              and count <= p.shape[0] <= count + 2]
    if len(tables) != 1:
        return Outcome("buckets", "block", None, None,
                       f"no single [{count}, heads] table parameter to read buckets from")
    rows = int(tables[0].shape[0])
    span = 4 * int(getattr(index, "max_distance", probe.span))
    if probe.limit is not None:
        span = min(span, probe.limit)  # never past a table
    # read ids as bias(table = arange) - bias(table = 0): other position terms cancel
    with torch.no_grad():
        tables[0].zero_()
    zero_pe = copy.deepcopy(pe)
    with torch.no_grad():
        tables[0].copy_(torch.arange(rows, dtype=F64).unsqueeze(-1).expand(rows, probe.heads))
    recipe = BUCKET_RECIPES.get(getattr(index, "recipe", ""))
    sign = -1 if getattr(index, "sign", "key_minus_query") == "query_minus_key" else 1
    bidirectional = bool(getattr(index, "bidirectional", True))

    # a first-token reset (spec field first_token: reset) gives query and key position 0
    # constants of their own: those cells are not buckets
    reset = "reset" in _stated(probe.spec, "first_token", str)
    distances = torch.tensor(distance_sample(span))  # all within ±2048, log-spaced past
    max_distance = int(getattr(index, "max_distance", 0))
    expected_of: dict[int, int] = {}

    def expected(relative: int) -> int:
        if relative not in expected_of:
            expected_of[relative] = recipe(sign * relative, bidirectional, count, max_distance)
        return expected_of[relative]

    def check(query: int) -> float:
        keys = (query + distances).unique()  # sorted
        keys = keys[(keys >= 0) & (keys < span)]
        row = (pe.score_bias(torch.tensor([query]), keys)[0, 0]
               - zero_pe.score_bias(torch.tensor([query]), keys)[0, 0])  # every head alike
        bad = ((row - row.round()).abs() > 1e-9) | (row < 0) | (row >= rows)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise Violation(f"query {query}, key {int(keys[at])}: bucket {_fmt(float(row[at]))} "
                            f"outside [0, {count})", query=query, key=int(keys[at]),
                            bucket=float(row[at]))
        row = row.round()
        bucketed = row < count  # the rest read a spare row (a reset): not buckets
        if reset:
            bucketed &= keys != 0
            if query == 0:
                bucketed &= False
        keys, row = keys[bucketed], row[bucketed]
        if recipe is not None:
            for key, value in zip(keys.tolist(), row.tolist(), strict=True):
                want = expected(key - query)
                if int(value) != want:
                    raise Violation(
                        f"query {query}, key {key}: bucket {int(value)}, the independent "
                        f"{index.recipe} recipe gives {want}", query=query, key=key,
                        bucket=int(value), expected=want)
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
                    query=query, distances=near, buckets=pair)
        return 0.0

    top = span - 1
    first = 1 if reset else 0
    search = _search(check, st.integers(first, top), probe.budget,
                     lambda: [first, span // 2, top])
    if search.violation is not None:
        return _failed("buckets", "block", None, search)
    how = f"equal to an independent {index.recipe} recipe" if recipe else (
        "no independent implementation of its recipe")
    return Outcome("buckets", "block", None, True,
                   f"integer, in [0, {count}), monotone in |i - j| on each side for keys in "
                   f"[0, {span}) (every distance up to {EXACT_DISTANCES}, log-spaced past "
                   f"it); {how} ({search.examples} query rows)"
                   + ("; query and key position 0 excluded (first-token reset)" if reset
                      else ""))


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


SLOPE_RECIPES = {"alibi_geometric": alibi_geometric_slopes}


def slopes(probe: Probe) -> Outcome:
    bias = probe.spec.bias
    recipe_name = getattr(bias, "slopes", None)
    if bias is None or not isinstance(recipe_name, str):
        return Outcome("slopes", "block", None, None, "no slope bias in this spec")
    recipe = SLOPE_RECIPES.get(recipe_name)

    def measured(heads: int) -> list[float]:
        """slope_h = bias(i, i) - bias(i, i - 1), read through score_bias."""
        pe = to_float64(probe.cls(heads=heads, head_dim=probe.head_dim))
        row = pe.score_bias(torch.tensor([5]), torch.tensor([5, 4]))[:, 0]  # [heads, 2]
        return (row[:, 0] - row[:, 1]).tolist()

    distances = [1, 2, 3, 5, 8, 13, 21, 40]
    anchor = 64

    def linear(heads: int) -> None:
        """bias(i, i ± d) - bias(i, i) = d (bias(i, i ± 1) - bias(i, i)) on each side."""
        pe = to_float64(probe.cls(heads=heads, head_dim=probe.head_dim))
        for side, sign in (("before", -1), ("after", 1)):
            keys = torch.tensor([anchor] + [anchor + sign * d for d in distances])
            row = pe.score_bias(torch.tensor([anchor]), keys)[:, 0]  # [heads, 1 + D]
            if not bool(torch.isfinite(row).all()):
                continue  # a masked side (no bias to compare)
            step = row[:, 1] - row[:, 0]
            for index, d in enumerate(distances):
                got = row[:, 1 + index] - row[:, 0]
                error = float((got - d * step).abs().max())
                if error > 1e-9 * (1.0 + float((d * step).abs().max())):
                    h = int((got - d * step).abs().argmax())
                    raise Violation(
                        f"{heads} heads: head {h}, keys {side} query {anchor}: bias at "
                        f"distance {d} is {_fmt(float(got[h]))}, not {d} × the step at "
                        f"distance 1 ({_fmt(float(step[h]))}): not linear in distance",
                        heads=heads, head=h, distance=d, side=side)

    def check(heads: int) -> float:
        got = measured(heads)
        linear(heads)
        if min(got) <= 0:
            h = min(range(heads), key=lambda h: got[h])
            raise Violation(f"{heads} heads: head {h} has slope {_fmt(got[h])} ≤ 0",
                            heads=heads, head=h, values=got)
        if recipe is not None:
            expected = recipe(heads)
            for h, (a, b) in enumerate(zip(got, expected, strict=True)):
                if abs(a - b) > 1e-6 * b:
                    raise Violation(
                        f"{heads} heads: head {h} has slope {_fmt(a)}, the {recipe_name} "
                        f"recipe gives {_fmt(b)}", heads=heads, head=h, values=got,
                        expected=expected)
        return min(got)

    search = _search(check, st.integers(1, 64), probe.budget,
                     lambda: [probe.heads, 1, 3, 12])
    if search.violation is not None:
        return _failed("slopes", "block", None, search)
    first = measured(probe.heads)
    how = f"equal to an independent {recipe_name} recipe" if recipe else (
        f"no independent implementation of {recipe_name!r}")
    return Outcome("slopes", "block", None, True,
                   f"positive; {how} for 1-64 heads; linear in distance on both sides "
                   f"(distances {_list(distances, 9)}); {probe.heads} heads: "
                   f"{_list(_fmt(s) for s in first)}")


def _backend_names(probe: Probe) -> list[str]:
    names = getattr(probe.module, "BACKENDS", ("eager", "sdpa"))
    return [name for name in names if name not in ("eager", "flex")]


def backends(probe: Probe) -> Outcome:
    unreachable = _input_unreachable(probe, "backends")
    if unreachable is not None:
        return unreachable
    names = _backend_names(probe)
    skipped = [n for n in getattr(probe.module, "BACKENDS", ()) if n == "flex"]
    longest = min(9, probe.span)  # never past a table

    @st.composite
    def examples(draw):
        n = draw(st.integers(1, longest))
        m = draw(st.integers(n, longest))
        start = draw(st.integers(0, max(0, probe.span - m)))
        return n, m, start, draw(st.booleans()), draw(st.booleans()), draw(SEEDS)

    def check(example) -> float:
        n, m, start, causal, explicit, example_seed = example
        content = probe.content(_generator(example_seed), n, m, dtype=torch.float32)
        k_pos = torch.arange(start, start + m) if explicit else None
        q_pos = k_pos[m - n:] if explicit else None
        if probe.through_embed and not explicit:
            k_pos, q_pos = torch.arange(m), torch.arange(m - n, m)
        eager = probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal,
                              backend="eager")
        worst = math.inf
        for name in names:
            out = probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal,
                                backend=name)
            error = float((out - eager).abs().max())
            tol = 2e-5 + 1e-4 * float(eager.abs().max())
            if not error <= tol:
                raise Violation(
                    f"backend {name!r} differs from eager by {_fmt(error)} (N={n}, M={m}, "
                    f"positions from {start if explicit else 'default'}, causal={causal})",
                    backend=name, n=n, m=m, start=start, causal=causal,
                )
            worst = min(worst, tol - error)
        if causal:
            _causal_reference(probe, content, eager, n, m, q_pos, k_pos, start, explicit)
        return worst

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("backends", "block", None, search)
    note = f"; skipped {', '.join(skipped)} (compiles)" if skipped else ""
    return Outcome("backends", "block", None, True,
                   f"{', '.join(names)} agree with eager in float32 ({search.examples} "
                   f"examples, causal and not, default and explicit positions); causal "
                   f"equals an explicit key ≤ query mask and softmax(scores + own mask) "
                   f"v{note}")


def _causal_reference(probe: Probe, content, eager: Tensor, n: int, m: int, q_pos, k_pos,
                      start: int, explicit: bool) -> None:
    """causal=True against a mask the checker builds itself from the positions (key
    position ≤ query position): through attn_mask (bool, True = attend), and through
    softmax(scores + mask) v computed here in float64 from the module's ``scores``
    (compared with out(v) - out(0), so that a value term cancels)."""
    q_eff = q_pos if q_pos is not None else torch.arange(m - n, m)
    k_eff = k_pos if k_pos is not None else torch.arange(m)
    allowed = k_eff.unsqueeze(0) <= q_eff.unsqueeze(1)  # [n, m]
    where = f"N={n}, M={m}, positions from {start if explicit else 'default'}"
    masked = probe.forward(probe.pe32, content, q_pos, k_pos, attn_mask=allowed,
                           backend="eager")
    error = float((masked - eager).abs().max())
    tol = 2e-5 + 1e-4 * float(eager.abs().max())
    if not error <= tol:
        raise Violation(
            f"causal=True differs from attn_mask = (key ≤ query) by {_fmt(error)} ({where})",
            n=n, m=m, start=start, causal=True)
    wide = tuple(t.to(F64) for t in content)
    logits = probe.logits(wide, q_eff, k_eff)  # [1, heads, n, m] float64
    weights = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
    own = weights @ wide[2]
    # out(v) - out(0) = A v: a value term (Shaw's relative values) cancels
    out64 = probe.forward(probe.pe64, wide, q_pos, k_pos, causal=True, backend="eager")
    out64 = out64 - probe.forward(probe.pe64, (wide[0], wide[1], torch.zeros_like(wide[2])),
                                  q_pos, k_pos, causal=True, backend="eager")
    error = float((out64 - own).abs().max())
    tol = 1e-9 * (1.0 + float(own.abs().max()))
    if not error <= tol:
        raise Violation(
            f"causal=True differs from softmax(scores + key ≤ query mask) v by "
            f"{_fmt(error)} ({where})", n=n, m=m, start=start, causal=True)


def bf16(probe: Probe) -> Outcome:
    unreachable = _input_unreachable(probe, "bf16")
    if unreachable is not None:
        return unreachable
    top = (probe.limit - 1) if probe.limit is not None else FAR
    usable = [0]
    rejected: list[str] = []
    mode = probe.input_mode if probe.route == "input" else None
    if mode == "default":
        top = 63  # default positions only: sequences of up to 64 tokens

    @st.composite
    def examples(draw):
        n = draw(st.integers(1, 4))
        m = draw(st.integers(n, max(n, min(8, top + 1))))
        base = draw(st.integers(0, max(0, top - m + 1)))
        if mode == "default":
            m, base = base + m, 0
        return n, m, base, draw(st.booleans()), draw(SEEDS)

    def compare(content, wide, q_pos, k_pos, causal):
        if mode == "explicit":
            want = probe.embed(probe.pe32, wide[1], k_pos)
            got = probe.embed(probe.pe32, content[1], k_pos).float()
            return got, want, 2 * BF16_EPS * (1.0 + float(want.abs().max())), "embed"
        if mode == "default":
            x = torch.zeros(1, k_pos.shape[0], probe.model_dim).normal_(
                generator=_generator(int(k_pos.shape[0])))
            want = probe.embed(probe.pe32, x.bfloat16().float(), None)
            got = probe.embed(probe.pe32, x.bfloat16(), None).float()
            return got, want, 2 * BF16_EPS * (1.0 + float(want.abs().max())), "embed"
        want = probe.forward(probe.pe32, wide, q_pos, k_pos, causal=causal)
        got = probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal).float()
        logits = probe.pe32.scores(wide[0], wide[1], q_positions=q_pos, k_positions=k_pos)
        spread = float(logits.abs().max())
        tol = 2 * BF16_EPS * (1.0 + spread) * float(wide[2].abs().max())
        return got, want, tol, "attention output"

    def check(example) -> float:
        n, m, base, causal, example_seed = example
        k_pos = torch.arange(base, base + m)
        q_pos = k_pos[m - n:]
        content = probe.content(_generator(example_seed), n, m, dtype=torch.bfloat16)
        wide = tuple(t.float() for t in content)
        shown = k_pos.tolist() if m <= 8 else f"0..{m - 1}"
        try:
            got, want, tol, what = compare(content, wide, q_pos, k_pos, causal)
        except ValueError as error:
            rejected.append(str(error))
            return math.inf  # positions the encoding rejects in any dtype: not a bf16 matter
        usable[0] += 1
        if not bool(torch.isfinite(want).all()):
            raise Violation(f"positions {shown}: the fp32 {what} is not finite",
                            positions=k_pos.tolist()[-8:], rank=int(k_pos.max()))
        error = float((got - want).abs().max())
        if not error <= tol:
            raise Violation(
                f"positions {shown}: bf16 {what} differs from fp32 by "
                f"{_fmt(error)} (bf16 error bound {_fmt(tol)})",
                positions=k_pos.tolist()[-8:], error=error, tol=tol, rank=int(k_pos.max()),
            )
        return tol - error

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("bf16", "block", None, search)
    if not usable[0]:  # nothing was compared: no verdict
        why = f": ValueError: {rejected[-1]}" if rejected else ""
        return Outcome("bf16", "block", None, None,
                       f"cannot check: every example was rejected by the module{why}")
    reach = "up to 2^20" if top == FAR else f"up to {top}"
    skipped = f"; {len(rejected)} rejected by the module (ValueError)" if rejected else ""
    return Outcome("bf16", "block", None, True,
                   f"within bf16 error of fp32 at positions {reach} "
                   f"({usable[0]} examples compared{skipped})")


def kv_cache(probe: Probe) -> Outcome:
    unreachable = _input_unreachable(probe, "kv_cache", need_explicit=True)
    if unreachable is not None:
        return unreachable

    longest = min(10, probe.span)  # never past a table
    if longest < 2:
        return Outcome("kv_cache", "block", None, None,
                       f"cannot check: the table holds {probe.span} position")

    @st.composite
    def examples(draw):
        m = draw(st.integers(2, longest))
        return m, draw(st.integers(1, m - 1)), draw(st.integers(0, probe.span - m)), draw(SEEDS)

    def check(example) -> float:
        m, cut, start, example_seed = example
        content = probe.content(_generator(example_seed), m, m)
        positions = torch.arange(start, start + m)
        full = probe.logits(content, positions, positions)
        a, b, v = content
        block = (a[:, cut:], b, v) if probe.through_embed else (a[:, :, cut:], b, v)
        part = probe.logits(block, positions[cut:], positions)
        tol = 1e-10 * (1.0 + float(full.abs().max()))
        error = float((part - full[:, :, cut:]).abs().max())
        if not error <= tol:
            raise Violation(
                f"positions {start}..{start + m - 1}: the query block from row {cut} differs "
                f"from the full rows by {_fmt(error)}", m=m, cut=cut, start=start)
        if not probe.through_embed:
            by_default = probe.pe64.scores(a[:, :, cut:], b)
            reference = probe.pe64.scores(a, b)[:, :, cut:]
            error = float((by_default - reference).abs().max())
            if not error <= tol:
                raise Violation(
                    f"default positions, M={m}: the last {m - cut} queries differ from "
                    f"the full rows by {_fmt(error)}", m=m, cut=cut)
            # float32 through forward, default positions (the float32 caches' path)
            a32, b32, v32 = (t.float() for t in content)
            for causal in (False, True):
                whole = probe.pe32(a32, b32, v32, causal=causal)[:, :, cut:]
                last = probe.pe32(a32[:, :, cut:], b32, v32, causal=causal)
                error32 = float((last - whole).abs().max())
                tol32 = 1e-5 * (1.0 + float(whole.abs().max()))
                if not error32 <= tol32:
                    raise Violation(
                        f"float32 forward, default positions, M={m}, causal={causal}: the "
                        f"last {m - cut} queries differ from the full rows by "
                        f"{_fmt(error32)}", m=m, cut=cut, causal=causal)
        return tol - error

    search = _search(check, examples(), probe.budget)
    if search.violation is not None:
        return _failed("kv_cache", "block", None, search)
    return Outcome("kv_cache", "block", None, True,
                   f"offset query blocks equal the full rows, explicit and default positions "
                   f"(float64 scores; float32 forward with default positions) "
                   f"({search.examples} examples)")


CLAIM_CHECKS: dict[str, Callable[[Probe, bool | None], Outcome]] = {
    "unique": unique,
    "relative": relative,
    "decay": decay,
    "extrapolates": extrapolates,
}
BLOCK_CHECKS: dict[str, Callable[[Probe], Outcome]] = {
    "rotation_norm": rotation_norm,
    "rotation_pairing": rotation_pairing,
    "buckets": buckets,
    "slopes": slopes,
    "backends": backends,
    "bf16": bf16,
    "kv_cache": kv_cache,
}
PROPERTIES = CLAIMS + BLOCKS


def check_loaded(
    loaded: LoadedSpec,
    budget: Budget | None = None,
    only: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Check every property (or ``only`` those) of one loaded spec."""
    budget = budget or Budget()
    started = time.perf_counter()
    threads = torch.get_num_threads()
    # Every tensor here is small: one thread avoids oversubscription (on a busy 2-core
    # machine, 2 threads made the checks 10-20x slower).
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return _check_loaded(loaded, budget, only, progress, started)
    finally:
        torch.set_num_threads(threads)


def _check_loaded(loaded, budget, only, progress, started) -> Report:
    wanted = list(PROPERTIES) if only is None else [p for p in PROPERTIES if p in set(only)]
    try:
        probe = Probe(loaded, budget)
    except Exception as error:  # noqa: BLE001 - a module that cannot even be built
        report = Report(loaded.spec.name, loaded.display_path, loaded.spec.title,
                        "none: the module could not be built")
        for name in wanted:
            report.outcomes.append(Outcome(
                name, "claim" if name in CLAIMS else "block",
                getattr(loaded.spec.claims, name) if name in CLAIMS else None, None,
                f"building the module failed: {type(error).__name__}: {error}", error=True))
        report.seconds = time.perf_counter() - started
        return report
    try:
        route = probe.route_text()
    except Exception as error:  # noqa: BLE001 - reported, never a traceback
        route = f"{probe.route} (the table could not be read: {type(error).__name__}: {error})"
    report = Report(loaded.spec.name, loaded.display_path, loaded.spec.title, route)
    for done, name in enumerate(wanted):
        began = time.perf_counter()
        claimed = getattr(loaded.spec.claims, name) if name in CLAIMS else None
        # the per-spec cap: what is left of spec_seconds, shared by the properties left
        left = budget.spec_seconds - (began - started)
        share = max(0.2, left / (len(wanted) - done))
        probe.budget = replace(budget, seconds=min(budget.seconds, share), timed_out=False)
        try:
            if name in CLAIM_CHECKS:
                outcome = CLAIM_CHECKS[name](probe, claimed)
            else:
                outcome = BLOCK_CHECKS[name](probe)
        except Exception as error:  # noqa: BLE001 - reported, never a traceback
            outcome = Outcome(
                name, "claim" if name in CLAIMS else "block", claimed, None,
                f"{type(error).__name__}: {error}", error=True,
            )
        outcome.seconds = time.perf_counter() - began
        if probe.budget.timed_out:
            outcome.evidence += (f" [stopped drawing at the {probe.budget.seconds:.3g} s "
                                 f"time budget]")
        report.outcomes.append(outcome)
        if progress is not None:
            progress(name)
    report.seconds = time.perf_counter() - started
    return report


def check_spec(path: Path, budget: Budget | None = None, **kwargs: Any) -> Report:
    """Load, build in memory and check one spec file (raises SpecError if invalid)."""
    return check_loaded(load_spec(path), budget, **kwargs)
