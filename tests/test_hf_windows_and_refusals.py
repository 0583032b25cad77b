"""posgen.hf: cached keys take their own positions under a sliding window (a position
bias that is not linear in the distance, T5's, sees them), and the Llama-family path
refuses attention dropout in training and ``output_attentions`` as BLOOM's does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from generated.rope import Rope  # noqa: E402
from generated.t5 import T5  # noqa: E402
from posgen.hf import _cached_key_positions, use_posgen_attention  # noqa: E402

TOKENS = 20
PADDING = {
    "none": (),
    "left": (0, 1, 2),
    "right": (17, 18, 19),
    "inner": (8, 9, 13),
}


def _tiny_mistral(window: int, attention: str, layers: int = 2) -> torch.nn.Module:
    """A tiny random Mistral whose layers run T5's bias on purpose (strict=False)."""
    config = transformers.MistralConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        sliding_window=window,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    return use_posgen_attention(model, lambda layer: T5(heads=4, head_dim=16), strict=False)


def _batch(padding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and generate's position_ids (kept tokens counted, 1 at
    padding) [2, TOKENS]; row 0 padded at PADDING[padding]."""
    ids = torch.randint(1, 97, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, list(PADDING[padding])] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _in_chunks(model: torch.nn.Module, cache_kind: str, padding: str, chunks: list[int]) -> float:
    """The largest difference at kept tokens between the logits of one forward over
    the batch and those of the same tokens fed in ``chunks`` through a cache."""
    ids, mask, positions = _batch(padding)
    config = model.config
    cache = (
        transformers.DynamicCache(config=config)
        if cache_kind == "dynamic"
        else transformers.StaticCache(config=config, max_cache_len=TOKENS + 4)
    )
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, position_ids=positions).logits
        parts, start = [], 0
        for size in chunks:
            end = start + size
            out = model(
                ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=positions[:, start:end],
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(start, end),
            )
            parts.append(out.logits)
            start = end
    return float((torch.cat(parts, 1) - whole)[mask.bool()].abs().max())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_a_sliding_window_decodes_as_the_whole_forward_under_a_t5_bias(
    attention: str, cache_kind: str, padding: str
) -> None:
    """Window 6 of 20 tokens: a prefill of 10 and 10 cached decode steps give the
    whole forward's logits. Keys the window had masked in the last query's row used
    to be numbered 0 .. W - 1 from the left (a difference of 0.3 in the logits); a
    rotation would not see it (keys are cached rotated), ALiBi's linear bias cancels,
    T5's buckets do not."""
    model = _tiny_mistral(6, attention)
    assert _in_chunks(model, cache_kind, padding, [10] + [1] * 10) < 1e-5


@pytest.mark.parametrize(
    ("padding", "chunks"),
    [
        ("none", [7, 5, 4, 1, 3]),
        ("left", [4, 4, 4, 4, 4]),
        ("right", [10] + [1] * 10),  # steps whose only query is padding
        ("right", [7, 5, 4, 1, 3]),
        ("inner", [7, 5, 4, 1, 3]),
    ],
)
@pytest.mark.parametrize("window", [6, 100])
def test_chunks_through_a_cache_give_the_whole_forward_under_a_t5_bias(
    padding: str, chunks: list[int], window: int
) -> None:
    """Chunks of several queries: the earliest query's window reaches keys the last
    one's leaves out, and a chunk may end in padding; the keys keep their positions
    with and without a window, in a dynamic cache (which keeps only the window)."""
    model = _tiny_mistral(window, "sdpa")
    assert _in_chunks(model, "dynamic", padding, chunks) < 1e-5


def test_cached_key_positions_count_back_from_the_last_kept_query() -> None:
    """A window of 3 over a cache of 6 keys, one decode query at position 4 (row 0:
    one padding token in front, so the row counts one token less): the keys the query
    keeps take their own positions, the others 0; the queries' slots follow the cache
    positions, or the end of a cache shorter than the sequence."""
    kept = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    mask = kept[:, None, None, :]  # [2, 1, 1, 6], sdpa's bool form
    positions = torch.tensor([[4], [5]])
    got = _cached_key_positions(mask, positions, torch.tensor([5]), 6)
    assert got.tolist() == [[0, 0, 0, 2, 3, 4], [0, 0, 0, 3, 4, 5]]
    # a window's cache holding the last 4 keys of 10 tokens: the query is its last key
    kept = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    got = _cached_key_positions(kept, torch.tensor([9]), torch.tensor([9]), 4)
    assert got.tolist() == [[0, 7, 8, 9]]
    # a static cache of 8 slots, 5 filled: the query at slot 4, the rest masked
    kept = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    got = _cached_key_positions(kept, torch.tensor([4]), torch.tensor([4]), 8)
    assert got.tolist() == [[0, 1, 2, 3, 4, 0, 0, 0]]


def test_every_test_file_posgen_cites_exists() -> None:
    """A docstring that says where a behaviour is tested names a file that is there:
    ``_cached_key_positions`` cited tests/test_hf_review.py, which never existed (its
    tests are this file's). Every ``tests/....py`` path in posgen's sources is checked."""
    root = Path(__file__).resolve().parent.parent
    cited = {
        (source.relative_to(root).as_posix(), match)
        for source in sorted((root / "posgen").rglob("*.py"))
        for match in re.findall(r"tests/[\w/]+\.py", source.read_text(encoding="utf-8"))
    }
    assert ("posgen/hf.py", "tests/test_hf_windows_and_refusals.py") in cited
    missing = sorted((source, path) for source, path in cited if not (root / path).is_file())
    assert not missing, f"cited test files that do not exist: {missing}"


