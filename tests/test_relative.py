"""Relative position terms read from a table (Shaw et al., BERT relative_key, DeBERTa,
Transformer-XL): parity with independent float64 references and with the Hugging Face
modules whose weights the generated parameters load.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec
from tests.conftest import SPECS, generated_class, spec_variant
from tests.reference import formulas, relative

F64 = torch.float64


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, heads * d] -> [B, heads, L, d]."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, d] -> [B, L, heads * d]."""
    return x.transpose(1, 2).flatten(-2)


# --------------------------------------------------------------------------- references


def test_clipped_relative_logits_by_hand() -> None:
    # one feature: q = 1, k = 0, table rows [10, 20, 30] for d = -1, 0, 1 (clip 1)
    q = torch.tensor([[1.0], [1.0], [1.0]])
    k = torch.zeros(3, 1)
    table = torch.tensor([[10.0], [20.0], [30.0]])
    pos = torch.arange(3)
    out = relative.clipped_relative_logits(q, k, table, pos, pos, clip=1, scale=1.0)
    # d_ij = clip(i - j): row 0 -> [0, -1, -1], row 2 -> [1, 1, 0]
    expected = [[20.0, 10.0, 10.0], [30.0, 20.0, 10.0], [30.0, 30.0, 20.0]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64))
    k = torch.tensor([[2.0], [0.0], [0.0]])
    out = relative.clipped_relative_logits(q, k, table, pos, pos, clip=1, key_side=True, scale=0.5)
    # (q.k + q.r + k.r) / 2 at (0, 0): (2 + 20 + 40) / 2
    assert out[0, 0].item() == pytest.approx(31.0)
    assert out[1, 0].item() == pytest.approx((2 + 30 + 60) / 2)


def test_disentangled_logits_by_hand() -> None:
    # span 4 (bucket_size 4, mid 2): distances up to 2 are exact
    q = torch.tensor([[1.0], [0.0]])
    k = torch.tensor([[0.0], [1.0]])
    pos_key = torch.arange(8.0).unsqueeze(-1)  # row r holds r
    pos_query = 100 + torch.arange(8.0).unsqueeze(-1)
    pos = torch.arange(2)
    out = relative.disentangled_logits(q, k, pos_key, pos_query, pos, pos, 4, 8) * math.sqrt(3)
    # (0, 0): c2p = 1 * pos_key[0 + 4] = 4; p2c = k_0 . ... = 0
    # (0, 1): q.k = 1; c2p = pos_key[-1 + 4] = 3; p2c = 1 * pos_query[-(1) + 4] = 103
    # (1, 1): p2c = pos_query[0 + 4] = 104; (1, 0): 0
    expected = torch.tensor([[4.0, 1 + 3 + 103], [0.0, 104.0]], dtype=F64)
    torch.testing.assert_close(out, expected)


# --------------------------------------------------------------------------- Shaw et al.


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_shaw_matches_the_paper_formula(causal: bool, backend: str) -> None:
    """Key and value terms, clipped at k = 16, on 24 tokens (so the clip is reached)."""
    pe = generated_class("shaw")(heads=2, head_dim=4).double()
    n = 24
    q, k, v = (torch.randn(2, 2, n, 4, dtype=F64) for _ in range(3))
    rel_k, rel_v = torch.randn(33, 4, dtype=F64), torch.randn(33, 4, dtype=F64)
    with torch.no_grad():
        pe.distance_embedding.weight.copy_(rel_k)
        pe.value_embedding.weight.copy_(rel_v)
    expected = formulas.shaw_relative_attention(q, k, v, rel_k, rel_v, clip=16, causal=causal)
    out = pe(q, k, v, causal=causal, backend=backend)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def test_shaw_per_head_tables() -> None:
    cls = spec_variant(
        "shaw",
        ("heads: shared, init_std", "heads: per_head, init_std"),
        ("key_minus_query, heads: shared}", "key_minus_query, heads: per_head}"),
        ("max_distance: 16", "max_distance: 3"),
        name="shaw_per_head",
    )
    pe = cls(heads=3, head_dim=4, value_dim=5).double()
    assert pe.distance_embedding.weight.shape == (7, 12)
    assert pe.value_embedding.weight.shape == (7, 15)
    q, k = (torch.randn(2, 3, 9, 4, dtype=F64) for _ in range(2))
    v = torch.randn(2, 3, 9, 5, dtype=F64)
    out = pe(q, k, v, backend="sdpa")
    table_k = pe.distance_embedding.weight.detach().view(7, 3, 4)
    table_v = pe.value_embedding.weight.detach().view(7, 3, 5)
    for h in range(3):
        expected = formulas.shaw_relative_attention(
            q[:, h], k[:, h], v[:, h], table_k[:, h], table_v[:, h], clip=3
        )
        torch.testing.assert_close(out[:, h], expected, atol=1e-10, rtol=1e-10)


