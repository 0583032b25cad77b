"""Two revisions of the generated modules in one process: a change judged in one loop.

``--before REV`` extracts that git revision's ``generated/`` into a temporary package
(``generated_before``; the modules import their runtime relatively, so the copy is
self-contained) and times on the CPU, for each encoding, plain SDPA, the module as it
was at REV and the module in the working tree, taking turns in every repeat (medians
of repeats), on the ``sdpa`` backend, N queries against N keys (``--queries``: fewer
queries, the last of the keys, as in a decode step). The two modules share their
state (``load_state_dict``) and their outputs are checked to agree before timing.
Every ratio is time over plain ``F.scaled_dot_product_attention`` with no position
encoding, causal where the row is.

    python benchmarks/revisions.py --before HEAD --encodings deberta --modes train
    python benchmarks/revisions.py --before HEAD --encodings deberta --modes inference \
        --queries 1 --lengths 4096 --causal yes  # a decode step
    python benchmarks/revisions.py --before HEAD --encodings alibi t5 --position-stride 2
    python benchmarks/revisions.py --before HEAD --encodings alibi t5 --modes inference \
        --queries 1 --lengths 1024 --growing 64  # a decode loop: a new key count per call

``--growing G`` gives each call the first L of the N keys, L taking the G values
N - G + 1 .. N in turn (the same L for every call of a repeat): the key count changes
from call to call, as in a decode loop whose cache grows a key per step, so caches
keyed by shape miss as they do there. Each turn is then G calls in a row (a burst,
timed together): single decode steps taking turns ran 3-11% faster right after the
same code than right after SDPA's (``interleaved_medians``). ``--keys-rotated``:
rotary modules read keys rotated once (``rotate_keys``) and rotate only the queries.
``--frozen``: both modules run inside their ``parameters_frozen()`` block.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from io import BytesIO
from itertools import cycle
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    header_text,
    report_header,
    write_results,
)

from generated import ENCODINGS  # noqa: E402


def generated_at(revision: str, folder: Path) -> dict[str, type[torch.nn.Module]]:
    """The encodings of ``revision``'s generated/, imported as the package
    ``generated_before`` from a copy under ``folder``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "generated"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "generated").rename(folder / "generated_before")
    sys.path.insert(0, str(folder))
    return importlib.import_module("generated_before").ENCODINGS


Options = Callable[[int], dict[str, Any]]


def step(
    pe: torch.nn.Module | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    inference: bool = False,
    options_of: Options | None = None,
    key_counts: list[int] | None = None,
) -> Callable[[], torch.Tensor]:
    """One call (``pe`` None: plain SDPA), and its backward where q requires grad; under
    ``torch.no_grad`` where ``inference``; with ``options_of(M)`` (positions, window,
    documents, an ``attn_mask``, which the baseline takes too) where given; with
    ``key_counts``, each call reads the first L keys, L the next of them in turn."""
    if key_counts is not None:
        counts = cycle(key_counts)
        calls = {
            count: step(pe, q, k[:, :, :count], v[:, :, :count], causal, inference, options_of)
            for count in key_counts
        }
        return lambda: calls[next(counts)]()

    grouped = k.shape[1] != q.shape[1]  # grouped-query heads: SDPA's enable_gqa
    options = {} if options_of is None else options_of(k.shape[2])

    def run() -> torch.Tensor:
        if inference:
            with torch.no_grad():
                return step(pe, q, k, v, causal, options_of=options_of)()
        if pe is None:
            out = plain_sdpa(q, k, v, causal, options.get("attn_mask"), grouped)
        else:
            out = pe(q, k, v, causal=causal, backend="sdpa", **options)
        if q.requires_grad:
            out.square().sum().backward()
        return out

    return run


def plain_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    attn_mask: torch.Tensor | None,
    grouped: bool,
) -> torch.Tensor:
    """The baseline: F.scaled_dot_product_attention with ``attn_mask`` and, where causal,
    the queries as the last of the keys (a lower-right mask; none for one query, whom
    it would mask nothing)."""
    n, m = q.shape[2], k.shape[2]
    if causal and 1 < n < m and attn_mask is None:  # the queries are the last keys
        attn_mask = causal_lower_right(n, m)
    elif causal and n > 1 and attn_mask is not None:
        attn_mask = attn_mask & torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    is_causal = causal and n == m and n > 1 and attn_mask is None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=grouped
    )


