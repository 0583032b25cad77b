"""One decode step: a single query against M cached keys, against plain SDPA on the cache.

For rotary encodings the cache holds keys rotated once by ``rotate_keys`` and the step
calls ``forward(..., keys_rotated=True)`` (only the query is rotated); the baseline is
``F.scaled_dot_product_attention`` of the query against the same cache with no encoding.
Bias encodings (ALiBi, T5, KERPLE) add their bias for the one query row. Each candidate
is timed alternately with the baseline; ``--compile`` also times the module under
``torch.compile`` (what a decoding loop would run; ``--compile-mode reduce-overhead``
replays it as a CUDA graph, without the per-step launches that make an eager step
host-bound on a GPU); ``--static-slots S`` also times the step as a decoding loop under
CUDA graphs runs it: compiled once for a cache of S slots of which the first M hold
keys, with the query's position as a tensor and the empty slots masked by ``attn_mask``
(so every step has the same shapes and replays one graph), beside plain SDPA compiled
the same way; ``--growing G`` gives each call the first L cached keys, L cycling through
the last G counts, so the key count changes every step as it does in a decoding loop (a
benchmark that repeats one M hides work redone per shape); ``--compare-dense`` also
times relative encodings with their terms built densely and their rows projected every
step (the few-query path and kept rows off); ``--compare-frozen`` also times each module
inside a ``parameters_frozen`` block, whose kept values (relative rows, untied rows)
are compared with the parameters once, not every step; ``--compare-fold`` also times
encodings whose position term can fold into q and k (TUPE-A) with the fold switched
from the device's default (folded on CUDA: a decode step then copies the key cache
with the position features); ``--compare-no-floor`` also
times each module with the device left out of ``BIAS_FLOOR_DEVICES`` (no floor under
a bias given to SDPA, and so no few-query matmuls in its place); ``--compare-grouped`` also
times each module with the few-query matmuls (``grouped_query_attention``: grouped
heads, and any step with a position bias) switched the other way on the device (on where
``GROUPED_QUERY_DEVICES`` leaves them off, and off where on). ``--profile`` prints, per
encoding and backend, the operators of a few untimed module steps by device time (self
time on the CPU), to see where a step goes.

    python benchmarks/decode.py --device cuda --dtype bfloat16 --cache 8192 --compile
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from itertools import cycle, repeat
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    describe_device,
    paired_seconds,
    write_results,
)

from generated import ENCODINGS, parameters_frozen  # noqa: E402
from generated import _distances as distances  # noqa: E402
from generated import _few_queries as few_queries  # noqa: E402
from generated import _grouped_queries as grouped_queries  # noqa: E402
from generated import _terms as terms  # noqa: E402

FROZEN_LABEL = "module, parameters frozen"
NO_FLOOR_LABEL = "module, no bias floor"
FOLD_LABEL = "module, fold switched"
CAUSAL_LABEL = "module, causal=True"
DEFAULT_ENCODINGS = ["rope", "rope_gptj", "alibi", "t5", "kerple_log"]


def without_few_query_path(step: Callable[[], object]) -> Callable[[], object]:
    """``step`` with the relative terms built as before ``few_query_inputs`` and kept
    rows: every key over every row (``_relative_terms``), rows projected each step."""

    def dense_step() -> object:
        most, keep = few_queries.FEW_QUERY_RELATIVE_MAX_QUERIES, terms.KEEP_RELATIVE_ROWS
        few_queries.FEW_QUERY_RELATIVE_MAX_QUERIES, terms.KEEP_RELATIVE_ROWS = 0, False
        try:
            return step()
        finally:
            few_queries.FEW_QUERY_RELATIVE_MAX_QUERIES, terms.KEEP_RELATIVE_ROWS = most, keep

    return dense_step


def with_fold_switched(
    step: Callable[[], object], pe: torch.nn.Module, device: str
) -> Callable[[], object]:
    """``step`` with ``pe``'s untied term folded into q and k where the device's default
    adds it as a bias, and added as a bias where the default folds it (CUDA)."""
    folds_by_default = pe.fold_bias if pe.fold_bias is not None else device == "cuda"

    def switched_step() -> object:
        before = pe.fold_bias
        pe.fold_bias = not folds_by_default
        try:
            return step()
        finally:
            pe.fold_bias = before

    return switched_step


def without_bias_floor(step: Callable[[], object], device: str) -> Callable[[], object]:
    """``step`` with ``device`` left out of ``BIAS_FLOOR_DEVICES`` (a CPU whose denormal
    arithmetic runs at full speed): biases go to SDPA as they are."""

    def unfloored_step() -> object:
        devices = set(distances.BIAS_FLOOR_DEVICES)
        distances.BIAS_FLOOR_DEVICES.discard(device)
        try:
            return step()
        finally:
            distances.BIAS_FLOOR_DEVICES.update(devices)

    return unfloored_step


def with_grouped_queries(step: Callable[[], object], device: str, on: bool) -> Callable[[], object]:
    """``step`` with ``device`` in ``GROUPED_QUERY_DEVICES`` (``on``) or out of it."""

    def switched_step() -> object:
        devices = grouped_queries.GROUPED_QUERY_DEVICES
        grouped_queries.GROUPED_QUERY_DEVICES = devices | {device} if on else devices - {device}
        try:
            return step()
        finally:
            grouped_queries.GROUPED_QUERY_DEVICES = devices

    return switched_step


def print_profile(step: Callable[[], object], device: torch.device, title: str) -> None:
    """The operators of five calls of ``step`` (after two untimed ones), by self device
    time (CUDA) or self CPU time, with their call counts: the top fifteen."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for _ in range(2):
        step()
    with profile(activities=activities) as recorded:
        for _ in range(5):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"-- profile: {title} (5 steps)")
    print(recorded.key_averages().table(sort_by=key, row_limit=15), flush=True)