def test_shaw_value_term_with_explicit_positions() -> None:
    """Packed positions: each batch row matches the reference on its own positions."""
    pe = generated_class("shaw")(heads=2, head_dim=4).double()
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=F64) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]])
    out = pe(q, k, v, q_positions=positions, k_positions=positions, backend="eager")
    rel_k = pe.distance_embedding.weight.detach()
    rel_v = pe.value_embedding.weight.detach()
    expected = formulas.shaw_relative_attention(q[:1], k[:1], v[:1], rel_k, rel_v, clip=16)
    torch.testing.assert_close(out[:1], expected)
    # the second row holds two documents with restarted positions: mask across them
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    same = (doc[:, None] == doc[None, :]).expand(2, 1, 6, 6)
    masked = pe(q, k, v, q_positions=positions, k_positions=positions, attn_mask=same)
    for start in (0, 3):
        part = slice(start, start + 3)
        expected = formulas.shaw_relative_attention(
            q[1:, :, part], k[1:, :, part], v[1:, :, part], rel_k, rel_v, clip=16
        )
        torch.testing.assert_close(masked[1:, :, part], expected)


def test_shaw_rejects_a_value_width_mismatch() -> None:
    pe = generated_class("shaw")(heads=2, head_dim=4)
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="value_dim"):
        pe(q, k, torch.randn(1, 2, 3, 6))
    with pytest.raises(ValueError, match="value_dim"):
        generated_class("shaw")(value_dim=0)


# --------------------------------------------------------------------------- BERT relative_key


@pytest.mark.parametrize("name", ["bert_relative_key", "bert_relative_key_query"])
def test_bert_relative_matches_the_float64_reference(name: str) -> None:
    pe = generated_class(name)(heads=2, head_dim=4).double()
    q = torch.randn(2, 2, 5, 4, dtype=F64)
    k = torch.randn(2, 2, 9, 4, dtype=F64)
    table = pe.distance_embedding.weight.detach()
    q_pos, k_pos = torch.arange(4, 9), torch.arange(9)
    expected = relative.clipped_relative_logits(
        q, k, table, q_pos, k_pos, clip=511, key_side=name.endswith("query")
    )
    torch.testing.assert_close(pe.scores(q, k), expected)


@pytest.mark.parametrize("kind", ["relative_key", "relative_key_query"])
def test_bert_relative_loads_hugging_face_weights(kind: str) -> None:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertSelfAttention

    config = BertConfig(
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=16,
        position_embedding_type=kind,
        attention_probs_dropout_prob=0.0,
    )
    hf = BertSelfAttention(config).double().eval()
    name = f"bert_{kind}"
    cls = spec_variant(name, ("max_distance: 511", "max_distance: 15"), name=f"{name}_16")
    pe = cls(heads=4, head_dim=8).double()
    with torch.no_grad():
        pe.distance_embedding.weight.copy_(hf.distance_embedding.weight)
    hidden = torch.randn(2, 10, 32, dtype=F64)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, 7:] = False  # padding in the second sequence
    additive = torch.zeros(2, 1, 1, 10, dtype=F64).masked_fill(~keep[:, None, None], -1e9)
    with torch.no_grad():
        expected, _ = hf(hidden, attention_mask=additive)
        q, k, v = (split_heads(layer(hidden), 4) for layer in (hf.query, hf.key, hf.value))
        for backend in ("eager", "sdpa"):
            out = pe(q, k, v, attn_mask=keep[:, None, None], backend=backend)
            torch.testing.assert_close(merge_heads(out), expected, atol=1e-10, rtol=1e-10)


# --------------------------------------------------------------------------- DeBERTa


