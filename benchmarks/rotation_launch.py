"""The fused rotary kernel's launch shape: a sweep against a plain copy, one run.

posgen's Triton rotation (``generated._rotation_kernel``) has its launch shape in module
constants: positions per program (``FUSED_ROTATION_BLOCK_N``), heads per tile
(``FUSED_ROTATION_BLOCK_H``), heads one program walks with the same cos and sin in
registers (``FUSED_ROTATION_HEADS_PER_PROGRAM``, None: all, split while the grid would
leave SMs idle) and warps (``FUSED_ROTATION_NUM_WARPS``). On one H100 (bf16, [4, 32,
4096, 128]) the module's rotation of q and k took 1.55x a copy of them, against
Liger-Kernel's 1.19x, whose programs each take one position's heads at once (BLOCK_N 1,
every head in one tile, no loop). This sweep times that shape and others, so that the
defaults come from measurements.

For each pairing (half: ``rope``; interleaved: ``rope_gptj``) it times, alternately
with ``q.clone(), k.clone()`` (medians of repeats, CUDA events):

- the module's own call, ``pe.rotate(q, k)``, at the default launch shape (host work
  included: the gap before the first kernel counts on the device's clock);
- the kernel alone (``launch_rotation`` on q and on k with cos and sin computed once)
  at the default shape and at every shape of the sweep.

Every launch shape's output is first compared with the default shape's (the same
float32 arithmetic, so bit for bit) and with the rotation formula in float32 (within
the dtype's rounding); a shape that disagrees is reported and not timed.

    python benchmarks/rotation_launch.py --device cuda --dtype bfloat16 --out benchmarks/results

Without CUDA the kernel runs only under ``TRITON_INTERPRET=1`` (the CPU then counts as a
device of the kernel): a check that every shape computes the right rotation, at a small
``--shape``; its times mean nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    describe_device,
    interleaved_seconds,
    write_results,
)

import generated._rotation_kernel as kernel  # noqa: E402
from generated import ENCODINGS  # noqa: E402
from generated._rotation import rotate_by_formula  # noqa: E402

PAIRINGS = {"half": "rope", "interleaved": "rope_gptj"}


class Launch(NamedTuple):
    """One launch shape of the fused rotation (None heads_per_program: the default
    rule, all heads split while SMs would idle)."""

    block_n: int
    block_h: int
    heads_per_program: int | None
    num_warps: int

    def label(self) -> str:
        walked = "auto" if self.heads_per_program is None else str(self.heads_per_program)
        return (
            f"BLOCK_N {self.block_n}, BLOCK_H {self.block_h}, heads/program {walked}, "
            f"warps {self.num_warps}"
        )


def default_launch() -> Launch:
    """The launch shape the runtime uses now."""
    return Launch(
        kernel.FUSED_ROTATION_BLOCK_N,
        kernel.FUSED_ROTATION_BLOCK_H,
        kernel.FUSED_ROTATION_HEADS_PER_PROGRAM,
        kernel.FUSED_ROTATION_NUM_WARPS,
    )


def swept_launches(heads: int) -> list[Launch]:
    """Liger-Kernel's shape (one position per program, every head in one tile) at each
    warp count; then tiles of 1-16 positions and 1-8 heads, one tile per program (no
    loop over heads), and the default rule's walk over every head with small tiles."""
    launches = [Launch(1, heads, heads, warps) for warps in (1, 2, 4, 8)]
    for block_n in (1, 2, 4, 8, 16):
        for block_h in (1, 2, 4, 8):
            if block_h > heads:
                continue
            for warps in (2, 4, 8):
                launches.append(Launch(block_n, block_h, block_h, warps))
    for block_n in (4, 8, 32):
        launches.append(Launch(block_n, 2, None, 4))
    unique = list(dict.fromkeys(launches))
    return [launch for launch in unique if launch != default_launch()]


@contextmanager
def launched_as(launch: Launch) -> Iterator[None]:
    """The runtime's launch constants set to ``launch`` inside the block."""
    names = (
        "FUSED_ROTATION_BLOCK_N",
        "FUSED_ROTATION_BLOCK_H",
        "FUSED_ROTATION_HEADS_PER_PROGRAM",
        "FUSED_ROTATION_NUM_WARPS",
    )
    before = [getattr(kernel, name) for name in names]
    for name, value in zip(names, launch, strict=True):
        setattr(kernel, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, before, strict=True):
            setattr(kernel, name, value)


def kernel_call(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """q and k rotated by the kernel alone (two launches, cos and sin given)."""
    dim = q.shape[-1]

    def rotate_both() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            kernel.launch_rotation(q, cos, sin, dim, half, False),
            kernel.launch_rotation(k, cos, sin, dim, half, False),
        )

    return rotate_both


