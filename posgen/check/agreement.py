"""Agreement blocks: ``backends``, ``bf16`` and ``kv_cache``.

Each compares two computations that must agree, on examples drawn by hypothesis:

* ``backends``: every backend the module lists (but eager and flex, which compiles)
  agrees with eager in float32, causal or not, at default and explicit positions; and
  causal=True equals a mask the checker builds itself from the positions (key ≤ query),
  both through ``attn_mask`` and as softmax(scores + mask) v computed here in float64;
* ``bf16``: bf16 input stays within bf16 error (``BF16_EPS``) of fp32 at positions up to
  2^20 (the attention output; embed's output on the input route); positions the module
  rejects with a ValueError in any dtype are skipped, and it is n/a when every example
  was rejected. Each query row of the attention output is held to
  2·BF16_EPS·(1 + spread + size)·max|v|, where spread is that row's max − min over the
  logits it attends to (``_row_spread``): softmax ignores a constant added to a row, so
  a bias that is large but the same along the row moves nothing (a bound on max|logit|
  with biases passed any output once they were large: a wrong path went unseen); and
  size is the row's largest content_content logit (``_row_content_size``): rounding q
  and k to bf16 moves a content logit by a share of its size, which a query scale makes
  large while the row's logits may stay close together;
* ``kv_cache``: an offset query block (the queries from row ``cut`` on, as a KV cache
  sees them) reproduces the matching rows of the full computation, in float64 logits at
  explicit positions; where q and k are given directly (not formed through embed) also
  in float64 scores and the float32 forward at default positions (and, for a rotation,
  with the keys rotated once by ``rotate_keys``).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.contract import F64, Content, Encoding, content_as
from posgen.check.probe import Probe, input_unreachable
from posgen.check.search import FAR, SEEDS, Violation, fmt, generator, run_search
from posgen.check.verdicts import Outcome, failed

BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits

# queries N, keys M, first key position, causal, explicit positions, the content's seed
BackendExample = tuple[int, int, int, bool, bool, int]
# queries N, keys M, first key position, causal, the content's seed
Bf16Example = tuple[int, int, int, bool, int]
# keys M, the first cached query row, first position, the content's seed
CacheExample = tuple[int, int, int, int]


# --------------------------------------------------------------------------- backends


def _backend_names(probe: Probe) -> list[str]:
    """The backends compared with eager: every one the module lists but eager, and flex
    where a value-side term rules it out (FlexAttention does not return the weights)."""
    names = getattr(probe.module, "BACKENDS", ("eager", "sdpa"))
    return [name for name in names if name != "eager" and name not in _skipped(probe)]


def _skipped(probe: Probe) -> list[str]:
    names = getattr(probe.module, "BACKENDS", ())
    value_term = bool(getattr(probe.pe32, "has_value_term", False))
    return [name for name in names if name == "flex" and value_term]


def backends(probe: Probe) -> Outcome:
    """Every backend agrees with eager; causal=True equals the checker's own mask."""
    unreachable = input_unreachable(probe, "backends")
    if unreachable is not None:
        return unreachable
    overflow = _overflow_in_span(probe)
    if overflow is not None:
        return Outcome("backends", "block", None, False, overflow)
    names = _backend_names(probe)
    skipped = _skipped(probe)
    longest = min(9, probe.span)  # never past a table

    @st.composite
    def examples(draw: st.DrawFn) -> BackendExample:
        n = draw(st.integers(1, longest))
        m = draw(st.integers(n, longest))
        start = draw(st.integers(0, max(0, probe.span - m)))
        return n, m, start, draw(st.booleans()), draw(st.booleans()), draw(SEEDS)

    def check(example: BackendExample) -> float:
        return _backends_agree(probe, names, example)

    search = run_search(check, examples(), probe.budget)
    if search.violation is not None:
        return failed("backends", "block", None, search)
    note = f"; skipped {', '.join(skipped)} (a value-side term)" if skipped else ""
    return Outcome(
        "backends",
        "block",
        None,
        True,
        f"{', '.join(names)} agree with eager in float32 ({search.examples} "
        f"examples, causal and not, default and explicit positions); causal "
        f"equals an explicit key ≤ query mask and softmax(scores + own mask) "
        f"v{note}",
    )


