"""Rotary embedding speed: posgen's rotate against a plain copy and the peers, one run.

For each shape, times rotating q and k (forward, no autograd) with ``generated.rope``
(half pairing), ``generated.rope_gptj`` (interleaved) and ``generated.rope_partial``
(a quarter of each head), beside a plain ``clone`` of q and k (the memory-bound floor),
Hugging Face's ``apply_rotary_pos_emb`` (eager, and under ``torch.compile`` with
``--compile``) and x-transformers' ``apply_rotary_pos_emb``. Every candidate is timed
alternately with the copy and reported as a ratio to it (medians of repeats).

    python benchmarks/rotary.py --device cpu --dtype float32
    python benchmarks/rotary.py --device cuda --dtype bfloat16 --compile
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import paired_seconds  # noqa: E402

from generated import ENCODINGS  # noqa: E402


def peers(q: torch.Tensor, k: torch.Tensor, compile_peers: bool) -> dict[str, Callable[[], object]]:
    """The peer implementations that are installed, each a call rotating q and k."""
    found: dict[str, Callable[[], object]] = {}
    n, d = q.shape[2], q.shape[3]
    positions = torch.arange(n, device=q.device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=q.device).float() / d))
    angles = positions.float()[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        def hf() -> object:
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)

        found["hf_apply_rotary_pos_emb"] = hf
        if compile_peers:
            compiled = torch.compile(apply_rotary_pos_emb)

            def hf_compiled() -> object:
                return compiled(q, k, cos, sin, unsqueeze_dim=0)

            found["hf_compiled"] = hf_compiled
    except ImportError:
        pass
    try:
        from x_transformers.x_transformers import apply_rotary_pos_emb as xt_apply

        freqs = angles.repeat_interleave(2, dim=-1)[None]  # [1, N, d], interleaved pairs

        def xt() -> object:
            return xt_apply(q, freqs), xt_apply(k, freqs)

        found["x_transformers"] = xt
    except ImportError:
        pass
    return found


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for batch, heads, length, head_dim in args.shapes:
        q = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
        k = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)

        def copy(q=q, k=k) -> object:
            return q.clone(), k.clone()

        candidates: dict[str, Callable[[], object]] = {}
        for name in ("rope", "rope_gptj", "rope_partial"):
            pe = ENCODINGS[name](heads=heads, head_dim=head_dim)

            def call(pe=pe, q=q, k=k) -> object:
                return pe.rotate(q, k)

            candidates[f"posgen {name}"] = call
        candidates.update(peers(q, k, args.compile))
        with torch.no_grad():
            for name, call in candidates.items():
                seconds, base = paired_seconds(call, copy, device, args.repeats)
                rows.append(
                    {
                        "shape": [batch, heads, length, head_dim],
                        "candidate": name,
                        "seconds": seconds,
                        "copy_seconds": base,
                        "ratio_to_copy": seconds / base,
                    }
                )
                shape = str((batch, heads, length, head_dim))
                print(f"{shape:>22} {name:>26} {seconds / base:6.2f}x copy", flush=True)
    return {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "rows": rows,
    }


def markdown(report: dict) -> str:
    lines = [
        f"# Rotating q and k vs a plain copy ({report['device']}, torch {report['torch']}, "
        f"{report['dtype']})",
        "",
        "Ratio of each candidate's median time to `q.clone(), k.clone()` timed alternately "
        "in the same run (no autograd). posgen's `rope_partial` rotates a quarter of each head.",
        "",
        "| shape [B, H, N, D] | candidate | ratio to copy |",
        "|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['shape']} | {row['candidate']} | {row['ratio_to_copy']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--shapes",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        nargs="+",
        default=[(1, 8, 1024, 64), (2, 16, 2048, 128)],
        help="B,H,N,D shapes",
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="also time HF under torch.compile")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"rotary_{args.device.split(':')[0]}_{args.dtype}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
