"""How the layout and values of an additive SDPA mask change its speed on this device.

The generated ``sdpa`` backend passes the position bias as ``attn_mask``. This measures,
in one run and as ratios to ``F.scaled_dot_product_attention(is_causal=True)``:

- a [heads, N, M] mask against the same values as [1, heads, N, M] (the layout the
  generated modules pass) and as a stride-0 [batch, heads, N, M] view;
- an ALiBi bias (large negative values whose exp() is denormal in float32) with and
  without clamping.

``--flush-denormal`` first flushes denormals to zero on every thread
(``flush_denormals`` of the generated runtime); with ``--out`` the files it writes are
named ``..._flushed``.

    python benchmarks/sdpa_mask_layout.py --lengths 256 1024 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import cpu_model  # noqa: E402

import generated._numerics as numerics  # noqa: E402


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def masks(heads: int, batch: int, n: int) -> dict[str, torch.Tensor]:
    """Name -> additive float mask, all causal (-inf above the diagonal)."""
    blocked = ~torch.ones(n, n, dtype=torch.bool).tril()
    random_bias = torch.randn(heads, n, n).masked_fill(blocked, float("-inf"))  # [H, N, N]
    distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().float()
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    alibi = (-slopes[:, None, None] * distance).masked_fill(blocked, float("-inf"))
    return {
        "random [H,N,M]": random_bias,
        "random [1,H,N,M]": random_bias[None],
        "random [B,H,N,M] stride-0": random_bias.expand(batch, heads, n, n),
        "alibi [H,N,M]": alibi,
        "alibi [1,H,N,M]": alibi[None],
        "alibi [1,H,N,M] clamped to -60": alibi.clamp(min=-60.0)[None],
    }


def run(args: argparse.Namespace) -> dict:
    rows = []
    for n in args.lengths:
        q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim) for _ in range(3))

        def baseline(q=q, k=k, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        base = median_seconds(baseline, args.repeats)
        for name, mask in masks(args.heads, args.batch, n).items():

            def call(mask=mask, q=q, k=k, v=v) -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

            ratio = median_seconds(call, args.repeats) / base
            rows.append({"mask": name, "length": n, "time_ratio": ratio})
            print(f"N={n:<5} {name:<45} {ratio:6.2f}x", flush=True)
    return {
        "device": cpu_model(),
        "torch": torch.__version__,
        "batch": args.batch,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "flush_denormal": args.flush_denormal,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# SDPA additive-mask layout ({report['device']}, torch {report['torch']}, float32, "
        f"batch {report['batch']}, heads {report['heads']}, head_dim {report['head_dim']}"
        + (", denormals flushed" if report["flush_denormal"] else "")
        + ")",
        "",
        "Time ratios to `F.scaled_dot_product_attention(is_causal=True)` measured in the same "
        "run (median of repeats).",
        "",
        "| mask | N | time ratio |",
        "|---|---|---|",
    ]
    lines += [f"| {r['mask']} | {r['length']} | {r['time_ratio']:.2f} |" for r in report["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the result files (e.g. benchmarks/results); default: print only",
    )
    parser.add_argument("--flush-denormal", action="store_true")
    args = parser.parse_args()
    if args.flush_denormal and not numerics.flush_denormals():
        parser.error("--flush-denormal: denormals are not flushed on every thread")
    report = run(args)
    print(markdown(report))
    if args.out is None:  # a trial run never overwrites the committed results
        return
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "sdpa_mask_layout_cpu_float32" + ("_flushed" if args.flush_denormal else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