def call_options(args: argparse.Namespace, queries: int, batch: int) -> Options:
    """The options of every module call for M keys: explicit positions (``--position-stride``
    and ``--position-offset``: key j at S j + O, the queries at the last keys'),
    ``--window``, ``--documents`` and ``--padding`` (an attn_mask, bool [B, 1, 1, M], with
    the first P keys of batch row 0 masked; with ``--counted-positions`` positions [B, M]
    that count each row's kept keys, padding at 0, as Hugging Face's generation gives a
    left-padded batch)."""

    def options_of(m: int) -> dict[str, Any]:
        given: dict[str, Any] = {}
        if args.position_stride is not None:  # increasing, as is the mask
            keys = args.position_stride * torch.arange(m) + args.position_offset
            given = {"q_positions": keys[m - queries :], "k_positions": keys}
        if args.window is not None:
            given["window"] = args.window
        if args.documents is not None:  # equal lengths, ids 0 .. D - 1
            per_document = -(-m // args.documents)
            given["document_ids"] = torch.arange(m) // per_document
        if args.padding:
            keep = torch.ones(batch, 1, 1, m, dtype=torch.bool)
            keep[0, ..., : args.padding] = False
            given["attn_mask"] = keep
            if args.counted_positions:  # each row's kept keys counted, padding at 0
                kept = keep[:, 0, 0].to(torch.int64)  # [B, M]
                keys = (kept.cumsum(-1) - 1) * kept
                given |= {"q_positions": keys[:, m - queries :], "k_positions": keys}
        return given

    return options_of


def sequence_first(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, L, D] with its values stored as [B, L, H, D] (``layout="bnhd"``'s view of
    a sequence-first cache), a leaf that requires grad where t does."""
    return t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(t.requires_grad)


def rotated_options(options_of: Options) -> Options:
    """``options_of`` with ``keys_rotated=True``."""
    return lambda m: {**options_of(m), "keys_rotated": True}


def interleaved_medians(
    calls: list[Callable[[], torch.Tensor]], repeats: int, burst: int = 1
) -> list[float]:
    """Median seconds of each call, after one warm-up each, the calls taking turns in
    every repeat (CPU: the host clock), each turn ``burst`` calls in a row (timed
    together, reported per call) and each repeat starting one call later than the
    last. A call right after another's code runs colder: in turns of single decode
    steps, the same module timed twice ran 4-11% faster in the second slot
    (``revisions_cpu_float32_decode_same_code.md``); a burst, as a decoding loop runs
    one module step after step, leaves that to its first call."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for repeat in range(repeats):
        for turn in range(len(calls)):
            index = (repeat + turn) % len(calls)
            start = time.perf_counter()
            for _ in range(burst):
                calls[index]()
            times[index].append((time.perf_counter() - start) / burst)
    return [statistics.median(seconds) for seconds in times]


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu")  # the host clock; CUDA runs go through gpu_session.sh
    dtype = getattr(torch, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        before = generated_at(args.before, Path(folder))
        for length in args.lengths:
            for mode in args.modes:
                for causal in args.causal:
                    for name in args.encodings:
                        torch.manual_seed(0)
                        now = ENCODINGS[name](heads=args.heads, head_dim=args.head_dim)
                        then = before[name](heads=args.heads, head_dim=args.head_dim)
                        then.load_state_dict(now.state_dict())
                        kv_heads = args.kv_heads or args.heads
                        shape = (args.batch, kv_heads, length, args.head_dim)
                        queries = args.queries or length  # the last ones of the keys
                        train = mode == "train"
                        k, v = (torch.randn(shape, dtype=dtype, requires_grad=train) for _ in "kv")
                        q_shape = (args.batch, args.heads, queries, args.head_dim)
                        q = torch.randn(q_shape, dtype=dtype, requires_grad=train)
                        if args.sequence_first:  # [B, M, H, D] storage seen as [B, H, M, D]
                            q, k, v = (sequence_first(t) for t in (q, k, v))
                        options_of = call_options(args, queries, args.batch)
                        given = options_of(length)
                        with torch.no_grad():  # the same attention, up to rounding: a
                            # revision may take other ops (float32 over 1024 keys of 128:
                            # 2e-5 apart, both within 2e-5 of float64)
                            loose = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
                            torch.testing.assert_close(
                                now(q, k, v, causal=causal, backend="sdpa", **given),
                                then(q, k, v, causal=causal, backend="sdpa", **given),
                                **loose,
                            )
                        inference = mode == "inference"
                        counts = None
                        if args.growing:
                            counts = list(range(length - args.growing + 1, length + 1))
                        calls = [step(None, q, k, v, causal, inference, options_of, counts)]
                        for pe in (then, now):
                            keys, options = k, options_of
                            if args.keys_rotated and pe.has_rotation:  # a cache rotated once
                                with torch.no_grad():
                                    keys = pe.rotate_keys(k, given.get("k_positions"))
                                options = rotated_options(options_of)
                            calls.append(step(pe, q, keys, v, causal, inference, options, counts))
                        burst = args.growing or 1  # a decoding loop's run of steps
                        with ExitStack() as frozen:
                            if args.frozen:  # the whole loop in one block, as a decoder's
                                for pe in (then, now):
                                    frozen.enter_context(pe.parameters_frozen())
                            base, *medians = interleaved_medians(calls, args.repeats, burst)
                        labels = (args.before, "working tree")
                        for label, seconds in zip(labels, medians, strict=True):
                            row = {
                                "encoding": name,
                                "code": label,
                                "queries": queries,
                                "n": length,
                                "causal": causal,
                                "mode": mode,
                                "position_stride": args.position_stride,
                                "ms": seconds * 1e3,
                                "ratio": seconds / base,
                            }
                            rows.append(row)
                            print(
                                f"{name:>24} {label:>12} queries={queries} N={length} "
                                f"causal={causal!s:5} "
                                f"{mode:>7} {row['ratio']:.2f}x",
                                flush=True,
                            )
    header = report_header(args, device)
    return {
        **header,
        "before": args.before,
        "position_stride": args.position_stride,
        "position_offset": args.position_offset,
        "padding": args.padding,
        "counted_positions": args.counted_positions,
        "window": args.window,
        "documents": args.documents,
        "growing": args.growing,
        "keys_rotated": args.keys_rotated,
        "frozen": args.frozen,
        "kv_heads": args.kv_heads or args.heads,
        "queries": args.queries,
        "sequence_first": args.sequence_first,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Two revisions of the modules on `sdpa` ({header_text(report)})",
        "",
        f"The modules of `{report['before']}` and of the working tree and plain "
        "`F.scaled_dot_product_attention` (no position encoding), taking turns in the same "
        "loop; ratio: median time over the baseline's. `train` is forward plus "
        "backward into q, k, v and the module's parameters; `inference` is the forward "
        "under `torch.no_grad()`."
        + (
            f" Positions given explicitly: key j at {report['position_stride']} j + "
            f"{report.get('position_offset', 5)}, the queries at the last keys' positions."
            if report.get("position_stride") is not None
            else ""
        )
        + (
            f" Every call (the baseline's too) with an attn_mask, bool [B, 1, 1, M], that "
            f"masks the first {report['padding']} keys of batch row 0 (left padding)."
            if report.get("padding")
            else ""
        )
        + (
            " The module calls give positions [B, M] that count each row's kept keys, "
            "padding at 0 (as Hugging Face's generation gives a left-padded batch), the "
            "queries at the last keys'."
            if report.get("counted_positions")
            else ""
        )
        + (
            " A causal call of one query: the baseline has no mask (one query, the last "
            "key, has no later key to mask)."
            if report.get("queries") == 1 and any(row["causal"] for row in report["rows"])
            else ""
        )
        + (
            f" The modules with a sliding window of {report['window']}."
            if report.get("window") is not None
            else ""
        )
        + (
            f" The modules with {report['documents']} packed documents of equal length."
            if report.get("documents") is not None
            else ""
        )
        + (
            f" Each call reads the first L keys, L taking the {report['growing']} values up "
            "to N in turn (a new key count every call, as in a decode loop)."
            if report.get("growing")
            else ""
        )
        + (
            f" {report['kv_heads']} key-value heads (grouped-query attention; the baseline "
            "with `enable_gqa`)."
            if report.get("kv_heads", report["heads"]) != report["heads"]
            else ""
        )
        + (
            " q, k and v are stored sequence first, [B, L, H, D], and seen as [B, H, L, D] "
            '(as `layout="bnhd"` sees a sequence-first cache), by the baseline too.'
            if report.get("sequence_first")
            else ""
        )
        + (
            " Rotary modules read keys rotated once (`rotate_keys`) and are called with "
            "`keys_rotated=True`: only the queries are rotated."
            if report.get("keys_rotated")
            else ""
        )
        + (
            " Both modules run inside their `parameters_frozen()` block (kept values "
            "compared with the parameters once)."
            if report.get("frozen")
            else ""
        )
        + (
            " The baseline has no window and no documents."
            if report.get("window") is not None or report.get("documents") is not None
            else ""
        ),
        "",
        "| encoding | code | queries | N | causal | mode | ms | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['encoding']} | {row['code']} | {row.get('queries', row['n'])} | {row['n']} | "
            f"{'yes' if row['causal'] else 'no'} | {row['mode']} | {row['ms']:.3f} | "
            f"{row['ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument("--encodings", nargs="+", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument(
        "--modes", nargs="+", choices=["forward", "train", "inference"], default=["train"]
    )
    parser.add_argument(
        "--causal", nargs="+", type=lambda text: text == "yes", default=[False, True]
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="key-value heads (grouped-query attention; default: --heads)",
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--queries",
        type=int,
        default=None,
        help="queries per call, the last of the N keys (default N; 1: a decode step)",
    )
    parser.add_argument(
        "--position-stride",
        type=int,
        default=None,
        help="give positions explicitly, keys S j + O (--position-offset, default 5)",
    )
    parser.add_argument(
        "--position-offset",
        type=int,
        default=5,
        help="the first key's position with --position-stride (stride 1, offset 0: the "
        "defaults given explicitly, as Hugging Face passes them)",
    )
    parser.add_argument(
        "--padding",
        type=int,
        default=0,
        help="every call (and the baseline) with a bool attn_mask masking the first P "
        "keys of batch row 0",
    )
    parser.add_argument(
        "--counted-positions",
        action="store_true",
        help="with --padding, every module call with positions [B, M] counting each row's "
        "kept keys, padding at 0 (a left-padded batch in generation)",
    )
    parser.add_argument("--window", type=int, default=None, help="every module call with window=W")
    parser.add_argument(
        "--documents",
        type=int,
        default=None,
        help="every module call with D packed documents of equal length (document_ids)",
    )
    parser.add_argument(
        "--growing",
        type=int,
        default=0,
        help="each call reads the first L keys, L cycling through the last G key counts",
    )
    parser.add_argument(
        "--keys-rotated",
        action="store_true",
        help="rotary modules read keys rotated once (rotate_keys) and rotate only queries",
    )
    parser.add_argument(
        "--frozen",
        action="store_true",
        help="time both modules inside their parameters_frozen() block (a revision "
        "without that method cannot take it)",
    )
    parser.add_argument(
        "--sequence-first",
        action="store_true",
        help="q, k and v stored [B, L, H, D] and seen as [B, H, L, D] (as layout='bnhd' "
        "sees a sequence-first cache), for the modules and the baseline",
    )
    parser.add_argument("--tag", default="", help="appended to the result file names")
    add_out_argument(parser)
    args = parser.parse_args()
    report = run(args)
    write_results(args.out, f"revisions_cpu_{args.dtype}{args.tag}", report, markdown(report))


if __name__ == "__main__":
    main()
