"""Rotary embedding speed: posgen's rotate against a plain copy and the peers, one run.

For each shape, times rotating q and k with ``generated.rope`` (half pairing),
``generated.rope_gptj`` (interleaved) and ``generated.rope_partial`` (a quarter of each
head), beside a plain ``clone`` of q and k (the memory-bound floor), Hugging Face's
``apply_rotary_pos_emb`` (eager, and under ``torch.compile`` with ``--compile``, which
also compiles posgen's three modules),
x-transformers' ``apply_rotary_pos_emb``, rotary-embedding-torch's
``RotaryEmbedding(dim).rotate_queries_or_keys`` and, on CUDA, Liger-Kernel's
``LigerRopeFunction`` (each peer where it is installed: ``pip install -e ".[bench]"``
takes them all). Every candidate is timed
alternately with the copy and reported as a ratio to it (medians of repeats).

Without ``--backward`` the rotation runs under no_grad. With it, each call is the forward
and the backward of loss = sum(q_rot * g_q) + sum(k_rot * g_k) for fixed random g (the
input gradients through ``torch.autograd.grad``), and the floor is a copy whose backward
copies the gradient (one read and one write each way). On CUDA posgen's rotation is then
one fused Triton kernel each way (templates/runtime.py, ``fused_rotation``).

``--before REV`` also times posgen's three modules as generated at that git revision
(``revisions.generated_at``), the copy, the module at REV and the module now taking
turns in every repeat; ``--no-peers`` leaves the peers out.

    python benchmarks/rotary.py --device cpu --dtype float32
    python benchmarks/rotary.py --before HEAD --no-peers --shapes 2,16,2048,128
    python benchmarks/rotary.py --device cuda --dtype bfloat16 --compile --backward
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    describe_device,
    interleaved_seconds,
    paired_seconds,
    write_results,
)
from revisions import generated_at  # noqa: E402

from generated import ENCODINGS  # noqa: E402

Rotation = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _CopyBothWays(torch.autograd.Function):
    """x.clone() whose backward also copies: the floor for a forward and backward pass."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def copy_rotation(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory-bound floor: q and k copied (and their gradients, with autograd)."""
    return _CopyBothWays.apply(q), _CopyBothWays.apply(k)