def _small_deberta():
    small = ("buckets: 256, max_distance: 512", "buckets: 8, max_distance: 32")
    return spec_variant("deberta", small, name="deberta_small")


def test_deberta_bucket_rows_match_the_reference() -> None:
    module = __import__("generated.deberta", fromlist=["_relative_index"])
    rel = torch.arange(-1200, 1201)
    rows = module._relative_index(rel)
    expected = [
        min(max(formulas.deberta_log_bucket_position(r, 256, 512) + 256, 0), 511)
        for r in rel.tolist()
    ]
    assert rows.tolist() == expected


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_deberta_matches_the_float64_reference(backend: str) -> None:
    pe = _small_deberta()(heads=2, head_dim=4, model_dim=8).double()
    n = 40  # beyond max_distance 32, so the clamped edge rows are read
    q, k, v = (torch.randn(2, 2, n, 4, dtype=F64) for _ in range(3))
    with torch.no_grad():
        pe.rel_norm.weight.normal_()
        pe.rel_norm.bias.normal_()
        table = torch.nn.functional.layer_norm(
            pe.rel_embeddings.weight, (8,), pe.rel_norm.weight, pe.rel_norm.bias, 1e-7
        )
        pos_key = pe.pos_key_proj(table).view(16, 2, 4).transpose(0, 1)  # [H, rows, d]
        pos_query = pe.pos_query_proj(table).view(16, 2, 4).transpose(0, 1)
    pos = torch.arange(n)
    expected = relative.disentangled_logits(q, k, pos_key, pos_query, pos, pos, 8, 32)
    torch.testing.assert_close(pe.scores(q, k), expected)
    out = pe(q, k, v, backend=backend)
    torch.testing.assert_close(out, torch.softmax(expected, dim=-1) @ v)