def key_counts(args: argparse.Namespace, m: int) -> Iterator[int | None]:
    """The key count of each call of one timed step: under ``--growing G`` the counts
    M - G + 1 .. M in turn (every step, called once per repeat, takes the same count in
    a repeat), else None (all M keys)."""
    return cycle(range(m - args.growing + 1, m + 1)) if args.growing else repeat(None)


class StaticCache(NamedTuple):
    """A preallocated cache whose first M slots hold keys: keys, values [B, KVH, S, D];
    the query's position M - 1 as int64 [1]; mask: bool [1, 1, 1, S], True on the
    filled slots."""

    keys: torch.Tensor
    values: torch.Tensor
    query_position: torch.Tensor
    mask: torch.Tensor


def static_cache_inputs(
    args: argparse.Namespace, keys: torch.Tensor, values: torch.Tensor
) -> StaticCache:
    """``keys`` and ``values`` (M of them) in the first slots of a cache of
    ``args.static_slots`` slots, the rest zeros."""
    m, slots = keys.shape[2], args.static_slots
    if slots < m:
        raise SystemExit(f"--static-slots must be at least --cache ({m}), got {slots}")
    shape = (*keys.shape[:2], slots, keys.shape[3])
    static_keys = keys.new_zeros(shape)
    static_values = values.new_zeros((*shape[:3], values.shape[3]))
    static_keys[:, :, :m] = keys
    static_values[:, :, :m] = values
    filled = torch.arange(slots, device=keys.device) < m  # [S]
    position = torch.tensor([m - 1], device=keys.device)
    return StaticCache(static_keys, static_values, position, filled[None, None, None, :])


