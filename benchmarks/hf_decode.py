"""A Hugging Face model's decode steps with its own attention and with posgen's.

A small ``LlamaForCausalLM`` (random weights, ``attn_implementation="sdpa"``), or with
``--family bloom`` a ``BloomForCausalLM`` (its own ALiBi attention), generates greedily
from a prompt into a ``DynamicCache``; the same model with every attention layer routed
through posgen's ``Rope`` (or ``Alibi``; ``posgen.hf.use_posgen_attention``) does the
same, and, with ``--before REV``, a third copy through that class as generated at that
git revision (``revisions.generated_at``). ``--left-padding P`` pads batch row 0's
prompt with P tokens on the left (an attention mask of 0 there, grown by 1 each step),
as generation over a batch of unequal prompts does. The models take turns in every
repeat, each timing a run of ``--steps`` decode steps after its prompt; the table gives
the median milliseconds per step and the ratio to Hugging Face's own attention (its
rotary embedding and SDPA call, or BLOOM's ALiBi attention), the baseline. The whole
model runs, so the ratio also carries the projections, the MLPs and the cache: it says
what a user of the adapter pays per generated token.

    python benchmarks/hf_decode.py --prompts 64 512 --out benchmarks/results
    python benchmarks/hf_decode.py --before 1f2d277 --layers 4
    python benchmarks/hf_decode.py --family bloom --left-padding 40 --before HEAD~2
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import add_out_argument, describe_device, write_results  # noqa: E402
from revisions import generated_at  # noqa: E402

from generated import Alibi, Rope  # noqa: E402
from posgen.hf import use_posgen_attention  # noqa: E402


def llama(args: argparse.Namespace) -> torch.nn.Module:
    """A small Llama with random weights and SDPA attention, in eval mode."""
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
    model: torch.nn.Module, prompt: torch.Tensor, mask: torch.Tensor, steps: int
) -> float:
    """Milliseconds per greedy decode step after ``prompt`` [B, L] with its attention
    ``mask`` [B, L], into a fresh cache."""
    import transformers

    cache = transformers.DynamicCache()
    ones = torch.ones(mask.shape[0], 1, dtype=mask.dtype)
    with torch.no_grad():
        logits = model(prompt, attention_mask=mask, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat((mask, ones), dim=1)
            logits = model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / steps * 1e3


def run(args: argparse.Namespace) -> dict:
    reference = llama(args) if args.family == "llama" else bloom(args)
    encoding, name_of = (Rope, "rope") if args.family == "llama" else (Alibi, "alibi")
    models: dict[str, torch.nn.Module] = {"Hugging Face": reference}

    def through(cls: type[torch.nn.Module]) -> torch.nn.Module:
        return use_posgen_attention(
            copy.deepcopy(reference), lambda _: cls(heads=args.heads, head_dim=args.head_dim)
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
            )
            mask = prompt_mask(args, length)
            with torch.no_grad():  # the same model: the same next tokens
                want = reference(prompt, attention_mask=mask).logits[:, -1]
                for model in models.values():
                    got = model(prompt, attention_mask=mask).logits[:, -1]
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            times: dict[str, list[float]] = {name: [] for name in models}
            names = list(models)
            for repeat in range(args.repeats):
                for turn in range(len(names)):
                    name = names[(repeat + turn) % len(names)]
                    times[name].append(decode_ms(models[name], prompt, mask, args.steps))
            base = statistics.median(times["Hugging Face"])
            for name in names:
                ms = statistics.median(times[name])
                rows.append({"model": name, "prompt": length, "ms": ms, "ratio": ms / base})
                print(
                    f"{name:>24} prompt={length:>5} {ms:.3f} ms/step {ms / base:.2f}x", flush=True
                )
    return {
        "device": describe_device(torch.device("cpu")),
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
        f"{report['transformers']}, float32)",
        "",
        f"`{model}ForCausalLM` with {config['layers']} layers, {heads} of "
        f"{config['head_dim']}, random weights, batch {config['batch']}{padding}: greedy "
        f"decode steps after the prompt into a `DynamicCache`, {config['steps']} steps a "
        f"run, the models taking turns, median of {config['repeats']} runs. posgen: every "
        f"attention layer through `{encoding}` (`posgen.hf.use_posgen_attention`). Ratio: "
        "time over Hugging Face's own attention.",
        "",
        "| model | prompt | ms per step | ratio |",
        "|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['model']} | {row['prompt']} | {row['ms']:.3f} | {row['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--tag", default="", help="appended to the result file name")
    add_out_argument(parser)
    args = parser.parse_args()
    report = run(args)
    family = "" if args.family == "llama" else f"_{args.family}"
    write_results(args.out, f"hf_decode{family}_cpu_float32{args.tag}", report, markdown(report))


if __name__ == "__main__":
    main()
