"""Relative-position attention layers: posgen against Hugging Face's own, one run.

For BERT's ``relative_key`` / ``relative_key_query`` (``BertSelfAttention``, in
transformers 4.x) and DeBERTa-v2 (``DisentangledSelfAttention`` with c2p and p2c),
times Hugging Face's layer and the same layer built from posgen: Hugging Face's own
q/k/v projections, then the generated module on every backend asked for. Both take the
hidden states [B, N, hidden] and return the attention output before any output
projection, so the ratio compares the position-aware attention alone (the projections
are the same work on both sides). Forward (no autograd) and a training step (backward
into the hidden states and every parameter); candidate and Hugging Face alternate in one
loop, medians reported as posgen time / Hugging Face time, and peak extra memory on CUDA.

    python benchmarks/relative_layers.py --device cuda --dtype bfloat16 --lengths 512 2048
    python benchmarks/relative_layers.py --device cpu --lengths 512
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from attention_backends import (  # noqa: E402
    add_out_argument,
    as_step,
    header_text,
    paired_seconds,
    peak_extra_bytes,
    report_header,
    write_results,
)

from generated import ENCODINGS  # noqa: E402

Layer = Callable[[torch.Tensor], torch.Tensor]


def bert_layers(kind: str, heads: int, head_dim: int) -> tuple[nn.Module, Layer, nn.Module]:
    """(Hugging Face layer, its call, posgen module) for BERT ``relative_key[_query]``."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = BertConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        max_position_embeddings=512,  # the catalogue's max_distance 511
        position_embedding_type=kind,
        attention_probs_dropout_prob=0.0,
    )
    hf = BertSelfAttention(config)
    pe = ENCODINGS[f"bert_{kind}"](heads=heads, head_dim=head_dim)
    with torch.no_grad():
        pe.distance_embedding.weight.copy_(hf.distance_embedding.weight)

    def call(hidden: torch.Tensor) -> torch.Tensor:
        return hf(hidden)[0]

    return hf, call, pe