# the widest call _overflow_in_span makes: its bias alone is [heads, N, N] float32
OVERFLOW_SPAN = 1024


def _overflow_in_span(probe: Probe) -> str | None:
    """Why eager's float32 output is not finite on the whole span, or None: one call of
    N = M = the span (at most ``OVERFLOW_SPAN``), default positions, causal and not. The
    agreement search below draws short calls (at most 9 positions), which a bias that
    overflows float32 only at distance 94 (``0.01 * exp(abs(i - j))``) never reaches:
    every backend then agreed on NaN-free short calls while a call of 200 tokens gave
    NaN rows."""
    span = min(probe.span, OVERFLOW_SPAN)
    content = probe.content(generator(probe.budget.seed), span, span, dtype=torch.float32)
    positions = torch.arange(span) if probe.through_embed else None
    for causal in (True, False):
        out = probe.forward(
            probe.pe32, content, positions, positions, causal=causal, backend="eager"
        )
        finite = torch.isfinite(out).flatten(end_dim=-3).all(dim=(0, -1))  # [N]
        if not bool(finite.all()):
            row = int((~finite).nonzero()[0, 0])
            return (
                f"eager's float32 output is not finite over the span: a call of N = M = "
                f"{span} positions (default positions, causal={causal}) gives NaN or inf "
                f"first at query {row}, where every backend agrees on calls of a few "
                "positions (logits past float32's range, or a bias that is not finite)"
            )
    return None


def _backends_agree(probe: Probe, names: list[str], example: BackendExample) -> float:
    """The margin by which every backend agrees with eager on one example."""
    n, m, start, causal, explicit, example_seed = example
    content = probe.content(generator(example_seed), n, m, dtype=torch.float32)
    k_pos = torch.arange(start, start + m) if explicit else None
    q_pos = k_pos[m - n :] if k_pos is not None else None
    if probe.through_embed and not explicit:
        k_pos, q_pos = torch.arange(m), torch.arange(m - n, m)
    eager = probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal, backend="eager")
    worst = math.inf
    for name in names:
        out = probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal, backend=name)
        error = float((out - eager).abs().max())
        tol = 2e-5 + 1e-4 * float(eager.abs().max())
        if not error <= tol:
            raise Violation(
                f"backend {name!r} differs from eager by {fmt(error)} (N={n}, M={m}, "
                f"positions from {start if explicit else 'default'}, causal={causal})",
                backend=name,
                n=n,
                m=m,
                start=start,
                causal=causal,
            )
        worst = min(worst, tol - error)
    if causal:
        _causal_reference(probe, content, eager, n, m, q_pos, k_pos, start, explicit)
    return worst


def _causal_reference(
    probe: Probe,
    content: Content,
    eager: Tensor,
    n: int,
    m: int,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    start: int,
    explicit: bool,
) -> None:
    """causal=True against a mask the checker builds itself from the positions (key
    position ≤ query position): through attn_mask (bool, True = attend), and through
    softmax(scores + mask) v computed here in float64 from the module's ``scores``
    (compared with out(v) - out(0), so that a value term cancels)."""
    q_eff = q_pos if q_pos is not None else torch.arange(m - n, m)
    k_eff = k_pos if k_pos is not None else torch.arange(m)
    allowed = k_eff.unsqueeze(0) <= q_eff.unsqueeze(1)  # [n, m]
    where = f"N={n}, M={m}, positions from {start if explicit else 'default'}"
    masked = probe.forward(probe.pe32, content, q_pos, k_pos, attn_mask=allowed, backend="eager")
    error = float((masked - eager).abs().max())
    tol = 2e-5 + 1e-4 * float(eager.abs().max())
    if not error <= tol:
        raise Violation(
            f"causal=True differs from attn_mask = (key ≤ query) by {fmt(error)} ({where})",
            n=n,
            m=m,
            start=start,
            causal=True,
        )
    wide = content_as(content, F64)
    logits = probe.logits(wide, q_eff, k_eff)  # [1, heads, n, m] float64
    weights = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
    own = weights @ wide[2]
    # out(v) - out(0) = A v: a value term (Shaw's relative values) cancels
    no_values = (wide[0], wide[1], torch.zeros_like(wide[2]))
    out64 = probe.forward(probe.pe64, wide, q_pos, k_pos, causal=True, backend="eager")
    out64 = out64 - probe.forward(probe.pe64, no_values, q_pos, k_pos, causal=True, backend="eager")
    error = float((out64 - own).abs().max())
    tol = 1e-9 * (1.0 + float(own.abs().max()))
    if not error <= tol:
        raise Violation(
            f"causal=True differs from softmax(scores + key ≤ query mask) v by "
            f"{fmt(error)} ({where})",
            n=n,
            m=m,
            start=start,
            causal=True,
        )


