"""posgen.hf on BLOOM: a tiny random BloomForCausalLM gives the same logits (without
padding, with left and right padding) and the same greedy generation with a KV cache
when its attention runs through generated.alibi.Alibi, for 4 heads and for 6 (not a
power of two: BLOOM's slopes are ALiBi's)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from generated.alibi import Alibi  # noqa: E402
from generated.rope import Rope  # noqa: E402
from posgen.hf import use_posgen_attention  # noqa: E402
from tests.conftest import hf_decode_step_reads  # noqa: E402

VOCAB = 128
HIDDEN = 96  # 4 heads of 24, 6 heads of 16


def _tiny_bloom(heads: int, layers: int = 2, **settings: object) -> torch.nn.Module:
    config = transformers.BloomConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        n_layer=layers,
        n_head=heads,
        attn_implementation="eager",
        **settings,
    )
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(config).eval()


def _alibi(heads: int) -> Alibi:
    return Alibi(heads=heads, head_dim=HIDDEN // heads)


def _ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("heads", [4, 6])
def test_tiny_bloom_logits_match_through_alibi(heads: int) -> None:
    model = _tiny_bloom(heads)
    ids = _ids(2, 23, 1)
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, lambda layer: _alibi(heads))
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right", "inner"])
def test_tiny_bloom_logits_match_with_padding(side: str) -> None:
    """Logits agree at every kept token (padded rows are undefined in both)."""
    model = _tiny_bloom(6)
    ids = _ids(3, 17, 2)
    mask = torch.ones_like(ids)
    if side == "left":
        mask[0, :5], mask[2, :1] = 0, 0
    elif side == "right":
        mask[0, -5:], mask[2, -1:] = 0, 0
    else:
        mask[0, 4:9], mask[2, 1:2] = 0, 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        use_posgen_attention(model, lambda layer: _alibi(6))
        got = model(ids, attention_mask=mask).logits
    kept = mask.bool()
    torch.testing.assert_close(got[kept], expected[kept], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [4, 6])
def test_tiny_bloom_generation_with_a_cache_matches_through_alibi(heads: int) -> None:
    model = _tiny_bloom(heads)
    ids = _ids(1, 7, 3)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "use_cache": True}
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        use_posgen_attention(model, lambda layer: _alibi(heads))
        got = model.generate(ids, **settings)
    assert got.shape == (1, 15)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("cache", ["dynamic", "static", "compiled"])
def test_tiny_bloom_left_padded_batch_generation_matches_through_alibi(cache: str) -> None:
    """ "compiled": a static cache and ``model.forward`` under torch.compile with
    fullgraph (HF's recipe for fast decoding) trace through the adapter and give HF's
    own uncompiled tokens."""
    model = _tiny_bloom(6)
    ids = _ids(2, 9, 4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0  # the pad token
    settings = {
        "max_new_tokens": 8,
        "do_sample": False,
        "pad_token_id": 0,
        "use_cache": True,
        "cache_implementation": "dynamic" if cache == "dynamic" else "static",
    }
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **settings)
        use_posgen_attention(model, lambda layer: _alibi(6))
        if cache == "compiled":
            model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        got = model.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(got, expected)


def test_cached_decode_logits_match_step_by_step() -> None:
    """Prefill then one-token steps with a DynamicCache: each step's logits agree."""
    model = _tiny_bloom(4)
    ids = _ids(2, 12, 5)
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, lambda layer: _alibi(4))
        out = model(ids[:, :8], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(8, 12):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_another_encoding_runs_on_bloom_weights() -> None:
    model = _tiny_bloom(4)
    ids = _ids(1, 10, 6)
    with torch.no_grad():
        use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=HIDDEN // 4))
        logits = model(ids).logits
    assert logits.shape == (1, 10, VOCAB) and bool(logits.isfinite().all())


def test_a_mismatched_encoding_is_refused() -> None:
    with pytest.raises(ValueError, match="has 6 heads, encoding\\(0\\) has 4"):
        use_posgen_attention(_tiny_bloom(6), lambda layer: Alibi(heads=4, head_dim=16))
    with pytest.raises(ValueError, match="head_dim 24, encoding\\(0\\) has head_dim 16"):
        use_posgen_attention(_tiny_bloom(4), lambda layer: Alibi(heads=4, head_dim=16))


def test_what_bloom_attention_cannot_do_is_refused() -> None:
    model = use_posgen_attention(_tiny_bloom(4), lambda layer: _alibi(4))
    ids = _ids(1, 5, 7)
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with torch.no_grad(), pytest.raises(ValueError, match="head_mask"):
        model(ids, head_mask=torch.ones(2, 4))
    dropping = use_posgen_attention(_tiny_bloom(4, attention_dropout=0.1), lambda layer: _alibi(4))
    with pytest.raises(ValueError, match="attention dropout"):
        dropping.train()(ids)


def test_a_mask_that_is_not_four_d_is_refused() -> None:
    model = use_posgen_attention(_tiny_bloom(4), lambda layer: _alibi(4))
    attention = model.transformer.h[0].self_attention
    hidden = torch.zeros(1, 5, HIDDEN)
    with pytest.raises(ValueError, match="4-D attention mask"):
        attention(hidden, hidden, attention_mask=torch.ones(1, 5))


def test_a_decode_step_reads_the_positions_once_per_forward() -> None:
    """Each layer forms its positions from the mask HF gives every layer: they are
    formed once per forward and read from the device (a host sync on a GPU) as often in
    a 3-layer model as in a 1-layer one; the step's logits still match BLOOM's."""
    reads = {}
    for layers in (1, 3):
        model, reference = _tiny_bloom(4, layers), _tiny_bloom(4, layers)
        use_posgen_attention(model, lambda layer: _alibi(4))
        ids = _ids(2, 9, 5)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        want, _ = hf_decode_step_reads(reference, ids, mask)
        got, reads[layers] = hf_decode_step_reads(model, ids, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert reads[3] == reads[1]
