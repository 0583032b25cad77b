"""How many softmax weights of a steep bias are denormal float32, with and without the
sdpa backend's floor (``_distances.floored_bias``): a count, not a timing, so that it
holds on every CPU (denormal arithmetic costs a lot on some and nothing on others).

For ALiBi (Press et al. 2022) at the shapes of ``attention_backends.py`` (batch 2, 16
heads, head_dim 64, randn q and k, default positions), each query row's weights
softmax(s · q_i · k_j + b_ij) are counted where 0 < w < 2^-126 (float32's smallest
normal), for the bias as it is, floored ``BIAS_FLOOR`` under the row's top entry (the
floor before the content spread joined it) and floored ``BIAS_FLOOR`` plus
``content_spread`` under it (the floor as shipped: the per-row form of a materialised
bias, and the per-head form of the per-distance vector, whose top is distance 0), and
for those two forms as they were before spreads past ``BIAS_FLOOR_MOST_SPREAD`` took
the deeper floor. ``--content-scales`` multiplies q and k, so that the spread bound
grows (about 22 at 1, 50 at 1.3 for the largest of a head).

    python benchmarks/denormal_weights.py [--lengths 2048] [--content-scales 1 1.3]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import add_out_argument, describe_device, write_results  # noqa: E402

from generated import ENCODINGS  # noqa: E402
from generated import _distances as distances  # noqa: E402

BATCH, HEADS, HEAD_DIM = 2, 16, 64


def floors(bias: torch.Tensor, spread: torch.Tensor) -> dict[str, torch.Tensor]:
    """bias [H, N, M] as SDPA would get it: as it is and under each floor."""
    row_top = bias.amax(dim=-1, keepdim=True)  # [H, N, 1]
    distance_top = torch.zeros_like(row_top)  # ALiBi's bias at distance 0
    head_spread = spread.amax(dim=1, keepdim=True)  # [H, 1, 1]
    shipped = {
        "per pair": distances.floored_bias(bias, row_top, spread),
        "per distance": distances.floored_bias(bias, distance_top, head_spread),
    }
    most = distances.BIAS_FLOOR_MOST_SPREAD
    distances.BIAS_FLOOR_MOST_SPREAD = math.inf  # 40 + spread below, whatever the spread
    try:
        before = {
            "per pair": distances.floored_bias(bias, row_top, spread),
            "per distance": distances.floored_bias(bias, distance_top, head_spread),
        }
    finally:
        distances.BIAS_FLOOR_MOST_SPREAD = most
    return {
        "as it is": bias,
        "floor 40 under the row's top": distances.floored_bias(
            bias, row_top, torch.zeros_like(spread)
        ),
        "floor 40 + spread under the row's top (before 2026-12-04, per pair)": before["per pair"],
        "floor 40 + head's largest spread under distance 0 (before 2026-12-04, per distance)": (
            before["per distance"]
        ),
        "floor under the row's top (shipped, per pair)": shipped["per pair"],
        "floor under distance 0 (shipped, per distance)": shipped["per distance"],
    }


def denormal_share(
    q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, scale: float, causal: bool
) -> float:
    """The share of weights in (0, 2^-126), one head at a time: q, k [B, H, N, D]."""
    n, m = q.shape[2], k.shape[2]
    tiny = torch.finfo(torch.float32).tiny
    keep = torch.ones(n, m, dtype=torch.bool).tril(m - n) if causal else None
    denormal = 0
    for head in range(q.shape[1]):
        logits = q[:, head] @ k[:, head].transpose(-1, -2) * scale + bias[head]  # [B, N, M]
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        denormal += int(((weights > 0) & (weights < tiny)).sum())
    return denormal / (q.shape[0] * q.shape[1] * n * m)


def markdown(report: dict) -> str:
    """The report as a table, under a heading that names the machine and the shapes."""
    first = report["rows"][0]
    lines = [
        f"# Denormal softmax weights of ALiBi ({report['device']}, torch {report['torch']}, "
        f"float32, batch {BATCH}, heads {HEADS}, head_dim {HEAD_DIM})",
        "",
        "Fraction of softmax weights in (0, 2^-126) with randn q and k times the content "
        "scale; the content spread bound 2·|scale|·|q_i|·max|k_j| (`content_spread`) per "
        "row, median and largest, per content scale: "
        + "; ".join(
            f"{scale}: {median:.1f}, {largest:.1f}"
            for scale, median, largest in sorted(
                {(r["content_scale"], r["spread_median"], r["spread_max"]) for r in report["rows"]}
            )
        )
        + ". The shipped floor sits 40 + spread below the top where the spread bound is at "
        f"most {first['most_spread']:g}, else {first['deep']:g} + spread below.",
        "",
        "| N | content scale | causal | bias given to SDPA | denormal weights |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['N']} | {r['content_scale']} | {'yes' if r['causal'] else 'no'} | "
        f"{r['bias']} | {r['denormal']:.2e} |"
        for r in report["rows"]
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument(
        "--content-scales",
        type=float,
        nargs="+",
        default=[1.0],
        help="multiply q and k by each (a larger content spread bound)",
    )
    parser.add_argument("--tag", default="", help="appended to the result file names")
    add_out_argument(parser)
    args = parser.parse_args()
    pe = ENCODINGS["alibi"](heads=HEADS, head_dim=HEAD_DIM)
    rows = []
    for n in args.lengths:
        for content_scale in args.content_scales:
            torch.manual_seed(0)
            q, k = (torch.randn(BATCH, HEADS, n, HEAD_DIM) * content_scale for _ in "qk")
            spread = distances.content_spread(q, k, pe.scale)  # [H, N, 1]
            positions = torch.arange(n)
            with torch.no_grad():
                bias = pe.score_bias(positions, positions)  # [H, N, M]
                for label, floored in floors(bias, spread).items():
                    for causal in (False, True):
                        share = denormal_share(q, k, floored, pe.scale, causal)
                        rows.append(
                            {
                                "N": n,
                                "content_scale": content_scale,
                                "causal": causal,
                                "bias": label,
                                "denormal": share,
                                "spread_median": float(spread.median()),
                                "spread_max": float(spread.max()),
                                "most_spread": distances.BIAS_FLOOR_MOST_SPREAD,
                                "deep": distances.BIAS_FLOOR_DEEP,
                            }
                        )
    report = {"device": describe_device(torch.device("cpu")), "torch": torch.__version__}
    report["rows"] = rows
    stem = f"denormal_weights_cpu_float32{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