# --------------------------------------------------------------------------- bf16


def bf16(probe: Probe) -> Outcome:
    """bf16 within bf16 error of fp32 at positions up to 2^20 (n/a if all rejected)."""
    unreachable = input_unreachable(probe, "bf16")
    if unreachable is not None:
        return unreachable
    top = (probe.limit - 1) if probe.limit is not None else FAR
    mode = probe.input_mode if probe.route == "input" else None
    if mode == "default":
        top = 63  # default positions only: sequences of up to 64 tokens
    usable = [0]
    rejected: list[str] = []

    @st.composite
    def examples(draw: st.DrawFn) -> Bf16Example:
        n = draw(st.integers(1, 4))
        m = draw(st.integers(n, max(n, min(8, top + 1))))
        base = draw(st.integers(0, max(0, top - m + 1)))
        if mode == "default":
            m, base = base + m, 0
        return n, m, base, draw(st.booleans()), draw(SEEDS)

    def check(example: Bf16Example) -> float:
        n, m, base, causal, example_seed = example
        k_pos = torch.arange(base, base + m)
        content = probe.content(generator(example_seed), n, m, dtype=torch.bfloat16)
        try:
            compared = _bf16_and_fp32(probe, mode, content, k_pos[m - n :], k_pos, causal)
        except ValueError as error:
            rejected.append(str(error))
            return math.inf  # positions the encoding rejects in any dtype: not a bf16 matter
        usable[0] += 1
        return _within_bf16_error(k_pos, *compared)

    search = run_search(check, examples(), probe.budget)
    if search.violation is not None:
        return failed("bf16", "block", None, search)
    if not usable[0]:  # nothing was compared: no verdict
        why = f": ValueError: {rejected[-1]}" if rejected else ""
        return Outcome(
            "bf16",
            "block",
            None,
            None,
            f"cannot check: every example was rejected by the module{why}",
        )
    reach = "up to 2^20" if top == FAR else f"up to {top}"
    skipped = f"; {len(rejected)} rejected by the module (ValueError)" if rejected else ""
    return Outcome(
        "bf16",
        "block",
        None,
        True,
        f"within bf16 error of fp32 at positions {reach} ({usable[0]} examples compared{skipped})",
    )


def _bf16_and_fp32(
    probe: Probe,
    mode: str | None,
    content: Content,
    q_pos: Tensor,
    k_pos: Tensor,
    causal: bool,
) -> tuple[Tensor, Tensor, float | Tensor, str]:
    """(bf16 result as float32, fp32 result, the bf16 error bound, what is compared):
    embed's output is held to 2·BF16_EPS·(1 + max|embed|), the attention output to
    2·BF16_EPS·(1 + spread + size)·max|v| in each query row (``_row_spread``,
    ``_row_content_size``)."""
    wide = content_as(content, torch.float32)
    if mode == "explicit":
        want = probe.embed(probe.pe32, wide[1], k_pos)
        got = probe.embed(probe.pe32, content[1], k_pos).float()
        return got, want, 2 * BF16_EPS * (1.0 + float(want.abs().max())), "embed"
    if mode == "default":
        x = torch.zeros(1, k_pos.shape[0], probe.input_dim).normal_(
            generator=generator(int(k_pos.shape[0]))
        )
        want = probe.embed(probe.pe32, x.bfloat16().float(), None)
        got = probe.embed(probe.pe32, x.bfloat16(), None).float()
        return got, want, 2 * BF16_EPS * (1.0 + float(want.abs().max())), "embed"
    want = probe.forward(probe.pe32, wide, q_pos, k_pos, causal=causal)
    got = probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal).float()
    logits = probe.pe32.scores(wide[0], wide[1], q_positions=q_pos, k_positions=k_pos)
    allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1) if causal else None  # [N, M]
    spread = _row_spread(logits, allowed)  # [1, heads, N, 1]
    size = _row_content_size(probe.pe32, wide[0], wide[1], q_pos, k_pos, allowed)
    tol = 2 * BF16_EPS * (1.0 + spread + size) * float(wide[2].abs().max())
    return got, want, tol, "attention output"