def test_deberta_loads_hugging_face_weights() -> None:
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import (
        DebertaV2Encoder,
        DisentangledSelfAttention,
    )

    config = DebertaV2Config(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=16,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=32,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        layer_norm_eps=1e-7,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = DisentangledSelfAttention(config).double().eval()
    encoder = DebertaV2Encoder(config).double().eval()
    with torch.no_grad():
        encoder.LayerNorm.weight.normal_()
        encoder.LayerNorm.bias.normal_()
    pe = _small_deberta()(heads=4, head_dim=8, model_dim=32).double()
    with torch.no_grad():
        pe.rel_embeddings.weight.copy_(encoder.rel_embeddings.weight)
        pe.rel_norm.load_state_dict(encoder.LayerNorm.state_dict())
        pe.pos_key_proj.load_state_dict(hf.key_proj.state_dict())  # share_att_key
        pe.pos_query_proj.load_state_dict(hf.query_proj.state_dict())
    n = 40
    hidden = torch.randn(2, n, 32, dtype=F64)
    keep = torch.ones(2, n, dtype=torch.bool)
    keep[1, 30:] = False
    with torch.no_grad():
        mask = encoder.get_attention_mask(keep.long())
        expected, _ = hf(hidden, mask, rel_embeddings=encoder.get_rel_embedding())
        q, k, v = (
            split_heads(layer(hidden), 4) for layer in (hf.query_proj, hf.key_proj, hf.value_proj)
        )
        for backend in ("eager", "sdpa"):
            out = merge_heads(pe(q, k, v, attn_mask=keep[:, None, None], backend=backend))
            # Hugging Face masks padded query rows too; compare the rows it keeps. Its
            # sqrt(3 d) is a float32 tensor even in a float64 model (relative error ~1e-8)
            torch.testing.assert_close(out[keep], expected[keep], atol=1e-7, rtol=1e-6)


def test_absolute_input_adds_to_the_relative_terms() -> None:
    """With an input table the relative terms stay; the absolute part enters via embed."""
    both = generated_class("deberta_absolute_input")(heads=2, head_dim=4, model_dim=8)
    plain = generated_class("deberta")(heads=2, head_dim=4, model_dim=8)
    plain.load_state_dict(
        {k: v for k, v in both.state_dict().items() if not k.startswith("position_embeddings")}
    )
    q, k = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    torch.testing.assert_close(both.scores(q, k), plain.scores(q, k))
    x = torch.randn(1, 6, 8)
    torch.testing.assert_close(both.embed(x), x + both.position_embeddings.weight[:6])
    with pytest.raises(ValueError, match="cannot extrapolate"):
        both.embed(torch.randn(1, 513, 8))


def test_absolute_input_rule(tmp_path: Path) -> None:
    """Relative and global forms may sit beside an input table; drop and bias may not."""
    from posgen.spec.diagnostics import SpecError
    from posgen.spec.loader import load_spec

    text = (SPECS / "deberta_absolute_input.yaml").read_text(encoding="utf-8")
    path = tmp_path / "deberta_absolute_input.yaml"
    path.write_text(text.replace("position_position: absolute", "position_position: drop"))
    with pytest.raises(SpecError, match="state it as 'absolute'"):
        load_spec(path)
    dropped = text.replace(
        "content_position:\n    relative: {sign: query_minus_key, projection: key, "
        "placement: before_scale}",
        "content_position: drop",
    )
    assert dropped != text
    path.write_text(dropped)
    with pytest.raises(SpecError, match="terms.content_position"):
        load_spec(path)


# --------------------------------------------------------------------------- Transformer-XL


def _projected_sinusoids(pe, distances: torch.Tensor) -> torch.Tensor:
    """W_R R_t per head, [heads, L, head_dim], from the paper's split sinusoid."""
    table = formulas.transformer_xl_relative_sinusoid(distances, pe.model_dim)
    rows = table @ pe.r_net.weight.detach().to(F64).T  # [L, heads * head_dim]
    return rows.view(len(distances), pe.heads, pe.head_dim).transpose(0, 1)


@pytest.mark.parametrize("memory", [0, 5])
def test_transformer_xl_matches_the_paper_formula(memory: int) -> None:
    pe = generated_class("transformer_xl")(heads=2, head_dim=4, model_dim=8).double()
    n, m = 6, 6 + memory  # queries are the last n of m keys (memory first)
    q = torch.randn(2, 2, n, 4, dtype=F64)
    k, v = torch.randn(2, 2, m, 4, dtype=F64), torch.randn(2, 2, m, 3, dtype=F64)
    r = _projected_sinusoids(pe, torch.arange(m))
    u, vb = pe.r_w_bias.detach(), pe.r_r_bias.detach()
    expected = formulas.transformer_xl_scores(q, k, r, u, vb, mlen=memory, scale=0.5)
    scores = pe.scores(q, k)
    causal = torch.isfinite(expected)
    torch.testing.assert_close(scores[causal], expected[causal])
    # explicit positions take the gather instead of the relative shift
    explicit = pe.scores(q, k, q_positions=torch.arange(memory, m), k_positions=torch.arange(m))
    torch.testing.assert_close(explicit, scores)
    weights = torch.softmax(expected, dim=-1)
    for backend in ("eager", "sdpa"):
        torch.testing.assert_close(pe(q, k, v, causal=True, backend=backend), weights @ v)


def test_transformer_xl_scores_past_the_query_use_negative_distances() -> None:
    """Non-causal use: R_(i-j) for i < j is the same sinusoid at a negative distance."""
    pe = generated_class("transformer_xl")(heads=1, head_dim=4, model_dim=8).double()
    q, k = torch.randn(1, 1, 3, 4, dtype=F64), torch.randn(1, 1, 3, 4, dtype=F64)
    terms = pe.score_terms(q, k)
    r = _projected_sinusoids(pe, torch.tensor([-2]))[0, 0]  # W_R R_(-2)
    assert terms["content_position"][0, 0, 0, 2].item() == pytest.approx(
        0.5 * float(q[0, 0, 0] @ r)
    )
    assert terms["position_position"][0, 0, 2].item() == pytest.approx(
        0.5 * float(pe.r_r_bias[0].detach() @ r)
    )


def test_a_key_minus_query_term_on_raw_distances_reads_r_of_j_minus_i() -> None:
    """The relative shift serves only r = i - j; with the sign key_minus_query the term is
    q_i . W_R R_(j-i) at default positions as at explicit ones (a mutant that shifted
    this sign too was 0.48 off at default positions)."""
    old = "relative: {sign: query_minus_key, projection: relative, placement: before_scale}"
    cls = spec_variant(
        "transformer_xl", (old, old.replace("query_minus_key", "key_minus_query")), name="txl_kmq"
    )
    pe = cls(heads=2, head_dim=4, model_dim=8).double()
    n = m = 6
    q, k = torch.randn(1, 2, n, 4, dtype=F64), torch.randn(1, 2, m, 4, dtype=F64)
    j_minus_i = torch.arange(m)[None, :] - torch.arange(n)[:, None]  # [N, M]
    rows = _projected_sinusoids(pe, j_minus_i.flatten())  # [H, N * M, D]
    want = torch.einsum("bhnd,hnmd->bhnm", q, rows.view(2, n, m, 4)) * 0.5  # scale 1/sqrt(4)
    positions = {"q_positions": torch.arange(n), "k_positions": torch.arange(m)}
    for given in ({}, positions):
        got = pe.score_terms(q, k, **given)["content_position"]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_transformer_xl_loads_hugging_face_weights() -> None:
    """Attention probabilities and the layer output, with cached memory (mems).

    The Hugging Face module masks in float32 (float64 overflows its fill value), so it
    runs in float32 here against the generated module in float64 on the same weights.
    """
    from transformers.models.deprecated.transfo_xl.modeling_transfo_xl import (
        PositionalEmbedding,
        RelPartialLearnableMultiHeadAttn,
    )

    heads, head_dim, model_dim, qlen, mlen, batch = 4, 8, 32, 7, 5, 2
    hf = RelPartialLearnableMultiHeadAttn(heads, model_dim, head_dim, dropout=0.0).eval()
    with torch.no_grad():
        hf.r_w_bias.normal_()
        hf.r_r_bias.normal_()
    pe = generated_class("transformer_xl")(
        heads=heads, head_dim=head_dim, model_dim=model_dim
    ).double()
    with torch.no_grad():
        pe.r_net.weight.copy_(hf.r_net.weight)
        pe.r_w_bias.copy_(hf.r_w_bias)
        pe.r_r_bias.copy_(hf.r_r_bias)
    klen = qlen + mlen
    w = torch.randn(qlen, batch, model_dim)  # [time, batch, model_dim]
    mems = torch.randn(mlen, batch, model_dim)
    pos_emb = PositionalEmbedding(model_dim)(torch.arange(klen - 1, -1, -1.0))
    future = torch.triu(torch.ones(qlen, klen), diagonal=1 + mlen).bool()[:, :, None]
    with torch.no_grad():
        layer_out, probs = hf(w, pos_emb, attn_mask=future, mems=mems, output_attentions=True)
        heads_qkv = hf.qkv_net(torch.cat([mems, w], 0)).double().chunk(3, dim=-1)
        q, k, v = (x.view(klen, batch, heads, head_dim).permute(1, 2, 0, 3) for x in heads_qkv)
        q = q[:, :, -qlen:]
        allowed = ~future[:, :, 0]
        ours = torch.softmax(pe.scores(q, k).masked_fill(~allowed, float("-inf")), dim=-1)
        # Hugging Face: [qlen, klen, batch, heads]
        torch.testing.assert_close(ours.float(), probs.permute(2, 3, 0, 1), atol=1e-6, rtol=1e-5)
        hf64 = hf.double()
        for backend in ("eager", "sdpa"):
            out = pe(q, k, v, causal=True, backend=backend)  # [batch, heads, qlen, head_dim]
            vec = out.permute(2, 0, 1, 3).reshape(qlen, batch, heads * head_dim)
            expected = hf64.layer_norm(w.double() + hf64.o_net(vec))
            torch.testing.assert_close(expected.float(), layer_out, atol=1e-5, rtol=1e-5)


def test_transformer_xl_score_bias_is_the_position_only_term() -> None:
    pe = generated_class("transformer_xl")(heads=2, head_dim=4, model_dim=8).double()
    q, k = torch.randn(1, 2, 3, 4, dtype=F64), torch.randn(1, 2, 5, 4, dtype=F64)
    bias = pe.score_bias(torch.arange(2, 5), torch.arange(5))
    assert bias.shape == (2, 3, 5)
    terms = pe.score_terms(q, k)
    torch.testing.assert_close(bias.double(), terms["position_position"])
    batched = pe.score_bias(torch.tensor([[2, 3, 4], [0, 1, 2]]), torch.arange(5).expand(2, 5))
    torch.testing.assert_close(batched[0], bias)
    assert generated_class("deberta")().score_bias(torch.arange(3), torch.arange(3)) is None


# --------------------------------------------------------------------------- the building block


class _LargestTensor:
    """Records the largest tensor any torch op produces while active."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        record = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for item in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(item, torch.Tensor):
                        record.largest = max(record.largest, item.numel())
                return out

        self.largest = 0
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("name", ["shaw", "bert_relative_key_query", "deberta", "transformer_xl"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_no_pairwise_feature_tensor_is_formed(name: str, backend: str) -> None:
    """Terms go through [B, H, N, K] scores and an [N, M] index, never [N, M, head_dim].

    Without gradients a projected table is projected whole once ([512, model_dim] for
    DeBERTa), so N is large enough that [N, M, head_dim] is larger still.
    """
    pe = generated_class(name)(heads=1, head_dim=32)
    n = 128
    q, k, v = (torch.randn(1, 1, n, 32) for _ in range(3))
    explicit = torch.arange(n)
    with torch.no_grad(), _LargestTensor() as seen:
        pe(q, k, v, causal=True, backend=backend)
        pe(q, k, v, q_positions=explicit, k_positions=explicit, backend=backend)
    parameters = max(p.numel() for p in pe.parameters())
    rows_in_model_space = 2 * n * getattr(pe, "model_dim", 0)  # [K <= 2n, model_dim]
    assert seen.largest < n * n * 32
    assert seen.largest <= max(parameters, 4 * n * n, rows_in_model_space)


def test_only_the_rows_the_index_reaches_are_read() -> None:
    """A 1023-row table read by 5 queries and 5 keys touches 9 rows."""
    pe = generated_class("bert_relative_key")(heads=2, head_dim=4)
    index, rows = pe._relative_layout(None, None, 5, 5, torch.device("cpu"), "query_minus_key")
    assert rows.tolist() == list(range(511 - 4, 511 + 5))
    assert int(index.min()) == 0 and int(index.max()) == 8


RELATIVE_SPECS = [
    "shaw",
    "bert_relative_key",
    "bert_relative_key_query",
    "deberta",
    "transformer_xl",
]


@pytest.mark.parametrize("name", RELATIVE_SPECS)
def test_shifting_every_position_leaves_the_output_unchanged(name: str) -> None:
    """The relative claim, with packed positions reaching the clip and the buckets."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pe = generated_class(name)(heads=2, head_dim=4).double()
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=F64) for _ in range(3))

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(st.lists(st.integers(0, 600), min_size=6, max_size=6), st.integers(0, 5000))
    def check(positions: list[int], shift: int) -> None:
        pos = torch.tensor(positions)
        base = pe(q, k, v, q_positions=pos, k_positions=pos, backend="eager")
        moved = pe(q, k, v, q_positions=pos + shift, k_positions=pos + shift, backend="sdpa")
        torch.testing.assert_close(moved, base)

    check()