def disagreement(
    outs: tuple[torch.Tensor, torch.Tensor],
    expected: tuple[torch.Tensor, torch.Tensor],
    formula: tuple[torch.Tensor, torch.Tensor],
) -> str | None:
    """Why a launch shape's outputs are wrong, or None: they must equal the default
    shape's bit for bit and the float32 formula within two of the dtype's ulps."""
    for out, same, exact in zip(outs, expected, formula, strict=True):
        if not torch.equal(out, same):
            return "differs from the default launch shape"
        ulp = torch.finfo(out.dtype).eps * exact.abs().clamp_min(1.0)
        if ((out.float() - exact).abs() > 2 * ulp).any():
            return "differs from the rotation formula"
    return None


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("on the CPU the kernel runs only under TRITON_INTERPRET=1")
        kernel.FUSED_ROTATION_DEVICES.append("cpu")
    batch, heads, length, head_dim = args.shape
    q = torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype)
    k = torch.randn_like(q)

    def copy() -> object:
        return q.clone(), k.clone()

    rows = []
    for pairing in args.pairings:
        pe = ENCODINGS[PAIRINGS[pairing]](heads=heads, head_dim=head_dim).to(device)
        half = pairing == "half"
        cos, sin = pe._cos_sin(None, 0, length, device, torch.float32, None)  # [N, D]
        formula = tuple(rotate_by_formula(x.float(), cos, sin, head_dim, half) for x in (q, k))
        with torch.no_grad():
            expected = kernel_call(q, k, cos, sin, half)()
            candidates = [("module pe.rotate, default launch", partial(pe.rotate, q, k))]
            candidates.append(
                (f"kernel, default: {default_launch().label()}", kernel_call(q, k, cos, sin, half))
            )
            for launch in swept_launches(heads):
                with launched_as(launch):
                    problem = disagreement(kernel_call(q, k, cos, sin, half)(), expected, formula)
                if problem is not None:
                    print(f"{pairing:>12} {launch.label()}: {problem}", flush=True)
                    rows.append({"pairing": pairing, "candidate": launch.label(), "error": problem})
                    continue
                candidates.append(
                    (f"kernel, {launch.label()}", _launched(launch, q, k, cos, sin, half))
                )
            for label, call in candidates:
                seconds, base = interleaved_seconds([call, copy], device, args.repeats)
                rows.append(
                    {
                        "pairing": pairing,
                        "candidate": label,
                        "seconds": seconds,
                        "copy_seconds": base,
                        "ratio": seconds / base,
                    }
                )
                print(f"{pairing:>12} {label:>70} {seconds / base:6.2f}x copy", flush=True)
    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": list(args.shape),
        "rows": rows,
    }


def _launched(
    launch: Launch,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    half: bool,
) -> Callable[[], object]:
    """The kernel alone with the launch constants set to ``launch`` for each call."""
    rotate_both = kernel_call(q, k, cos, sin, half)

    def call() -> object:
        with launched_as(launch):
            return rotate_both()

    return call


def markdown(report: dict) -> str:
    shape = ", ".join(str(size) for size in report["shape"])
    lines = [
        f"# The fused rotation's launch shapes vs a copy ({report['device']}, torch "
        f"{report['torch']}, {report['dtype']}, [{shape}])",
        "",
        "Time to rotate q and k over the time of `q.clone(), k.clone()`, timed alternately "
        'in one run (medians). "module" is `pe.rotate(q, k)` with its host work; '
        '"kernel" is `launch_rotation` on q and k with cos and sin computed once. '
        "Fastest first within each pairing.",
        "",
        "| pairing | candidate | ratio to copy |",
        "|---|---|---|",
    ]
    timed = [row for row in report["rows"] if "ratio" in row]
    for row in sorted(timed, key=lambda row: (row["pairing"], row["ratio"])):
        lines.append(f"| {row['pairing']} | {row['candidate']} | {row['ratio']:.2f} |")
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['pairing']} | {row['candidate']} | wrong: {row['error']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--shape",
        type=lambda text: tuple(int(part) for part in text.split(",")),
        default=(4, 32, 4096, 128),
        help="B,H,N,D of q and of k",
    )
    parser.add_argument(
        "--pairings", nargs="+", choices=sorted(PAIRINGS), default=["half", "interleaved"]
    )
    parser.add_argument("--repeats", type=int, default=30)
    add_out_argument(parser)
    parser.add_argument("--tag", default="", help="appended to the result file names")
    args = parser.parse_args()
    report = run(args)
    stem = f"rotation_launch_{torch.device(args.device).type}_{args.dtype}{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