def llama_cos_sin(
    length: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Angles [N, D / 2] (base 10000) and HF's half-pairing cos, sin [N, D] in ``dtype``."""
    positions = torch.arange(length, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return angles, emb.cos().to(dtype), emb.sin().to(dtype)


def peers(q: torch.Tensor, compile_peers: bool) -> dict[str, Rotation]:
    """The peer implementations that are installed, each rotating (q, k) of q's shape."""
    found: dict[str, Rotation] = {}
    n, d = q.shape[2], q.shape[3]
    angles, cos, sin = llama_cos_sin(n, d, q.device, q.dtype)
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        def hf(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=0)

        found["hf_apply_rotary_pos_emb"] = hf
        if compile_peers:
            compiled = torch.compile(apply_rotary_pos_emb)

            def hf_compiled(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return compiled(q, k, cos, sin, unsqueeze_dim=0)

            found["hf_compiled"] = hf_compiled
    except ImportError:
        pass
    try:
        from x_transformers.x_transformers import apply_rotary_pos_emb as xt_apply

        freqs = angles.repeat_interleave(2, dim=-1)[None]  # [1, N, d], interleaved pairs

        def xt(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return xt_apply(q, freqs), xt_apply(k, freqs)

        found["x_transformers"] = xt
    except ImportError:
        pass
    try:
        from rotary_embedding_torch import RotaryEmbedding

        rotary = RotaryEmbedding(d).to(q.device)  # interleaved pairs, sequence at dim -2

        def ret(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return rotary.rotate_queries_or_keys(q), rotary.rotate_queries_or_keys(k)

        found["rotary_embedding_torch"] = ret
    except ImportError:
        pass
    if q.device.type == "cuda":
        try:
            from liger_kernel.ops.rope import LigerRopeFunction

            def liger(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                # rotates in place in the [B, N, H, D] storage (see liger_inputs)
                return LigerRopeFunction.apply(q, k, cos, sin)

            found["liger_kernel"] = liger
        except ImportError:
            pass
    return found


def liger_layout(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, N, D] stored as [B, N, H, D] (Liger's kernel works on that storage, in
    place; other layouts cost it a copy first)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def timed_call(
    rotation: Rotation,
    q: torch.Tensor,
    k: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor] | None,
) -> Callable[[], object]:
    """One timed call: the rotation (no autograd), or its forward and backward."""
    if grads is None:

        def forward_only() -> object:
            with torch.no_grad():
                return rotation(q, k)

        return forward_only
    q_leaf, k_leaf = q.detach().requires_grad_(), k.detach().requires_grad_()

    def forward_backward() -> object:
        q_rot, k_rot = rotation(q_leaf, k_leaf)
        return torch.autograd.grad((q_rot, k_rot), (q_leaf, k_leaf), grads)

    return forward_backward


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    before = None
    if args.before is not None:
        before = generated_at(args.before, Path(tempfile.mkdtemp(prefix="posgen_rotary_")))
    for batch, heads, length, head_dim in args.shapes:
        q = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
        k = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
        grads = (torch.randn_like(q), torch.randn_like(k)) if args.backward else None
        copy = timed_call(copy_rotation, q, k, grads)
        shape = str((batch, heads, length, head_dim))
        candidates: dict[str, Callable[[], object]] = {}
        for name in ("rope", "rope_gptj", "rope_partial"):
            pe = ENCODINGS[name](heads=heads, head_dim=head_dim).to(device)
            now = timed_call(pe.rotate, q, k, grads)
            if before is not None:
                then = before[name](heads=heads, head_dim=head_dim).to(device).rotate
                then_s, now_s, base = interleaved_seconds(
                    [timed_call(then, q, k, grads), now, copy], device, args.repeats
                )
                for label, seconds in (
                    (f"posgen {name} at {args.before}", then_s),
                    (f"posgen {name}", now_s),
                ):
                    rows.append(_row(batch, heads, length, head_dim, label, seconds, base))
                    print(f"{shape:>22} {label:>26} {seconds / base:6.2f}x copy", flush=True)
            else:
                candidates[f"posgen {name}"] = now
            if args.compile:
                compiled = torch.compile(pe.rotate, fullgraph=True)
                candidates[f"posgen {name}, compiled"] = timed_call(compiled, q, k, grads)
        for name, rotation in (peers(q, args.compile) if args.peers else {}).items():
            if name == "liger_kernel":
                liger_grads = (
                    None if grads is None else (liger_layout(grads[0]), liger_layout(grads[1]))
                )
                candidates[name] = timed_call(
                    rotation, liger_layout(q), liger_layout(k), liger_grads
                )
            else:
                candidates[name] = timed_call(rotation, q, k, grads)
        for name, call in candidates.items():
            try:
                seconds, base = paired_seconds(call, copy, device, args.repeats)
            except Exception as error:  # a peer that does not run here is reported, not fatal
                print(f"{shape:>22} {name:>26} skipped: {type(error).__name__}: {error}")
                continue
            rows.append(_row(batch, heads, length, head_dim, name, seconds, base))
            print(f"{shape:>22} {name:>26} {seconds / base:6.2f}x copy", flush=True)
    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "backward": args.backward,
        "before": args.before,
        "rows": rows,
    }


def _row(
    batch: int, heads: int, length: int, head_dim: int, name: str, seconds: float, base: float
) -> dict:
    return {
        "shape": [batch, heads, length, head_dim],
        "candidate": name,
        "seconds": seconds,
        "copy_seconds": base,
        "ratio_to_copy": seconds / base,
    }


def markdown(report: dict) -> str:
    if report.get("backward"):
        what = "forward and backward", "a copy whose backward copies the gradient", "with"
    else:
        what = "", "`q.clone(), k.clone()`", "no"
    lines = [
        f"# Rotating q and k {what[0] + ' ' if what[0] else ''}vs a plain copy "
        f"({report['device']}, torch {report['torch']}, {report['dtype']})",
        "",
        f"Ratio of each candidate's median time to {what[1]}, timed alternately in the same "
        f"run ({what[2]} autograd). posgen's `rope_partial` rotates a quarter of each head.",
        "",
        *(
            [
                f"Rows `at {report['before']}` are posgen's modules as generated at that git "
                "revision, timed in turns with the copy and the modules as they are now.",
                "",
            ]
            if report.get("before")
            else []
        ),
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
    parser.add_argument(
        "--compile", action="store_true", help="also time posgen and HF under torch.compile"
    )
    parser.add_argument(
        "--backward", action="store_true", help="time forward and backward (input gradients)"
    )
    parser.add_argument(
        "--before", default=None, help="also time posgen's modules at this git revision"
    )
    parser.add_argument(
        "--no-peers", dest="peers", action="store_false", help="time posgen's modules only"
    )
    parser.add_argument("--tag", default="", help="appended to the result file names")
    add_out_argument(parser)
    args = parser.parse_args()
    report = run(args)
    backward = "_backward" if args.backward else ""
    stem = f"rotary_{args.device.split(':')[0]}_{args.dtype}{backward}{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