def test_transformer_xl_loads_xlnet_weights_bidirectionally() -> None:
    """XLNet's relative attention without segments is the same four terms; its "bi"
    attention reads negative distances (keys after the query) from the same sinusoid."""
    from transformers import XLNetConfig
    from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention

    heads, head_dim, model_dim, qlen, batch = 4, 8, 32, 9, 2
    config = XLNetConfig(d_model=model_dim, n_head=heads, d_inner=16, dropout=0.0)
    hf = XLNetRelativeAttention(config).double().eval()
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.normal_(std=0.3)
    pe = generated_class("transformer_xl")(
        heads=heads, head_dim=head_dim, model_dim=model_dim
    ).double()
    with torch.no_grad():
        pe.r_net.weight.copy_(hf.r.flatten(1).T)  # [model_dim, heads, head_dim] -> W_R
        pe.r_w_bias.copy_(hf.r_w_bias)
        pe.r_r_bias.copy_(hf.r_r_bias)
    h = torch.randn(qlen, batch, model_dim, dtype=F64)
    distances = torch.arange(qlen, -qlen, -1, dtype=F64)  # XLNet "bi": klen ... -qlen + 1
    inv_freq = 1 / 10000 ** (torch.arange(0, model_dim, 2, dtype=F64) / model_dim)
    angles = distances[:, None] * inv_freq
    pos_emb = torch.cat([angles.sin(), angles.cos()], dim=-1)[:, None].expand(-1, batch, -1)
    with torch.no_grad():
        q_head, k_head, v_head = (torch.einsum("ibh,hnd->ibnd", h, w) for w in (hf.q, hf.k, hf.v))
        r_head = torch.einsum("ibh,hnd->ibnd", pos_emb, hf.r)
        vec, probs = hf.rel_attn_core(q_head, k_head, v_head, r_head, output_attentions=True)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q_head, k_head, v_head))
        ours = torch.softmax(pe.scores(q, k), dim=-1)
        torch.testing.assert_close(ours, probs.permute(2, 3, 0, 1), atol=1e-12, rtol=1e-10)
        for backend in ("eager", "sdpa"):
            out = pe(q, k, v, backend=backend)
            torch.testing.assert_close(out, vec.permute(1, 2, 0, 3), atol=1e-12, rtol=1e-10)


