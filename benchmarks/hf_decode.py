"""A Hugging Face model's decode steps with its own attention and with posgen's.

A small ``LlamaForCausalLM`` (random weights, ``attn_implementation="sdpa"``), or with
``--family bloom`` a ``BloomForCausalLM`` (its own ALiBi attention), generates greedily
from a prompt into a ``DynamicCache``; the same model with every attention layer routed
through posgen's ``Rope`` (or ``Alibi``; ``posgen.hf.use_posgen_attention``) does the
same, and, with ``--before REV``, a third copy through that class as generated at that
git revision (``revisions.generated_at``). ``--left-padding P`` pads batch row 0's
prompt with P tokens on the left (an attention mask of 0 there, grown by 1 each step),
as generation over a batch of unequal prompts does. ``--cache static`` decodes into a
``StaticCache`` of prompt + steps slots instead, with the 2-D mask as long as the cache
(so every step has the same shapes), and ``--compile`` then times ``model.forward``
under ``torch.compile(fullgraph=True)`` (``--compile-mode reduce-overhead`` replays each
step as a CUDA graph): Hugging Face's recipe for fast decoding, with each model's
compilation done in an untimed run first. ``--device`` and ``--dtype`` pick where and
in what the models run. The models take turns in every
repeat, each timing a run of ``--steps`` decode steps after its prompt; the table gives
the median milliseconds per step and the ratio to Hugging Face's own attention (its
rotary embedding and SDPA call, or BLOOM's ALiBi attention), the baseline. The whole
model runs, so the ratio also carries the projections, the MLPs and the cache: it says
what a user of the adapter pays per generated token.

    python benchmarks/hf_decode.py --prompts 64 512 --out benchmarks/results
    python benchmarks/hf_decode.py --before 1f2d277 --layers 4
    python benchmarks/hf_decode.py --family bloom --left-padding 40 --before HEAD~2
    python benchmarks/hf_decode.py --cache static --compile --out benchmarks/results
    python benchmarks/hf_decode.py --device cuda --dtype bfloat16 --cache static \
        --compile --compile-mode reduce-overhead --prompts 512 4096
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import add_out_argument, describe_device, write_results  # noqa: E402
from revisions import generated_at  # noqa: E402

from generated import Alibi, Rope  # noqa: E402
from posgen.hf import use_posgen_attention  # noqa: E402


def llama(args: argparse.Namespace) -> torch.nn.Module:
    """A small Llama with random weights and SDPA attention, in eval mode, on the CPU
    in float32 (``run`` moves it)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=args.heads * args.head_dim,
        intermediate_size=2 * args.heads * args.head_dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).eval()


def bloom(args: argparse.Namespace) -> torch.nn.Module:
    """A small BLOOM with random weights (its own ALiBi attention), in eval mode."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BloomConfig(
        vocab_size=256,
        hidden_size=args.heads * args.head_dim,
        n_layer=args.layers,
        n_head=args.heads,
        attn_implementation="eager",
    )
    return transformers.BloomForCausalLM(config).eval()


def prompt_mask(args: argparse.Namespace, length: int) -> torch.Tensor:
    """The prompts' attention mask [B, L]: batch row 0 padded by ``--left-padding``."""
    mask = torch.ones(args.batch, length, dtype=torch.int64)
    mask[0, : args.left_padding] = 0
    return mask