def masked_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gqa: dict
) -> torch.Tensor:
    """Plain SDPA over a static cache, its empty slots masked: the baseline a decoding
    loop under CUDA graphs would run without an encoding."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


def static_label(what: str, args: argparse.Namespace) -> str:
    """The variant name of a compiled static-cache step of ``what``."""
    mode = f", {args.compile_mode}" if args.compile_mode is not None else ""
    return f"{what}, compiled{mode}, {args.static_slots}-slot cache"


def timed_row(name: str, label: str, backend: str, seconds: float, base: float) -> dict:
    """One result row, printed as it is made."""
    print(
        f"{name:>12} {label:>17} {backend:>5} {seconds * 1e6:9.1f} us {seconds / base:6.2f}x sdpa",
        flush=True,
    )
    return {
        "encoding": name,
        "variant": label,
        "backend": backend,
        "seconds": seconds,
        "baseline_seconds": base,
        "time_ratio": seconds / base,
    }


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    m = args.cache
    q = torch.randn(args.batch, args.heads, 1, args.head_dim, device=device, dtype=dtype)
    keys = torch.randn(args.batch, args.kv_heads, m, args.head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    gqa = {"enable_gqa": True} if args.kv_heads != args.heads else {}

    def fresh_baseline() -> Callable[[], object]:
        """Plain SDPA on the cache, its key counts from the first (``key_counts``), so
        that it takes the same count as the step it is paired with in every repeat."""
        counts = key_counts(args, m)

        def baseline() -> object:
            count = next(counts)
            return F.scaled_dot_product_attention(
                q, keys[:, :, :count], values[:, :, :count], **gqa
            )

        return baseline

    static = static_cache_inputs(args, keys, values) if args.static_slots else None
    rows = []
    if static is not None:
        compiled_sdpa = torch.compile(masked_sdpa, fullgraph=True, mode=args.compile_mode)
        with torch.no_grad():
            seconds, base = paired_seconds(
                lambda: compiled_sdpa(q, static.keys, static.values, static.mask, gqa),
                fresh_baseline(),
                device,
                args.repeats,
            )
        rows.append(timed_row("(none)", static_label("SDPA", args), "-", seconds, base))
    skipped: dict[str, str] = {}  # encodings that cannot take the shape, and why
    for name in args.encodings:
        try:
            pe = ENCODINGS[name](heads=args.heads, head_dim=args.head_dim).to(device).eval()
        except ValueError as error:  # e.g. M-RoPE's sections fix the rotated width
            skipped[name] = str(error)
            print(f"{name:>12}  skipped: {error}")
            continue
        cache = pe.rotate_keys(keys) if pe.has_rotation else keys  # rotated once
        rotated = bool(pe.has_rotation)
        try:  # the longest step, once: a learned table may stop short of the cache
            with torch.no_grad():
                pe(q, cache, values, keys_rotated=rotated)
        except ValueError as error:  # e.g. TUPE's 512 positions against 8192 keys
            skipped[name] = str(error)
            print(f"{name:>12}  skipped: {error}")
            continue
        variants = {"module": pe}
        if args.compile:
            label = "module, compiled"
            if args.compile_mode is not None:
                label += f" ({args.compile_mode})"
            variants[label] = torch.compile(pe, fullgraph=True, mode=args.compile_mode)
        if static is not None:
            variants[static_label("module", args)] = torch.compile(
                pe, fullgraph=True, mode=args.compile_mode
            )
        if args.compare_dense and pe.has_relative_terms:
            variants["module, dense terms"] = pe
        if args.compare_frozen:
            variants[FROZEN_LABEL] = pe
        grouped_on = device.type in grouped_queries.GROUPED_QUERY_DEVICES
        grouped_label = (
            "module, no few-query matmuls" if grouped_on else "module, few-query matmuls"
        )
        if args.compare_grouped:
            variants[grouped_label] = pe
        if args.compare_no_floor:
            variants[NO_FLOOR_LABEL] = pe
        if args.compare_fold and pe.folds_position_bias:
            variants[FOLD_LABEL] = pe
        if args.compare_causal:
            variants[CAUSAL_LABEL] = pe
        for label, module in variants.items():
            for backend in args.backends:
                step_counts = key_counts(args, m)

                def step(
                    module=module,
                    backend=backend,
                    cache=cache,
                    rotated=rotated,
                    counts=step_counts,
                    causal=label == CAUSAL_LABEL,
                ) -> object:
                    count = next(counts)
                    return module(
                        q,
                        cache[:, :, :count],
                        values[:, :, :count],
                        backend=backend,
                        keys_rotated=rotated,
                        causal=causal,
                    )

                if static is not None and label == static_label("module", args):
                    static_cache = pe.rotate_keys(static.keys) if rotated else static.keys

                    def step(
                        module=module, backend=backend, cache=static_cache, rotated=rotated
                    ) -> object:
                        return module(
                            q,
                            cache,
                            static.values,
                            backend=backend,
                            keys_rotated=rotated,
                            q_positions=static.query_position,
                            attn_mask=static.mask,
                        )

                if label == "module, dense terms":
                    step = without_few_query_path(step)
                if label == FOLD_LABEL:
                    step = with_fold_switched(step, pe, device.type)
                if label == NO_FLOOR_LABEL:
                    step = without_bias_floor(step, device.type)
                if label == grouped_label:
                    step = with_grouped_queries(step, device.type, not grouped_on)

                frozen = parameters_frozen(pe) if label == FROZEN_LABEL else nullcontext()
                with torch.no_grad(), frozen:
                    seconds, base = paired_seconds(step, fresh_baseline(), device, args.repeats)
                    if args.profile:
                        print_profile(step, device, f"{name}, {label}, {backend}")
                rows.append(timed_row(name, label, backend, seconds, base))
    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": {
            "batch": args.batch,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "cache": m,
            "static_slots": args.static_slots,
            "growing": args.growing,
        },
        "rows": rows,
        "skipped": skipped,
    }


def markdown(report: dict) -> str:
    shape = report["shape"]
    lines = [
        f"# One decode step vs SDPA on the cache ({report['device']}, torch "
        f"{report['torch']}, {report['dtype']}, batch {shape['batch']}, heads "
        f"{shape['heads']}, kv_heads {shape['kv_heads']}, head_dim {shape['head_dim']}, "
        f"{shape['cache']} cached keys)",
        "",
        "One query against the cache; rotary caches hold keys rotated once "
        "(`rotate_keys`, then `keys_rotated=True`). Ratio to plain "
        "`F.scaled_dot_product_attention` of the query against the same cache, timed "
        "alternately in one loop (medians).",
        "",
    ]
    if shape.get("growing"):
        lines += [
            f"Each call reads the first L cached keys, L taking the {shape['growing']} "
            f"values up to {shape['cache']} in turn, the same in every call of a repeat: "
            "a new key count every step, as in a decoding loop (the static-cache rows "
            "keep their shapes).",
            "",
        ]
    if shape.get("static_slots"):
        lines += [
            f"Rows on a {shape['static_slots']}-slot cache: compiled once for a "
            f"preallocated cache whose first {shape['cache']} slots hold the keys, the "
            "query's position passed as a tensor and the empty slots masked by "
            "`attn_mask` (a decoding loop's step under CUDA graphs); the SDPA row is "
            "plain SDPA compiled over the same cache and mask. Their ratios are to the "
            "same eager SDPA on the filled keys.",
            "",
        ]
    lines += [
        "| encoding | variant | backend | µs | ratio to SDPA |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['encoding']} | {row['variant']} | {row['backend']} | "
            f"{row['seconds'] * 1e6:.1f} | {row['time_ratio']:.2f} |"
        )
    for name, reason in report.get("skipped", {}).items():
        lines += ["", f"Not timed: {name} ({reason})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    parser.add_argument("--backends", nargs="+", default=["sdpa"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cache", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile's mode for --compile (reduce-overhead: CUDA graphs on CUDA)",
    )
    parser.add_argument(
        "--growing",
        type=int,
        default=0,
        help="each call reads the first L of the cached keys, L cycling through the last "
        "G counts (a decode loop's new key count every step)",
    )
    parser.add_argument(
        "--static-slots",
        type=int,
        default=0,
        help="also time compiled steps over a preallocated cache of this many slots",
    )
    parser.add_argument(
        "--compare-dense",
        action="store_true",
        help="also time relative encodings without the few-query path and kept rows",
    )
    parser.add_argument(
        "--compare-frozen",
        action="store_true",
        help="also time each module inside a parameters_frozen block (kept values reused)",
    )
    parser.add_argument(
        "--compare-fold",
        action="store_true",
        help="also time encodings that can fold their position term into q and k (TUPE) "
        "with the fold switched from the device's default",
    )
    parser.add_argument(
        "--compare-no-floor",
        action="store_true",
        help="also time each module with the device left out of BIAS_FLOOR_DEVICES",
    )
    parser.add_argument(
        "--compare-causal",
        action="store_true",
        help="also time each module called with causal=True, as a causal model calls it "
        "(one query at the newest position: the same attention as the baseline's)",
    )
    parser.add_argument(
        "--compare-grouped",
        action="store_true",
        help="also time each module with the few-query matmuls switched the other way",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print each step's operators by device time (torch.profiler)",
    )
    parser.add_argument("--tag", default="", help="appended to the result file names")
    add_out_argument(parser)
    args = parser.parse_args()
    report = run(args)
    stem = f"decode_{args.device.split(':')[0]}_{args.dtype}{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