COMBINATIONS = {
    # a global content bias alone needs no relative table
    "global_content_only": """\
defaults: {heads: 2, head_dim: 4}
scale: inv_sqrt_head_dim
terms:
  content_content: keep
  content_position: drop
  position_content:
    global: {placement: after_scale}
  position_position: drop
""",
    # a relative key term beside a T5 bucket bias, per-head table, bias after the scale
    "relative_with_bias": """\
defaults: {heads: 2, head_dim: 4}
scale: inv_sqrt_head_dim
relative:
  index: {kind: clip, max_distance: 2}
  table: {kind: learned, width: head_dim, heads: per_head}
terms:
  content_content: keep
  content_position:
    relative: {sign: key_minus_query, projection: none, placement: after_scale}
  position_content: drop
  position_position:
    bias:
      kind: learned_table
      index: {kind: log_buckets, recipe: t5, buckets: 8, max_distance: 16,
              bidirectional: true, sign: key_minus_query}
      placement: before_scale
""",
    # rotary content with a relative value term
    "rotary_with_relative_values": """\
defaults: {heads: 2, head_dim: 4}
scale: inv_sqrt_head_dim
relative:
  index: {kind: clip, max_distance: 3}
terms:
  content_content:
    rotate: {base: 10000, pairing: half}
  content_position: drop
  position_content: drop
  position_position: drop
values:
  relative: {sign: query_minus_key, heads: per_head}
""",
}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_relative_blocks_combine_with_the_others(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\ntitle: t\nreferences: [r]\n{COMBINATIONS[name]}claims: {{}}\n",
        encoding="utf-8",
    )
    pe = encoding_class(module_from_spec(path))()
    with torch.no_grad():
        for parameter in pe.parameters():
            parameter.normal_()
    q, k = torch.randn(2, 2, 4, 4), torch.randn(2, 2, 7, 4)
    v = torch.randn(2, 2, 7, getattr(pe, "value_dim", 3))
    positions = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 9]])
    k_positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 7, 8, 9]])
    for kwargs in ({}, {"q_positions": positions, "k_positions": k_positions}):
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **kwargs)
            sdpa = pe(q, k, v, causal=causal, backend="sdpa", **kwargs)
            torch.testing.assert_close(sdpa, eager, atol=2e-5, rtol=1e-4)
    expected_terms = {
        "global_content_only": {"content_content", "position_content"},
        "relative_with_bias": {"content_content", "content_position", "position_position"},
        "rotary_with_relative_values": {"content_content"},
    }[name]
    assert set(pe.score_terms(q, k)) == expected_terms


@pytest.mark.parametrize(("n", "m"), [(1, 1), (1, 6), (2, 2), (3, 8), (6, 6)])
def test_transformer_xl_relative_shift_is_the_index_formula(n: int, m: int) -> None:
    """out[i, j] = scores[i, j - i + N - 1] (Dai et al. 2019), read as a view: no copy."""
    from generated.transformer_xl import _relative_shift

    scores = torch.randn(2, 3, n, n + m - 1)
    want = torch.empty(2, 3, n, m)
    for i in range(n):
        for j in range(m):
            want[..., i, j] = scores[..., i, j - i + n - 1]
    got = _relative_shift(scores, m)
    assert torch.equal(got, want)
    assert got.data_ptr() >= scores.data_ptr()  # a view into the scores' storage
    assert got.untyped_storage().data_ptr() == scores.untyped_storage().data_ptr()