def _row_content_size(
    pe: Encoding, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, allowed: Tensor | None
) -> Tensor | float:
    """max over each row's attended keys of |content_content_ij|, [..., N, 1]: the
    logit q_i · k_j · scale as it enters the sum (a query scale's factor included); 0
    for a module without ``score_terms`` (hand-written ones).

    Rounding q and k to bf16 (a rotation's output, a query scale's product) moves a
    content logit by about BF16_EPS times its size, whatever the row's spread: a row
    whose logits are large but close together (queries scaled by 5 at large positions)
    moves its weights by that much, which the spread alone does not bound. Position
    terms are left out: one that is large but constant along a row moves no weight."""
    score_terms = getattr(pe, "score_terms", None)
    if score_terms is None:
        return 0.0
    terms = score_terms(q, k, q_positions=q_pos, k_positions=k_pos)
    content = terms.get("content_content")
    if content is None:
        return 0.0
    size = content.abs()  # [1, H, N, M]
    if allowed is not None:  # [N, M]: only the keys the row attends to
        size = size.masked_fill(~allowed, 0.0)
    return size.amax(dim=-1, keepdim=True)  # [1, H, N, 1]


def _row_spread(logits: Tensor, allowed: Tensor | None) -> Tensor:
    """max − min of each row's finite logits among the keys it attends to, [..., N, 1].

    Softmax is unchanged by a constant added to a row, so an error in the weights (and the
    output) follows the logits' differences, not their size: a bias of the query position
    alone, or large positions, leave it as it is. A row with no finite logit has spread 0.
    """
    usable = torch.isfinite(logits)
    if allowed is not None:
        usable = usable & allowed
    high = logits.masked_fill(~usable, -math.inf).amax(dim=-1, keepdim=True)
    low = logits.masked_fill(~usable, math.inf).amin(dim=-1, keepdim=True)
    return (high - low).clamp(min=0.0)  # -inf (nothing usable) becomes 0


def _within_bf16_error(
    k_pos: Tensor, got: Tensor, want: Tensor, tol: float | Tensor, what: str
) -> float:
    """The margin by which the bf16 result is within ``tol`` of a finite fp32 one.

    ``tol`` is one bound, or a tensor of bounds that broadcasts against the result (one
    per query row of the attention output); the worst row is reported."""
    m = k_pos.shape[0]
    shown = k_pos.tolist() if m <= 8 else f"0..{m - 1}"
    if not bool(torch.isfinite(want).all()):
        raise Violation(
            f"positions {shown}: the fp32 {what} is not finite",
            positions=k_pos.tolist()[-8:],
            rank=int(k_pos.max()),
        )
    errors = (got - want).detach().abs()  # read as numbers: no graph (a trained module's)
    bounds = torch.as_tensor(tol, dtype=errors.dtype).expand_as(errors).detach()
    slack = (bounds - errors).nan_to_num(nan=-math.inf)  # a NaN in bf16 is a failure
    worst = int(slack.argmin())
    error, bound = float(errors.flatten()[worst]), float(bounds.flatten()[worst])
    if not float(slack.flatten()[worst]) >= 0:
        raise Violation(
            f"positions {shown}: bf16 {what} differs from fp32 by "
            f"{fmt(error)} (bf16 error bound {fmt(bound)})",
            positions=k_pos.tolist()[-8:],
            error=error,
            tol=bound,
            rank=int(k_pos.max()),
        )
    return bound - error


# --------------------------------------------------------------------------- kv_cache