def deberta_layers(heads: int, head_dim: int) -> tuple[nn.Module, Layer, nn.Module]:
    """(Hugging Face layer + encoder, its call, posgen module) for DeBERTa-v2/v3."""
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import (
        DebertaV2Encoder,
        DisentangledSelfAttention,
    )

    hidden_size = heads * head_dim
    config = DebertaV2Config(
        hidden_size=hidden_size,
        num_attention_heads=heads,
        num_hidden_layers=1,
        intermediate_size=4 * hidden_size,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=256,  # the catalogue's buckets and max_distance
        max_relative_positions=512,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        layer_norm_eps=1e-7,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = DisentangledSelfAttention(config)
    encoder = DebertaV2Encoder(config)
    pe = ENCODINGS["deberta"](heads=heads, head_dim=head_dim, model_dim=hidden_size)
    with torch.no_grad():
        pe.rel_embeddings.weight.copy_(encoder.rel_embeddings.weight)
        pe.rel_norm.load_state_dict(encoder.LayerNorm.state_dict())
        pe.pos_key_proj.load_state_dict(hf.key_proj.state_dict())  # share_att_key
        pe.pos_query_proj.load_state_dict(hf.query_proj.state_dict())
    both = nn.ModuleList([hf, encoder])

    def call(hidden: torch.Tensor) -> torch.Tensor:
        keep = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        mask = encoder.get_attention_mask(keep)
        return hf(hidden, mask, rel_embeddings=encoder.get_rel_embedding())[0]

    return both, call, pe


def posgen_layer(
    projections: tuple[nn.Linear, nn.Linear, nn.Linear], pe: nn.Module, heads: int, backend: str
) -> Layer:
    """Hugging Face's q, k, v projections, then the generated module ("bnhd" layout)."""

    def call(hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = (layer(hidden).unflatten(-1, (heads, -1)) for layer in projections)
        out = pe(q, k, v, backend=backend, layout="bnhd")  # [B, N, H, D]
        return out.flatten(-2)

    return call


def layers(name: str, heads: int, head_dim: int) -> tuple[nn.Module, Layer, nn.Module, tuple]:
    """(Hugging Face modules, its call, posgen module, the q/k/v projections)."""
    if name == "deberta":
        modules, call, pe = deberta_layers(heads, head_dim)
        hf = modules[0]
        return modules, call, pe, (hf.query_proj, hf.key_proj, hf.value_proj)
    kind = name.removeprefix("bert_")
    hf, call, pe = bert_layers(kind, heads, head_dim)
    return hf, call, pe, (hf.query, hf.key, hf.value)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.encodings:
        try:
            modules, hf_call, pe, projections = layers(name, args.heads, args.head_dim)
        except ImportError as error:  # e.g. BERT's relative_key left transformers 5
            print(f"{name}: skipped ({error})", flush=True)
            continue
        modules.to(device, dtype)
        pe.to(device, dtype)
        params = [p for m in (modules, pe) for p in m.parameters() if p.requires_grad]
        for length in args.lengths:
            for mode in args.modes:
                hidden = torch.randn(
                    args.batch,
                    length,
                    args.heads * args.head_dim,
                    device=device,
                    dtype=dtype,
                    requires_grad=mode == "train",
                )
                inputs = [hidden, *params]
                reference = as_step(lambda hidden=hidden, hf=hf_call: hf(hidden), inputs, mode)
                reference_memory = peak_extra_bytes(reference, device)
                for backend in args.backends:
                    ours = posgen_layer(projections, pe, args.heads, backend)
                    step = as_step(lambda hidden=hidden, ours=ours: ours(hidden), inputs, mode)
                    seconds, hf_seconds = paired_seconds(step, reference, device, args.repeats)
                    memory = peak_extra_bytes(step, device)
                    rows.append(
                        {
                            "encoding": name,
                            "backend": backend,
                            "length": length,
                            "mode": mode,
                            "seconds": seconds,
                            "hf_seconds": hf_seconds,
                            "ratio_to_hf": seconds / hf_seconds,
                            "peak_extra_bytes": memory,
                            "hf_peak_extra_bytes": reference_memory,
                        }
                    )
                    print(
                        f"{name:>24} {backend:>5} N={length:<5} {mode:>7} "
                        f"{seconds * 1e3:9.2f} ms vs HF {hf_seconds * 1e3:9.2f} ms "
                        f"({seconds / hf_seconds:5.2f}x)",
                        flush=True,
                    )
    return {**report_header(args, device), "rows": rows}


def markdown(report: dict) -> str:
    lines = [
        f"# Relative-position layers vs Hugging Face ({header_text(report)})",
        "",
        "posgen layer = Hugging Face's own q/k/v projections + the generated module; "
        "ratio = its median time / the Hugging Face layer's, timed alternately in one "
        "loop (below 1: posgen is faster). `train`: forward and backward into the "
        "hidden states and every parameter. Memory: peak beyond the inputs (CUDA: the "
        "allocator's peak; CPU: the profiler's allocation records, where the table has them).",
        "",
        "| encoding | backend | N | mode | posgen ms | HF ms | ratio | posgen MiB | HF MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        ours, theirs = row["peak_extra_bytes"], row["hf_peak_extra_bytes"]
        lines.append(
            f"| {row['encoding']} | {row['backend']} | {row['length']} | {row['mode']} | "
            f"{row['seconds'] * 1e3:.2f} | {row['hf_seconds'] * 1e3:.2f} | "
            f"{row['ratio_to_hf']:.2f} | "
            f"{'n/a' if ours is None else f'{ours / 2**20:.0f}'} | "
            f"{'n/a' if theirs is None else f'{theirs / 2**20:.0f}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--encodings",
        nargs="+",
        default=["bert_relative_key", "bert_relative_key_query", "deberta"],
    )
    parser.add_argument("--backends", nargs="+", default=["sdpa", "flex"])
    parser.add_argument("--modes", nargs="+", choices=["forward", "train"], default=["forward"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="", help="appended to the result file names")
    add_out_argument(parser)
    args = parser.parse_args()
    report = run(args)
    stem = f"relative_layers_{args.device.split(':')[0]}_{args.dtype}{args.tag}"
    write_results(args.out, stem, report, markdown(report))


if __name__ == "__main__":
    main()
