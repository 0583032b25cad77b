"""Every generated module compiled whole by inductor, on every backend, at every kind of
position: does it compile, and does it give eager mode's outputs?

The CPU test suite traces every module with TorchDynamo alone (``backend="eager"``),
which catches graph breaks and host syncs but not inductor's own limits, and compiles
only a few cases with inductor (each takes seconds). This sweep compiles them all:
``torch.compile(module, fullgraph=True)`` with inductor, called causal with grouped-query
heads (4 query heads over 2), a batch of 2, 5 queries against 7 keys (16 and 24 on
CUDA), at default positions, explicit ones shared by the batch, and one row of
positions per batch row; q, k and v in float32 or ``--dtype`` (the module's parameters
stay float32). Without ``--grad`` it runs a forward without autograd; with it, a
training step: the loss sum(out²) differentiated into q, k, v and every parameter,
forward and backward compiled. The output (and each gradient) is compared with the
module's ``backend="eager"`` result, the oracle: the largest difference, absolute where
the oracle's entries stay within 1, else relative to its largest, must be at most 1e-4
in float32 and 2^-6 in bfloat16 (two roundings of bfloat16). A cell reads "ok" with
that difference and the seconds the first call took (compilation included), or the
error's type. The flex backend is left out for a value-side term (it refuses them).
Nothing is timed for speed here.

    python benchmarks/compile_sweep.py --out benchmarks/results
    python benchmarks/compile_sweep.py --grad --out benchmarks/results
    python benchmarks/compile_sweep.py --device cuda --names alibi t5 --backends flex
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
__import__("sys").path.insert(0, str(ROOT))
__import__("sys").path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import add_out_argument, describe_device, write_results  # noqa: E402

import generated  # noqa: E402
from tests.conftest import head_dim_for  # noqa: E402 - a spec's own head_dim where it needs one

POSITION_KINDS = ("default", "explicit", "batched")

WHAT_IS_COMPARED = {
    False: 'no autograd; each cell: the largest difference from `backend="eager"`',
    True: "forward and backward of sum(out²) into q, k, v and the parameters; each cell: "
    'the largest difference from `backend="eager"` over the output and the gradients',
}


def encoding_classes() -> dict[str, type[torch.nn.Module]]:
    """Every generated encoding by its spec name, sorted."""
    registry: dict[str, type[torch.nn.Module]] = generated.ENCODINGS
    return dict(sorted(registry.items()))


def positions(kind: str, n: int, m: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The call's position arguments: none, the defaults written out plus 3, or a row per
    batch row, the second 5 steps on."""
    if kind == "default":
        return {}
    q_positions = torch.arange(m - n, m, device=device) + 3  # [N]
    k_positions = torch.arange(m, device=device) + 3  # [M]
    if kind == "explicit":
        return {"q_positions": q_positions, "k_positions": k_positions}
    shift = torch.tensor([[0], [5]], device=device)  # [2, 1]
    return {"q_positions": q_positions + shift, "k_positions": k_positions + shift}


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0**-6}


def sweep_one(
    name: str,
    backend: str,
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    grad: bool,
) -> dict[str, Any]:
    """One module, backend and kind of position: compiled, called, compared (with
    ``grad``, the outputs and the gradients of a training step)."""
    d = head_dim_for(name, 16)
    n, m = (16, 24) if device.type == "cuda" else (5, 7)
    pe = encoding_classes()[name](heads=4, head_dim=d).to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 4, n, d, generator=generator, device=device).to(dtype)
    k, v = (torch.randn(2, 2, m, d, generator=generator, device=device).to(dtype) for _ in "kv")
    options = positions(kind, n, m, device)
    leaves = [q, k, v, *(p for p in pe.parameters() if p.requires_grad)] if grad else []
    torch._dynamo.reset()
    compiled = torch.compile(pe, fullgraph=True)

    def step(module: Any, chosen: str) -> list[torch.Tensor]:
        inputs = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        out = module(*inputs, causal=True, backend=chosen, **options)
        if not grad:
            return [out]
        wrt = [*inputs, *leaves[3:]]
        return [out, *torch.autograd.grad(out.square().sum(), wrt, allow_unused=True)]

    start = time.perf_counter()
    try:
        with torch.set_grad_enabled(grad):
            got = step(compiled, backend)
            seconds = time.perf_counter() - start
            want = step(pe, "eager")
    except Exception as error:  # noqa: BLE001 - the sweep records every failure
        first_line = (str(error).strip().splitlines() or [""])[0]
        return {"ok": False, "error": type(error).__name__, "message": first_line[:300]}
    difference = 0.0
    for got_tensor, want_tensor in zip(got, want, strict=True):
        if got_tensor is None or want_tensor is None:
            if got_tensor is not want_tensor:  # a gradient on one side only
                return {"ok": False, "error": "MissingGradient", "message": "one side's None"}
            continue
        scale = max(1.0, want_tensor.abs().max().item())
        gap = (got_tensor.float() - want_tensor.float()).abs().max().item()
        difference = max(difference, gap / scale)
    return {"ok": difference <= TOLERANCE[dtype], "max_abs_diff": difference, "seconds": seconds}


def cell(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"**{result['error']}**"
    verdict = "ok" if result["ok"] else "**differs**"
    return f"{verdict} {result['max_abs_diff']:.0e} ({result['seconds']:.1f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--backends", nargs="+", default=["sdpa", "flex"])
    parser.add_argument("--names", nargs="+", default=None, help="spec names (default: all)")
    parser.add_argument("--grad", action="store_true", help="a training step, not a forward")
    add_out_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    classes = encoding_classes()
    names = args.names or list(classes)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        cls = classes[name]
        for backend in args.backends:
            if backend == "flex" and cls.has_value_term:
                continue
            for kind in POSITION_KINDS:
                result = sweep_one(name, backend, kind, device, dtype, args.grad)
                results[f"{name}/{backend}/{kind}"] = result
                print(name, backend, kind, cell(result), result.get("message", ""), flush=True)
    columns = [(b, kind) for b in args.backends for kind in POSITION_KINDS]
    lines = [
        f"# Inductor compiles every module{' (training step)' if args.grad else ''}"
        f" ({describe_device(device)}, torch {torch.__version__})",
        "",
        "`torch.compile(module, fullgraph=True)` with inductor, causal, 4 query heads over 2,",
        f"batch 2, q, k, v in {args.dtype}, {WHAT_IS_COMPARED[args.grad]} (relative to",
        "each one's largest entry where that exceeds 1), and the seconds of the first call",
        "(compilation included), or the error raised.",
        "",
        "| encoding | " + " | ".join(f"{b}, {kind}" for b, kind in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for name in names:
        cells = [
            cell(results[key]) if (key := f"{name}/{b}/{kind}") in results else "—"
            for b, kind in columns
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    failed = [key for key, result in results.items() if not result["ok"]]
    lines += ["", f"{len(results) - len(failed)} of {len(results)} compiled and agreed."]
    for key in failed:
        lines.append(f"- {key}: {results[key].get('message', 'differs from eager mode')}")
    report = {"device": describe_device(device), "torch": torch.__version__, "results": results}
    stem = f"compile_sweep_{device.type}_{args.dtype}{'_grad' if args.grad else ''}"
    write_results(args.out, stem, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