def test_layers_share_cached_key_positions_only_for_the_same_position_ids() -> None:
    """A 4-D mask given by the caller reaches every forward as the same tensor: the
    positions the layers share are formed again for other position_ids (an offset
    moves the queries' positions, and the keys' must move with them: T5's bias, relative,
    then gives the same logits, as it did not when the keys kept the first's)."""
    model = _tiny_mistral(6, "eager")
    ids, _, positions = _batch("none")
    allowed = torch.ones(TOKENS + 1, TOKENS + 1, dtype=torch.bool).tril()[-1:]  # [1, 21]
    step_mask = torch.zeros(2, 1, 1, TOKENS + 1).masked_fill(~allowed, torch.finfo().min)

    def step(mask: torch.Tensor, offset: int) -> torch.Tensor:
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(ids, position_ids=positions + offset, past_key_values=cache, use_cache=True)
            out = model(
                torch.tensor([[5], [7]]),
                attention_mask=mask,
                position_ids=torch.full((2, 1), TOKENS + offset),
                past_key_values=cache,
                cache_position=torch.tensor([TOKENS]),
            )
        return out.logits

    shared = [step(step_mask, offset) for offset in (0, 30)]  # one mask tensor
    fresh = [step(step_mask.clone(), offset) for offset in (0, 30)]
    for got, want in zip(shared, fresh, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(fresh[1], fresh[0], rtol=1e-5, atol=1e-5)  # T5: relative


def _tiny_llama(**settings: float | bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        attn_implementation="eager",
        **settings,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_llama_attention_dropout_in_training_is_refused() -> None:
    """HF's layers drop attention weights in training (two forwards differ); posgen's
    attention has no dropout, so it refuses rather than train without it. In eval
    mode, or with attention_dropout 0, it runs."""
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    model = _tiny_llama(attention_dropout=0.5).train()
    assert not torch.equal(model(ids).logits, model(ids).logits)  # HF's own: dropped
    use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
    with pytest.raises(ValueError, match=r"attention_dropout.*model\.eval\(\)"):
        model(ids)
    model.eval()
    model(ids)
    model = _tiny_llama(attention_dropout=0.0).train()
    use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
    assert torch.equal(model(ids).logits, model(ids).logits)


def test_llama_output_attentions_is_refused() -> None:
    """The layers' attention weights, asked for in the call or in the config, would
    come back empty (HF collects the layers' second output, None here): refused."""
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    model = _tiny_llama().eval()
    use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids, output_attentions=True)
        model(ids, output_attentions=False)
        model.config.output_attentions = True
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids)
        assert model(ids, output_attentions=False).attentions is None


SMALL = dict(
    vocab_size=61, hidden_size=64, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_hidden_layers=2, rope_theta=10000.0,
    attn_implementation="eager",
)  # fmt: skip
UNAPPLIED = {
    "gpt_oss": ({"num_local_experts": 2, "num_experts_per_tok": 1, "rope_scaling": None}, "sinks"),
    "hunyuan_v1_dense": ({"rope_scaling": None}, "query_layernorm: a weighted norm"),
    "bitnet": ({}, "attn_sub_norm: a norm of the attention's output"),
}  # fmt: skip


@pytest.mark.parametrize("family", list(UNAPPLIED))
def test_a_layer_with_parts_posgen_does_not_run_is_refused(family: str) -> None:
    """GPT-OSS's attention sinks, HunYuan's q and k norms after the rotation and
    BitNet's norm of the attention's output sit in Llama-shaped layers: run without
    them the logits were another model's (0.3 to 0.7 apart, with strict=True too), so
    they are refused by name, strict or not."""
    extra, message = UNAPPLIED[family]
    config = transformers.AutoConfig.for_model(family, **SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for strict in (True, False):
        with pytest.raises(ValueError, match=f"layer 0 .* has {message}"):
            use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16), strict=strict)


def _logits_before_and_after(model: torch.nn.Module, encoding: object) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, encoding)  # type: ignore[arg-type]
        return model(ids).logits, expected


def test_falcon_h1_keys_take_their_multiplier() -> None:
    """Falcon-H1 multiplies its keys by key_multiplier before rotating them (left out,
    the logits were 0.013 apart)."""
    config = transformers.FalconH1Config(
        **SMALL, key_multiplier=3.0, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
        mamba_d_state=8, mamba_n_groups=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    got, expected = _logits_before_and_after(model, lambda layer: Rope(heads=4, head_dim=16))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_exaone4_full_layers_have_no_positions() -> None:
    """EXAONE 4 hands every layer cos and sin but rotates only its sliding layers where
    it has a window: a rotation on the full layer is refused (it was accepted, 0.19
    apart), and NoPE there gives the model's logits."""
    from generated.nope import Nope

    config = transformers.Exaone4Config(
        **SMALL, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="layer 1 is a full layer .* but encoding.1. rotates"):
        use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
    got, expected = _logits_before_and_after(
        model, lambda layer: Nope(heads=4, head_dim=16) if layer else Rope(heads=4, head_dim=16)
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
