"""The ``extrapolates`` claim: positions beyond the training length give finite outputs.

The training length is the smallest ``max_positions`` the spec states, else the span (or
where a table ends, if that is earlier); hypothesis draws short query and key blocks at
positions from there up to ``EXTRAPOLATION_FACTOR`` (16) times it (at most 2^20, but at
least twice it, so tables of any length the schema allows are probed past their end),
causal or not, three ways: the block alone; the block with a few keys spread from
position 0 before it (keys that span the whole range, as a long context has); and a
whole sequence from position 0 to past the training length (up to ``LONG_KEYS`` keys).
Each runs forward on the eager and the auto backend in float32. A ValueError is a clear
refusal, any other exception an unclear one; both, and any non-finite output, refute the
claim. An input-level embed that takes no explicit positions is driven with longer
sequences from position 0 instead, whose last positions lie past the training length.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import Tensor

from posgen.check.contract import Content
from posgen.check.probe import Probe, input_unreachable
from posgen.check.search import FAR, SEEDS, Violation, generator, run_search
from posgen.check.verdicts import Outcome, failed

EXTRAPOLATION_FACTOR = 16  # extrapolation: positions up to 16x the training length
LONG_KEYS = 4096  # a whole sequence from 0 is drawn where the training length is below it
SPREAD_KEYS = 8  # at most this many keys spread before the block

# queries N, keys M in a block from the first key position, keys spread before the
# block (ascending, all below it), causal, the content's seed
Example = tuple[int, int, int, tuple[int, ...], bool, int]


def extrapolates(probe: Probe, claimed: bool | None) -> Outcome:
    """Judge or measure ``extrapolates`` for one probe."""
    unreachable = input_unreachable(probe, "extrapolates", claimed)
    if unreachable is not None:
        return unreachable
    start = probe.length if probe.length is not None else probe.span
    if probe.limit is not None and probe.limit < start:
        start = probe.limit  # a table that ends before the span: extrapolation starts there
    # positions in [start, end): up to 16x the training length, capped at FAR = 2^20,
    # but always past the end of the table, however long the table is
    end = max(min(FAR, EXTRAPOLATION_FACTOR * start), 2 * start)
    default_only = probe.route == "input" and probe.input_mode == "default"

    long_keys = min(end, 4 * start, LONG_KEYS)
    kinds = ["block", "spread"] + (["from 0"] if long_keys > start else [])

    @st.composite
    def examples(draw: st.DrawFn) -> Example:
        n = draw(st.integers(1, 3))
        m = draw(st.integers(n, 5))
        if default_only:  # a longer sequence from 0: its last positions are past start
            m = draw(st.integers(start + 1, min(end, 4 * start)))
            n = min(n, m)
            return n, m, 0, (), draw(st.booleans()), draw(SEEDS)
        kind = draw(st.sampled_from(kinds))
        if kind == "from 0":  # every position from 0 to past the training length
            m = draw(st.integers(start + 1, long_keys))
            return min(n, m), m, 0, (), draw(st.booleans()), draw(SEEDS)
        base = draw(st.integers(start, end - m))
        spread: tuple[int, ...] = ()
        if kind == "spread" and base > 1:  # keys from position 0 up to the block
            earlier = draw(st.sets(st.integers(1, base - 1), max_size=SPREAD_KEYS - 1))
            spread = (0, *sorted(earlier))
        return n, m, base, spread, draw(st.booleans()), draw(SEEDS)

    def check(example: Example) -> float:
        return _finite(probe, example, default_only)

    search = run_search(check, examples(), probe.budget)
    if search.violation is not None:
        return failed("extrapolates", "claim", claimed, search)
    if default_only:
        where = f"sequences of {start + 1}-{min(end, 4 * start)} tokens"
    else:
        where = f"positions in [{start}, {end}), keys spread from 0"
        if long_keys > start:
            where += f" and sequences from 0 of up to {long_keys} keys"
    return Outcome(
        "extrapolates",
        "claim",
        claimed,
        True,
        f"finite outputs (eager and auto) at {where} ({EXTRAPOLATION_FACTOR}× the "
        f"training length {start}), {search.examples} examples",
    )


def _run(
    probe: Probe,
    content: Content,
    q_pos: Tensor,
    k_pos: Tensor,
    causal: bool,
    backend: str,
    default_only: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """forward at these positions; with default positions only, also embed's output."""
    if not default_only:
        return probe.forward(probe.pe32, content, q_pos, k_pos, causal=causal, backend=backend)
    x = torch.zeros(1, k_pos.shape[0], probe.input_dim).normal_(
        generator=generator(int(k_pos.shape[0]))
    )
    hidden = probe.embed(probe.pe32, x, None)  # default positions 0..m-1
    q, k, v = content
    return probe.pe32(q, k, v, causal=causal, backend=backend), hidden


def _finite(probe: Probe, example: Example, default_only: bool) -> float:
    """0.0 where every output is finite on eager and auto; else a Violation."""
    n, m, base, spread, causal, example_seed = example
    k_pos = torch.cat((torch.tensor(spread, dtype=torch.int64), torch.arange(base, base + m)))
    q_pos = k_pos[-n:]
    m = k_pos.shape[0]
    content = probe.content(generator(example_seed), n, m, dtype=torch.float32)
    where = (
        f"a sequence of {m} tokens (positions 0..{m - 1})"
        if default_only
        else f"query positions {q_pos.tolist()}, key positions {_positions_text(k_pos)}"
    )
    top = int(k_pos.max())
    for backend in ("eager", "auto"):
        try:
            out = _run(probe, content, q_pos, k_pos, causal, backend, default_only)
        except ValueError as error:
            raise Violation(
                f"{where}: raises ValueError: {error}",
                positions=k_pos.tolist()[-5:],
                clear_error=True,
                backend=backend,
                rank=top,
            ) from None
        except Exception as error:  # noqa: BLE001 - any other failure is unclear
            raise Violation(
                f"{where}: raises {type(error).__name__} (not a clear ValueError): {error}",
                positions=k_pos.tolist()[-5:],
                clear_error=False,
                backend=backend,
                rank=top,
            ) from None
        outs = out if isinstance(out, tuple) else (out,)
        if not all(bool(torch.isfinite(o).all()) for o in outs):
            raise Violation(
                f"{where}: non-finite output ({backend} backend)",
                positions=k_pos.tolist()[-5:],
                backend=backend,
                rank=top,
            )
    return 0.0


def _positions_text(positions: Tensor) -> str:
    """Key positions in evidence text: a contiguous run as a range."""
    values = positions.tolist()
    first, last = values[0], values[-1]
    if len(values) > 8 and values == list(range(first, last + 1)):
        return f"{first}..{last}"
    return str(values)
