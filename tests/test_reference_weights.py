"""Reference checkpoints load into the generated modules and give the same numbers.

Each section builds a Hugging Face module (transformers 4.x) from a small random config,
copies its weights into the generated module along the mapping documented in the module's
"Weights:" section, and compares outputs on random inputs in float64, eval mode (no
dropout). Nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import generated_class

transformers = pytest.importorskip("transformers")

F64 = torch.float64


def copy_weight(target: nn.Parameter, source: torch.Tensor) -> None:
    """Copy a reference weight into a generated parameter; the shapes must already agree."""
    assert tuple(target.shape) == tuple(source.shape), (
        f"layout mismatch: generated {tuple(target.shape)} vs reference {tuple(source.shape)}"
    )
    with torch.no_grad():
        target.copy_(source.detach().to(target.dtype))


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=1e-10)


def _close_float32_softmax(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """For outputs of references that run their softmax in float32 (T5Attention does,
    even for float64 modules): float32 rounding of the attention weights."""
    torch.testing.assert_close(actual, expected, atol=2e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------ T5
#
# T5Attention (models/t5/modeling_t5.py): logits = q k^T + position_bias, no 1/sqrt(d)
# scale; position_bias = relative_attention_bias(bucket(key_pos - query_pos)) permuted to
# [1, heads, N, M]; the encoder uses bidirectional buckets, the decoder unidirectional
# ones plus a causal mask. Generated specs: t5 (encoder) and t5_decoder.

T5_HEADS, T5_DKV, T5_DMODEL = 4, 8, 24


def _t5_attention(is_decoder: bool):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(
        d_model=T5_DMODEL,
        d_kv=T5_DKV,
        num_heads=T5_HEADS,
        num_layers=1,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        is_decoder=is_decoder,
        use_cache=is_decoder,
    )
    attention = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
    with torch.no_grad():  # a wide table so that every bucket is distinguishable
        attention.relative_attention_bias.weight.normal_(0.0, 1.0)
    return attention.double().eval()


def _t5_generated(name: str, reference) -> nn.Module:
    pe = generated_class(name)(heads=T5_HEADS, head_dim=T5_DKV).double().eval()
    copy_weight(pe.relative_attention_bias.weight, reference.relative_attention_bias.weight)
    return pe


def _split_heads(x: torch.Tensor) -> torch.Tensor:
    """[batch, seq, heads * d_kv] -> [batch, heads, seq, d_kv] (T5's own view)."""
    return x.view(x.shape[0], x.shape[1], T5_HEADS, T5_DKV).transpose(1, 2)


def _t5_qkv(reference, hidden: torch.Tensor):
    return (
        _split_heads(reference.q(hidden)),
        _split_heads(reference.k(hidden)),
        _split_heads(reference.v(hidden)),
    )


def _run_before_o(reference, hidden: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """T5Attention's output before its `o` projection, as [batch, heads, N, d_kv]."""
    captured: list[torch.Tensor] = []
    handle = reference.o.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            outputs = reference(hidden, **kwargs)
    finally:
        handle.remove()
    (merged,) = captured  # [batch, N, heads * d_kv]
    return _split_heads(merged), outputs[1]


def _causal_additive(n_queries: int, q_start: int, m: int) -> torch.Tensor:
    """The decoder's extended causal mask as T5Stack builds it: 0 or finfo.min."""
    q_pos = torch.arange(q_start, q_start + n_queries)
    allowed = torch.arange(m)[None, :] <= q_pos[:, None]
    mask = torch.zeros(1, 1, n_queries, m, dtype=F64)
    return mask.masked_fill(~allowed, torch.finfo(F64).min)


@pytest.mark.parametrize("seq", [7, 150])  # 150 > max_distance: every bucket is reached
def test_t5_encoder_bias_and_attention_match_hugging_face(seq: int) -> None:
    reference = _t5_attention(is_decoder=False)
    pe = _t5_generated("t5", reference)
    hidden = torch.randn(2, seq, T5_DMODEL, dtype=F64)
    # T5Stack passes cache_position = 0..seq-1 to every layer
    expected, position_bias = _run_before_o(reference, hidden, cache_position=torch.arange(seq))
    positions = torch.arange(seq)
    bias = pe.score_bias(positions, positions)
    assert bias.dtype == F64
    _close(bias, position_bias[0])
    _close(bias, reference.compute_bias(seq, seq)[0])
    q, k, v = _t5_qkv(reference, hidden)
    # the logits exactly: T5 scores are q k^T + position_bias, with no 1/sqrt(d) scale
    _close(pe.scores(q, k), torch.matmul(q, k.transpose(-2, -1)) + position_bias)
    for backend in ("eager", "sdpa"):
        _close_float32_softmax(pe(q, k, v, backend=backend), expected)


def test_t5_decoder_bias_and_causal_attention_match_hugging_face() -> None:
    reference = _t5_attention(is_decoder=True)
    pe = _t5_generated("t5_decoder", reference)
    seq = 140
    hidden = torch.randn(2, seq, T5_DMODEL, dtype=F64)
    expected, position_bias = _run_before_o(
        reference, hidden, mask=_causal_additive(seq, 0, seq), query_length=seq
    )
    positions = torch.arange(seq)
    _close(pe.score_bias(positions, positions), reference.compute_bias(seq, seq)[0])
    q, k, v = _t5_qkv(reference, hidden)
    for backend in ("eager", "sdpa"):
        _close_float32_softmax(pe(q, k, v, causal=True, backend=backend), expected)


@pytest.mark.parametrize("offset_by", ["cache_position", "query_length"])
def test_t5_decoder_kv_cache_matches_explicit_positions(offset_by: str) -> None:
    """A second decoding chunk against cached keys: HF's offset vs explicit positions."""
    from transformers import DynamicCache

    reference = _t5_attention(is_decoder=True)
    pe = _t5_generated("t5_decoder", reference)
    past, new = 9, 4
    total = past + new
    hidden = torch.randn(2, total, T5_DMODEL, dtype=F64)
    cache = DynamicCache()
    _run_before_o(
        reference,
        hidden[:, :past],
        mask=_causal_additive(past, 0, past),
        past_key_values=cache,
        cache_position=torch.arange(past),
    )
    if offset_by == "cache_position":
        extra = {"cache_position": torch.arange(past, total)}
    else:
        extra = {"query_length": total}
    expected, position_bias = _run_before_o(
        reference,
        hidden[:, past:],
        mask=_causal_additive(new, past, total),
        past_key_values=cache,
        **extra,
    )
    q, _, _ = _t5_qkv(reference, hidden[:, past:])
    _, k, v = _t5_qkv(reference, hidden)
    q_positions, k_positions = torch.arange(past, total), torch.arange(total)
    bias = pe.score_bias(q_positions, k_positions)
    _close(bias, reference.compute_bias(total, total)[0, :, past:])
    for backend in ("eager", "sdpa"):
        explicit = pe(
            q, k, v, q_positions=q_positions, k_positions=k_positions, causal=True, backend=backend
        )
        _close_float32_softmax(explicit, expected)
        default = pe(q, k, v, causal=True, backend=backend)  # queries = the last N keys
        _close_float32_softmax(default, expected)


# ------------------------------------------------------------------------------ GPT-2
#
# GPT2Model: hidden = wte(input_ids) + wpe(position_ids), then dropout (`drop`). The
# generated learned_absolute module owns `position_embeddings` [max_positions, model_dim]
# = wpe.weight, and embed(x, positions) = x + position_embeddings(positions). GPT-2's
# n_positions is the spec's max_positions (1024); only the width is made small.

ABS_HEADS, ABS_HEAD_DIM, ABS_MAX_POSITIONS = 2, 16, 1024
ABS_MODEL_DIM = ABS_HEADS * ABS_HEAD_DIM


def _capture_input(module: nn.Module, run) -> torch.Tensor:
    """The first positional input that `module` receives while `run()` executes."""
    captured: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return captured[0]


def _learned_absolute(position_weight: torch.Tensor) -> nn.Module:
    pe = (
        generated_class("learned_absolute")(
            heads=ABS_HEADS, head_dim=ABS_HEAD_DIM, model_dim=ABS_MODEL_DIM
        )
        .double()
        .eval()
    )
    copy_weight(pe.position_embeddings.weight, position_weight)
    return pe


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(
        vocab_size=97,
        n_positions=ABS_MAX_POSITIONS,
        n_embd=ABS_MODEL_DIM,
        n_layer=1,
        n_head=ABS_HEADS,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(1)
    model = GPT2Model(config).double().eval()
    return model, _learned_absolute(model.wpe.weight)


def test_gpt2_default_positions(gpt2) -> None:
    model, pe = gpt2
    ids = torch.randint(0, 97, (2, 11))
    expected = _capture_input(model.drop, lambda: model(ids))
    _close(pe.embed(model.wte(ids).detach()), expected)


def test_gpt2_explicit_position_ids(gpt2) -> None:
    model, pe = gpt2
    ids = torch.randint(0, 97, (2, 6))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [5, 6, 7, 8, 1000, 1023]])  # packed rows
    expected = _capture_input(model.drop, lambda: model(ids, position_ids=positions))
    tokens = model.wte(ids).detach()
    _close(pe.embed(tokens, positions), expected)
    shared = torch.tensor([3, 4, 5, 6, 7, 8])
    expected = _capture_input(model.drop, lambda: model(ids, position_ids=shared[None]))
    _close(pe.embed(tokens, shared), expected)  # [seq] positions broadcast over the batch


def test_gpt2_past_length_offset(gpt2) -> None:
    """After a cached prefix of P tokens, GPT-2 uses positions P..P+n-1."""
    model, pe = gpt2
    ids = torch.randint(0, 97, (2, 13))
    past = 9
    with torch.no_grad():
        cache = model(ids[:, :past], use_cache=True).past_key_values
    expected = _capture_input(model.drop, lambda: model(ids[:, past:], past_key_values=cache))
    _close(pe.embed(model.wte(ids[:, past:]).detach(), torch.arange(past, 13)), expected)


def test_gpt2_positions_past_n_positions_raise(gpt2) -> None:
    _, pe = gpt2
    x = torch.randn(1, 4, ABS_MODEL_DIM, dtype=F64)
    pe.embed(x, torch.tensor([1020, 1021, 1022, 1023]))  # the last trained rows are fine
    with pytest.raises(ValueError, match="1024"):
        pe.embed(x, torch.tensor([1021, 1022, 1023, 1024]))
    with pytest.raises(ValueError, match="cannot extrapolate"):
        pe.embed(torch.randn(1, ABS_MAX_POSITIONS + 1, ABS_MODEL_DIM, dtype=F64))


# ------------------------------------------------------------------------------- BERT
#
# BertEmbeddings: LayerNorm(word + token_type + position), then dropout. The token-type
# table is zeroed, so the LayerNorm input is exactly word + position embeddings (adding
# 0.0 is exact); position_embeddings.weight copies into the generated module unchanged.


@pytest.fixture(scope="module")
def bert():
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings

    config = BertConfig(
        vocab_size=97,
        hidden_size=ABS_MODEL_DIM,
        num_attention_heads=ABS_HEADS,
        max_position_embeddings=ABS_MAX_POSITIONS,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        position_embedding_type="absolute",
    )
    torch.manual_seed(2)
    embeddings = BertEmbeddings(config).double().eval()
    with torch.no_grad():
        embeddings.token_type_embeddings.weight.zero_()
    return embeddings, _learned_absolute(embeddings.position_embeddings.weight)


def test_bert_default_positions(bert) -> None:
    embeddings, pe = bert
    ids = torch.randint(0, 97, (3, 10))
    expected = _capture_input(embeddings.LayerNorm, lambda: embeddings(ids))
    _close(pe.embed(embeddings.word_embeddings(ids).detach()), expected)


def test_bert_explicit_position_ids_and_past_length(bert) -> None:
    embeddings, pe = bert
    ids = torch.randint(0, 97, (2, 5))
    tokens = embeddings.word_embeddings(ids).detach()
    positions = torch.tensor([[4, 3, 2, 1, 0], [0, 511, 512, 1022, 1023]])
    expected = _capture_input(embeddings.LayerNorm, lambda: embeddings(ids, position_ids=positions))
    _close(pe.embed(tokens, positions), expected)
    expected = _capture_input(
        embeddings.LayerNorm, lambda: embeddings(ids, past_key_values_length=7)
    )
    _close(pe.embed(tokens, torch.arange(7, 12)), expected)


def test_bert_positions_past_the_table_raise(bert) -> None:
    _, pe = bert
    with pytest.raises(ValueError, match="out of range"):
        pe.embed(torch.randn(2, 2, ABS_MODEL_DIM, dtype=F64), torch.tensor([0, 1024]))
