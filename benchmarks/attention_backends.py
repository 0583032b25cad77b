"""Attention speed and memory of each generated module's backends, against plain SDPA.

For every encoding and sequence length, times a causal forward pass with the `sdpa` and
`eager` backends and, in the same run, plain ``F.scaled_dot_product_attention`` with no
position encoding (the baseline). Reports ratios to the baseline (absolute times on a
shared machine are noise) and, on CUDA, peak memory.

    python benchmarks/attention_backends.py --device cuda --dtype bfloat16 --backends sdpa flex
    python benchmarks/attention_backends.py --device cpu --lengths 256 1024
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from generated import ENCODINGS  # noqa: E402

DEFAULT_ENCODINGS = [
    "alibi",
    "t5",
    "rope",
    "rope_gptj",
    "sinusoidal",
    "shaw",
    "bert_relative_key",
    "deberta",
    "transformer_xl",
    "tupe_r",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def paired_seconds(
    fn: Callable[[], object], baseline: Callable[[], object], device: torch.device, repeats: int
) -> tuple[float, float]:
    """Median times of ``fn`` and ``baseline``, timed alternately after warm-up.

    Alternating the two calls exposes both to the same drift in machine load, so their
    ratio is steadier than two separate medians. On CUDA each call is timed with CUDA
    events (device time, no host launch gap); on the CPU with the host clock.
    """
    for _ in range(3):
        fn()
        baseline()
    _sync(device)
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(repeats):
        for index, call in enumerate((fn, baseline)):
            if device.type == "cuda":
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
                call()
                end_event.record()
                end_event.synchronize()
                times[index].append(start_event.elapsed_time(end_event) / 1e3)
            else:
                start = time.perf_counter()
                call()
                times[index].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for length in args.lengths:
        shape = (args.batch, args.heads, length, args.head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))

        def baseline(q=q, k=k, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        base_mem = peak_bytes(baseline, device)
        for name in args.encodings:
            pe = ENCODINGS[name](heads=args.heads, head_dim=args.head_dim).to(device)
            limit = getattr(pe, "max_positions", None)
            if limit is not None and length > limit:
                print(f"{name:>12} skipped at N={length}: its table ends at {limit}", flush=True)
                continue
            for backend in args.backends:
                if backend == "eager" and length > args.max_eager_length:
                    continue

                def call(pe=pe, backend=backend, q=q, k=k, v=v) -> torch.Tensor:
                    with torch.no_grad():
                        return pe(q, k, v, causal=True, backend=backend)

                seconds, base_time = paired_seconds(call, baseline, device, args.repeats)
                memory = peak_bytes(call, device)
                rows.append(
                    {
                        "encoding": name,
                        "backend": backend,
                        "length": length,
                        "seconds": seconds,
                        "baseline_seconds": base_time,
                        "time_ratio": seconds / base_time,
                        "peak_bytes": memory,
                        "baseline_peak_bytes": base_mem,
                        "memory_ratio": (memory / base_mem) if memory and base_mem else None,
                    }
                )
                print(
                    f"{name:>12} {backend:>5} N={length:<6} {seconds / base_time:7.2f}x sdpa",
                    flush=True,
                )
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Attention backends vs plain SDPA ({report['device']}, torch {report['torch']}, "
        f"{report['dtype']}, batch {report['batch']}, heads {report['heads']}, "
        f"head_dim {report['head_dim']}, causal)",
        "",
        "Ratios to plain `F.scaled_dot_product_attention(is_causal=True)` with no position "
        "encoding, measured in the same run (medians of alternating repeats).",
        "",
        "| encoding | backend | N | time ratio | peak memory ratio |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        memory = f"{row['memory_ratio']:.2f}" if row["memory_ratio"] else "n/a"
        lines.append(
            f"| {row['encoding']} | {row['backend']} | {row['length']} | "
            f"{row['time_ratio']:.2f} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--encodings", nargs="+", default=DEFAULT_ENCODINGS)
    parser.add_argument("--backends", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-eager-length", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"attention_backends_{args.device.split(':')[0]}_{args.dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
