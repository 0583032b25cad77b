"""The fused distance-bias kernel alone against plain SDPA, interleaved in one loop.

Times ``fused_distance_attention`` (the Triton kernels behind the flex backend's fused
route) with each bias form it reads, beside ``F.scaled_dot_product_attention`` with no
bias (FlashAttention on a CUDA GPU in half precision), forward alone and forward plus
backward into q, k and v. "none" isolates the kernels' own speed from the bias; "slope"
is ALiBi's c_h |r|; "clipped" a T5-style [H, 2K + 1] vector (K = 128), tiles wholly
past the clip adding one value; "gathered" the same vector gathered per score in every
tile (``FUSED_DISTANCE_CONSTANT_TILES = False``); "vector" the full [H, N + M - 1]
per-distance vector. On CUDA it also prints the tile each autotuned
kernel chose.

    python benchmarks/fused_distance.py --lengths 2048 8192 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    as_step,
    header_text,
    paired_seconds,
    report_header,
    write_results,
)

import generated._fused_distance as runtime  # noqa: E402
from generated._triton import TRITON_CACHE  # noqa: E402

CLIP = 128  # the clipped vector's K


def bias_for(
    kind: str, heads: int, n: int, device: torch.device
) -> tuple[torch.Tensor | None, str, int]:
    """(bias, bias_kind, bias_base) of each timed form."""
    if kind == "none":
        return None, "none", 0
    if kind == "slope":
        return -torch.rand(heads, device=device), "slope", 0
    if kind in ("clipped", "gathered"):
        return torch.randn(heads, 2 * CLIP + 1, device=device), "vector", CLIP
    return torch.randn(heads, 2 * n - 1, device=device), "vector", n - 1


def tuned_tiles() -> str:
    """The autotuner's choice per kernel, as far as it has chosen."""
    found = []
    for name in ("forward", "key_grad", "query_grad"):
        kernel = TRITON_CACHE.get(f"attention_tuned:{name}")
        best = getattr(kernel, "best_config", None)
        if best is not None:
            found.append(f"{name}: {best}")
    return "; ".join(found)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    runtime.FUSED_DISTANCE_DEVICES.add(device.type)
    rows = []
    for n in args.lengths:
        shape = (args.batch, args.heads, n, args.head_dim)
        for causal in args.causal:
            for mode in args.modes:
                q, k, v = (
                    torch.randn(shape, device=device, dtype=dtype, requires_grad=mode == "train")
                    for _ in range(3)
                )
                scale = args.head_dim**-0.5

                def baseline_attend(q=q, k=k, v=v, causal=causal) -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                baseline = as_step(baseline_attend, [q, k, v], mode)
                for kind in args.kinds:
                    bias, bias_kind, base = bias_for(kind, args.heads, n, device)

                    def attend(
                        q=q,
                        k=k,
                        v=v,
                        scale=scale,
                        bias=bias,
                        bias_kind=bias_kind,
                        base=base,
                        causal=causal,
                    ) -> torch.Tensor:
                        return runtime.fused_distance_attention(
                            q, k, v, scale, bias, bias_kind, base, causal=causal
                        )[0]

                    call = as_step(attend, [q, k, v], mode)
                    runtime.FUSED_DISTANCE_CONSTANT_TILES = kind != "gathered"
                    seconds, base_seconds = paired_seconds(call, baseline, device, args.repeats)
                    runtime.FUSED_DISTANCE_CONSTANT_TILES = True
                    tiles = tuned_tiles() if device.type == "cuda" else ""
                    rows.append(
                        {
                            "bias": kind,
                            "length": n,
                            "causal": causal,
                            "mode": mode,
                            "seconds": seconds,
                            "baseline_seconds": base_seconds,
                            "time_ratio": seconds / base_seconds,
                            "tiles": tiles,
                        }
                    )
                    print(
                        f"{kind:>8} N={n:<5} causal={causal!s:<5} {mode:>7} "
                        f"{seconds * 1e3:8.3f} ms {seconds / base_seconds:6.2f}x  {tiles}",
                        flush=True,
                    )
    return {**report_header(args, device), "rows": rows}


def markdown(report: dict) -> str:
    lines = [
        f"# Fused distance-bias kernel vs plain SDPA ({header_text(report)})",
        "",
        "Ratio: `fused_distance_attention`'s median time over plain "
        "`F.scaled_dot_product_attention(q, k, v, is_causal=causal)` (FlashAttention on "
        "CUDA in half precision), the two timed alternately in the same loop. `train` is "
        f"forward plus backward into q, k and v. Bias: none; slope (ALiBi); clipped (a "
        f"[H, {2 * CLIP + 1}] vector, T5-like, one value per tile past the clip); gathered "
        "(the same, gathered per score in every tile); vector (the full [H, 2N - 1] "
        "vector).",
        "",
        "| bias | N | causal | mode | ms | ratio | tiles chosen |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['bias']} | {row['length']} | {'yes' if row['causal'] else 'no'} | "
            f"{row['mode']} | {row['seconds'] * 1e3:.3f} | {row['time_ratio']:.2f} | "
            f"{row['tiles']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=["none", "slope", "clipped", "gathered", "vector"],
        default=["none", "slope", "clipped", "gathered", "vector"],
    )
    parser.add_argument(
        "--modes", nargs="+", choices=["forward", "train"], default=["forward", "train"]
    )
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    add_out_argument(parser)
    args = parser.parse_args()
    args.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
    report = run(args)
    table = markdown(report)
    write_results(args.out, f"fused_distance_{args.device}_{args.dtype}", report, table)


if __name__ == "__main__":
    main()
