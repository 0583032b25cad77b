"""What the host allocator's page faults cost the CPU backends: the same timings under
three allocator settings, each in processes of its own, the settings taking turns.

On Linux, glibc's malloc hands a freed block of more than 32 MiB (or one at the top of
the heap) back to the system, and the next call's block of that size is touched page
by page again: a minor page fault per 4 KiB, about 1 µs each on a 2-core VM. The sdpa
backend's masks and relative terms are such blocks ([B, H, 256, M] per query chunk),
plain SDPA allocates only its output, so the faults land in the ratio. Settings:

- ``default``: the process as started;
- ``glibc``: ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at 4 GiB, so
  freed blocks stay in the heap for the next call;
- ``thp``: ``THP_MEM_ALLOC_ENABLE=1``, PyTorch's CPU allocator asking for transparent
  huge pages (2 MiB, a fault each) for large tensors.

Each worker process times every case against plain SDPA, interleaved (medians of
repeats), and counts the minor page faults of one call (``getrusage``); the parent
runs ``--rounds`` rounds, each setting once per round in turn, and reports each
setting's median ratio over the rounds.

    python benchmarks/cpu_allocator.py --encodings transformer_xl deberta alibi
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    header_text,
    paired_seconds,
    report_header,
    write_results,
)

from generated import ENCODINGS  # noqa: E402

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "glibc": {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
}
CASES = ("forward", "causal forward", "explicit positions")


def page_faults(call: Callable[[], object]) -> int:
    """Minor page faults of one call of ``call`` in this process."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def worker(args: argparse.Namespace) -> list[dict]:
    """Every (encoding, case) against plain SDPA on the same q, k, v, in this process."""
    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.n, args.head_dim)
    q, k, v = (torch.randn(shape) for _ in range(3))
    positions = 2 * torch.arange(args.n) + 5  # not a shift of the defaults
    rows = []
    with torch.no_grad():
        for name in args.encodings:
            pe = ENCODINGS[name](heads=args.heads, head_dim=args.head_dim)
            for case in CASES:
                causal = case == "causal forward"
                given = (
                    {"q_positions": positions, "k_positions": positions}
                    if case == "explicit positions"
                    else {}
                )

                def call(pe=pe, causal=causal, given=given) -> object:
                    return pe(q, k, v, causal=causal, backend="sdpa", **given)

                def baseline(causal=causal) -> object:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                seconds, base = paired_seconds(call, baseline, torch.device("cpu"), args.repeats)
                rows.append(
                    {
                        "encoding": name,
                        "case": case,
                        "ratio": seconds / base,
                        "ms": seconds * 1e3,
                        "faults": page_faults(call),
                        "baseline_faults": page_faults(baseline),
                    }
                )
    return rows


def run(args: argparse.Namespace) -> dict:
    results: dict[str, list[list[dict]]] = {setting: [] for setting in SETTINGS}
    command = [sys.executable, __file__, "--worker", *worker_arguments(args)]
    for round_index in range(args.rounds):
        for setting, extra in SETTINGS.items():
            environment = {**os.environ, **extra}
            done = subprocess.run(command, env=environment, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"worker ({setting}) failed:\n{done.stderr}")
            results[setting].append(json.loads(done.stdout))
            print(f"round {round_index + 1}: {setting} done", flush=True)
    rows = []
    for setting, runs in results.items():
        for index, first in enumerate(runs[0]):
            rows.append(
                {
                    "setting": setting,
                    "encoding": first["encoding"],
                    "case": first["case"],
                    "ratio": statistics.median(run[index]["ratio"] for run in runs),
                    "ms": statistics.median(run[index]["ms"] for run in runs),
                    "faults": statistics.median(run[index]["faults"] for run in runs),
                    "baseline_faults": statistics.median(
                        run[index]["baseline_faults"] for run in runs
                    ),
                }
            )
    header = report_header(args, torch.device("cpu"))
    return {**header, "n": args.n, "rounds": args.rounds, "settings": SETTINGS, "rows": rows}


def worker_arguments(args: argparse.Namespace) -> list[str]:
    return [
        "--encodings",
        *args.encodings,
        *("--n", str(args.n), "--batch", str(args.batch), "--heads", str(args.heads)),
        *("--head-dim", str(args.head_dim), "--repeats", str(args.repeats)),
    ]


def markdown(report: dict) -> str:
    settings = list(report["settings"])
    lines = [
        f"# The sdpa backend under three host-allocator settings ({header_text(report)}, "
        f"N = {report['n']}, no autograd)",
        "",
        "Ratio of the module's median time to plain `F.scaled_dot_product_attention`'s "
        "(interleaved in each worker process), the median over "
        f"{report['rounds']} rounds of one process per setting; faults: minor page "
        "faults of one module call (plain SDPA's in parentheses). Settings: "
        + "; ".join(
            f"`{name}`: "
            + (", ".join(f"`{key}={value}`" for key, value in extra.items()) or "as started")
            for name, extra in report["settings"].items()
        )
        + ".",
        "",
        "| encoding | case | " + " | ".join(settings) + " |",
        "|---|---|" + "---|" * len(settings),
    ]
    keyed = {(row["setting"], row["encoding"], row["case"]): row for row in report["rows"]}
    for encoding, case in dict.fromkeys((row["encoding"], row["case"]) for row in report["rows"]):
        cells = []
        for setting in settings:
            row = keyed[(setting, encoding, case)]
            cells.append(
                f"{row['ratio']:.2f}× ({row['faults'] / 1e3:.0f}k faults, "
                f"{row['baseline_faults'] / 1e3:.0f}k)"
            )
        lines.append(f"| {encoding} | {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--encodings", nargs="+", default=["alibi", "t5", "deberta"])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    report = run(args)
    write_results(args.out, "cpu_allocator_float32", report, markdown(report))


if __name__ == "__main__":
    main()