def decode_ms(
    model: torch.nn.Module,
    prompt: Tensor,
    mask: Tensor,
    args: argparse.Namespace,
    step: Any = None,
) -> float:
    """Milliseconds per greedy decode step after ``prompt`` [B, L] with its attention
    ``mask`` [B, L], into a fresh cache (``--cache``); each step calls ``step`` (default
    the model itself; a compiled ``model.forward``)."""
    import transformers

    step = model if step is None else step
    batch, length = prompt.shape
    static = args.cache == "static"
    if static:
        slots = length + args.steps
        cache: Any = transformers.StaticCache(
            config=model.config,
            max_batch_size=batch,
            max_cache_len=slots,
            device=prompt.device,
            dtype=model.dtype,
        )
        ones = torch.ones(batch, args.steps, dtype=mask.dtype, device=mask.device)
        full_mask = torch.cat((mask, ones), dim=1)  # [B, slots]: one shape for every step
    else:
        cache = transformers.DynamicCache()
        ones = torch.ones(batch, 1, dtype=mask.dtype, device=mask.device)
    with torch.no_grad():
        logits = model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        synchronize(prompt.device)
        start = time.perf_counter()
        for index in range(args.steps):
            keywords: dict[str, Any] = {"past_key_values": cache, "use_cache": True}
            if static:
                position = torch.full((1,), length + index, device=prompt.device)
                keywords.update(attention_mask=full_mask, cache_position=position)
            else:
                mask = torch.cat((mask, ones), dim=1)
                keywords.update(attention_mask=mask)
            token = step(token, **keywords).logits[:, -1:].argmax(-1)
        synchronize(prompt.device)
        return (time.perf_counter() - start) / args.steps * 1e3


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that host clocks time it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: logits of the models through posgen against Hugging Face's own, per dtype
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    reference = llama(args) if args.family == "llama" else bloom(args)
    reference = reference.to(device=device, dtype=dtype)
    encoding, name_of = (Rope, "rope") if args.family == "llama" else (Alibi, "alibi")
    models: dict[str, torch.nn.Module] = {"Hugging Face": reference}

    def through(cls: type[torch.nn.Module]) -> torch.nn.Module:
        return use_posgen_attention(
            copy.deepcopy(reference),
            lambda _: cls(heads=args.heads, head_dim=args.head_dim).to(device),
        )

    with tempfile.TemporaryDirectory() as folder:
        if args.before:
            models[f"posgen {args.before}"] = through(
                generated_at(args.before, Path(folder))[name_of]
            )
        models["posgen"] = through(encoding)
        rows = []
        for length in args.prompts:
            prompt = torch.randint(
                0, 256, (args.batch, length), generator=torch.Generator().manual_seed(1)
            ).to(device)
            mask = prompt_mask(args, length).to(device)
            tolerance = TOLERANCE[dtype]
            with torch.no_grad():  # the same model: the same next tokens
                want = reference(prompt, attention_mask=mask).logits[:, -1]
                for model in models.values():
                    got = model(prompt, attention_mask=mask).logits[:, -1]
                    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
            steps: dict[str, Any] = {name: None for name in models}  # None: the model
            if args.compile:
                for name, model in models.items():
                    steps[name] = torch.compile(
                        model.forward, fullgraph=True, dynamic=False, mode=args.compile_mode
                    )
                    decode_ms(model, prompt, mask, args, steps[name])  # compiles, untimed
            times: dict[str, list[float]] = {name: [] for name in models}
            names = list(models)
            for repeat in range(args.repeats):
                for turn in range(len(names)):
                    name = names[(repeat + turn) % len(names)]
                    times[name].append(decode_ms(models[name], prompt, mask, args, steps[name]))
            base = statistics.median(times["Hugging Face"])
            for name in names:
                ms = statistics.median(times[name])
                rows.append({"model": name, "prompt": length, "ms": ms, "ratio": ms / base})
                print(
                    f"{name:>24} prompt={length:>5} {ms:.3f} ms/step {ms / base:.2f}x", flush=True
                )
    return {
        "device": describe_device(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "config": {
            key: getattr(args, key)
            for key in (
                "family",
                "layers",
                "heads",
                "kv_heads",
                "head_dim",
                "batch",
                "left_padding",
                "cache",
                "compile",
                "compile_mode",
                "steps",
                "repeats",
            )
        },
        "rows": rows,
    }


def markdown(report: dict) -> str:
    config: dict[str, Any] = report["config"]
    bloom = config.get("family") == "bloom"
    model, encoding = ("BLOOM", "Alibi") if bloom else ("Llama", "Rope")
    heads = (
        f"{config['heads']} heads"
        if bloom
        else f"{config['heads']} heads ({config['kv_heads']} key-value heads)"
    )
    padding = (
        f", batch row 0's prompt padded by {config['left_padding']} tokens on the left"
        if config.get("left_padding")
        else ""
    )
    lines = [
        f"# A {model}'s decode steps, Hugging Face's attention against posgen's "
        f"({report['device']}, torch {report['torch']}, transformers "
        f"{report['transformers']}, {report.get('dtype', 'float32')})",
        "",
        f"`{model}ForCausalLM` with {config['layers']} layers, {heads} of "
        f"{config['head_dim']}, random weights, batch {config['batch']}{padding}: greedy "
        f"decode steps after the prompt into a {cache_words(config)}, {config['steps']} "
        f"steps a run, the models taking turns, median of {config['repeats']} runs. "
        f"posgen: every attention layer through `{encoding}` "
        "(`posgen.hf.use_posgen_attention`). Ratio: time over Hugging Face's own attention.",
        "",
        "| model | prompt | ms per step | ratio |",
        "|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['model']} | {row['prompt']} | {row['ms']:.3f} | {row['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def cache_words(config: dict[str, Any]) -> str:
    """How the table's steps ran: the cache and, where compiled, how."""
    if config.get("cache", "dynamic") == "dynamic":
        return "`DynamicCache`"
    words = "`StaticCache` of prompt + steps slots (the 2-D mask as long)"
    if config.get("compile"):
        mode = config.get("compile_mode")
        words += (
            ", each step through `torch.compile(model.forward, fullgraph=True"
            + (f", mode={mode!r}" if mode else "")
            + ")`, compiled in an untimed run first"
        )
    return words


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before", default=None, help="also time Rope as generated at this git revision"
    )
    parser.add_argument("--family", choices=("llama", "bloom"), default="llama")
    parser.add_argument(
        "--left-padding", type=int, default=0, help="pad batch row 0's prompt by P tokens"
    )
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument(
        "--compile", action="store_true", help="steps through a compiled model.forward"
    )
    parser.add_argument(
        "--compile-mode", default=None, help="torch.compile's mode (reduce-overhead: CUDA graphs)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tag", default="", help="appended to the result file name")
    add_out_argument(parser)
    args = parser.parse_args()
    if args.compile and args.cache != "static":
        parser.error("--compile needs --cache static (a dynamic cache changes shape every step)")
    report = run(args)
    family = "" if args.family == "llama" else f"_{args.family}"
    stem = f"hf_decode{family}_{args.device}_{args.dtype}{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