def kv_cache(probe: Probe) -> Outcome:
    """An offset query block reproduces the matching rows of the full computation."""
    unreachable = input_unreachable(probe, "kv_cache", need_explicit=True)
    if unreachable is not None:
        return unreachable
    longest = min(10, probe.span)  # never past a table
    if longest < 2:
        return Outcome(
            "kv_cache", "block", None, None, f"cannot check: the table holds {probe.span} position"
        )

    @st.composite
    def examples(draw: st.DrawFn) -> CacheExample:
        m = draw(st.integers(2, longest))
        return m, draw(st.integers(1, m - 1)), draw(st.integers(0, probe.span - m)), draw(SEEDS)

    def check(example: CacheExample) -> float:
        return _cached_rows_agree(probe, example)

    search = run_search(check, examples(), probe.budget)
    if search.violation is not None:
        return failed("kv_cache", "block", None, search)
    return Outcome(
        "kv_cache", "block", None, True, f"{_cache_evidence(probe)} ({search.examples} examples)"
    )


def _cache_evidence(probe: Probe) -> str:
    """What ``_cached_rows_agree`` compared, in words: through embed only the float64
    logits at explicit positions; otherwise also default positions in float64 and the
    float32 forward (and keys rotated once, where the module rotates)."""
    if probe.through_embed:
        return (
            "offset query blocks equal the full rows at explicit positions (float64 "
            "logits of embed(x, positions) W; default positions and the float32 forward "
            "are not compared on the input route)"
        )
    rotated = ", and with keys rotated once for a cache" if _rotates_keys(probe) else ""
    return (
        "offset query blocks equal the full rows, explicit and default positions "
        f"(float64 scores; float32 forward with default positions{rotated})"
    )


def _rotates_keys(probe: Probe) -> bool:
    """Whether a decode step rotates the keys once (``rotate_keys``, ``keys_rotated``)."""
    return bool(getattr(probe.pe32, "has_rotation", False)) and hasattr(probe.pe32, "rotate_keys")


def _cached_rows_agree(probe: Probe, example: CacheExample) -> float:
    """The margin by which the query block from row ``cut`` matches the full rows."""
    m, cut, start, example_seed = example
    content = probe.content(generator(example_seed), m, m)
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
            f"from the full rows by {fmt(error)}",
            m=m,
            cut=cut,
            start=start,
        )
    if not probe.through_embed:
        error = _default_positions_agree(probe, content, m, cut, tol)
    return tol - error


def _default_positions_agree(probe: Probe, content: Content, m: int, cut: int, tol: float) -> float:
    """Default positions: float64 scores, then the float32 forward (the float32 caches'
    path), causal and not, and for a rotation also with the keys rotated once
    (``rotate_keys``, ``keys_rotated=True``, as in decoding): the last M - cut queries
    match the full rows. The float64 error (the example's margin is measured on it), or
    a Violation."""
    a, b, _ = content
    by_default = probe.pe64.scores(a[:, :, cut:], b)
    reference = probe.pe64.scores(a, b)[:, :, cut:]
    error = float((by_default - reference).abs().max())
    if not error <= tol:
        raise Violation(
            f"default positions, M={m}: the last {m - cut} queries differ from "
            f"the full rows by {fmt(error)}",
            m=m,
            cut=cut,
        )
    a32, b32, v32 = content_as(content, torch.float32)
    # a decode step: keys rotated once for a cache, then only the queries
    cached = probe.pe32.rotate_keys(b32) if _rotates_keys(probe) else None
    for causal in (False, True):
        whole = probe.pe32(a32, b32, v32, causal=causal)[:, :, cut:]
        tol32 = 1e-5 * (1.0 + float(whole.abs().max()))
        last = {"": probe.pe32(a32[:, :, cut:], b32, v32, causal=causal)}
        if cached is not None:
            last[" with keys rotated once"] = probe.pe32(
                a32[:, :, cut:], cached, v32, causal=causal, keys_rotated=True
            )
        for route, rows in last.items():
            error32 = float((rows - whole).abs().max())
            if not error32 <= tol32:
                raise Violation(
                    f"float32 forward, default positions{route}, M={m}, causal={causal}: "
                    f"the last {m - cut} queries differ from the full rows by "
                    f"{fmt(error32)}",
                    m=m,
                    cut=cut,
                    causal=causal,
                )
    return error
