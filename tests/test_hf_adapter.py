"""posgen.hf: a tiny random Hugging Face Llama gives the same logits, and the same greedy
generation with a KV cache, when its attention runs through generated.rope.Rope."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from generated.rope import Rope  # noqa: E402
from posgen.hf import use_posgen_attention  # noqa: E402
from tests.conftest import hf_decode_step_reads  # noqa: E402


def _tiny_llama(layers: int = 2, attention: str = "eager") -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        rope_theta=10000.0,  # rope.yaml's base
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_tiny_llama_logits_match_through_posgen(attention: str) -> None:
    """The causal masking is HF's: its 4-D mask where the layer gets one ("eager"
    always; it holds the causal part), causal attention where it gets none ("sdpa"
    without padding)."""
    model = _tiny_llama(attention=attention)
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tiny_llama_generation_with_a_cache_matches_through_posgen() -> None:
    model = _tiny_llama()
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(ids, **settings)
        use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
        got = model.generate(ids, **settings)
    assert torch.equal(got, expected)


def test_a_model_without_llama_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="no attention layer"):
        use_posgen_attention(torch.nn.Linear(2, 2), lambda layer: Rope())


@pytest.mark.parametrize("cache", ["dynamic", "static", "compiled"])
def test_tiny_llama_left_padded_batch_generation_matches_through_posgen(cache: str) -> None:
    """Cached keys take the positions of the kept tokens, as HF's position_ids do.
    "compiled" is HF's recipe for fast decoding, a static cache and ``model.forward``
    under torch.compile with fullgraph: it traces through the adapter (no graph break
    where layers share positions and masks) and gives HF's own uncompiled tokens."""
    model = _tiny_llama()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3], ids[0, :3] = 0, 0  # left padding with the pad token
    settings = {
        "max_new_tokens": 8,
        "do_sample": False,
        "pad_token_id": 0,
        "cache_implementation": "dynamic" if cache == "dynamic" else "static",
    }
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **settings)
        use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
        if cache == "compiled":
            model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        got = model.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("padded", [False, True])
def test_a_decode_step_reads_the_positions_once_per_forward(padded: bool) -> None:
    """HF gives every layer the same position_ids (and mask): the posgen modules read
    them from the device (a host sync on a GPU) as often in a 3-layer model as in a
    1-layer one, not once per layer; the step's logits still match HF's."""
    reads = {}
    for layers in (1, 3):
        model = _tiny_llama(layers)
        reference = _tiny_llama(layers)
        use_posgen_attention(model, lambda layer: Rope(heads=4, head_dim=16))
        ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(5))
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :3] = 0
        want, _ = hf_decode_step_reads(reference, ids, mask)
        got, reads[layers] = hf_decode_step_reads(model, ids, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert reads[3] == reads[1]


def test_layers_share_positions_only_for_the_same_unchanged_tensors_and_device() -> None:
    """What one layer forms from HF's mask is reused by the next only for the same mask
    object, unedited, the same key count and device; never for inference tensors,
    whose edits count no version."""
    from posgen import hf

    made: list[int] = []

    def make() -> int:
        made.append(1)
        return len(made)

    cpu, meta = torch.device("cpu"), torch.device("meta")
    mask = torch.zeros(1, 1, 1, 4)
    assert hf._shared_by_layers((mask, None), (4, cpu), make) == 1
    assert hf._shared_by_layers((mask, None), (4, cpu), make) == 1  # the next layer
    assert hf._shared_by_layers((mask, None), (4, meta), make) == 2  # another device
    assert hf._shared_by_layers((mask, None), (5, meta), make) == 3  # another key count
    mask.add_(1)
    assert hf._shared_by_layers((mask, None), (5, meta), make) == 4  # edited in place
    assert hf._shared_by_layers((mask.clone(), None), (5, meta), make) == 5
    assert hf._shared_by_layers((mask, mask), (5, meta), make) == 6  # cache positions
    assert hf._shared_by_layers((mask,), (5, meta), make) == 7  # another family's layer
    with torch.inference_mode():
        held = torch.zeros(1, 1, 1, 4)
    assert hf._shared_by_layers((held, None), (4, cpu), make) == 8
    assert hf._shared_by_layers((held, None), (4, cpu), make) == 9


def test_hf_float_masks_reach_the_module_as_masked_keys() -> None:
    """HF's additive mask (0 kept, finfo.min masked, causal folded in) for a left-padded
    batch: its padding query rows mask every key, and through the adapter's mask the
    sdpa backend's outputs and gradients over every row, those rows included, equal the
    eager oracle's (given finfo.min itself, CPU flash attention's backward gave those
    rows' keys and values gradients of another function than its forward)."""
    import posgen.hf
    from posgen.hf import _four_d

    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 6, 16, generator=generator) for _ in range(3))
    kept = torch.ones(2, 6, dtype=torch.bool)
    kept[0, :3] = False  # row 0: three padding tokens
    allowed = kept[:, None, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()  # [2, 1, 6, 6]
    hf_mask = torch.zeros(2, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = _four_d(hf_mask, 6)
    assert mask is not None and bool((mask[0, 0, :3] == float("-inf")).all())
    pe = Rope(heads=4, head_dim=16)
    results = []
    for backend in ("eager", "sdpa"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = pe(*inputs, attn_mask=mask, causal=True, backend=backend)
        results.append((out, torch.autograd.grad(out.sum(), inputs)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert bool((got[0, :, :3] == 0).all())  # the padding rows: zeros
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)
    # the layers share the mask made from HF's, kept no longer than HF's own
    assert _four_d(hf_mask, 6) is mask
    del hf_mask
    assert posgen.hf._LAST_MASK == []


def test_a_bias_on_llama_weights_decodes_alike_under_eager_and_sdpa_masks() -> None:
    """HF hands eager attention an additive mask and sdpa attention a bool one; the
    cached keys' positions come from either (left padding, strict=False: ALiBi on the
    Llama's weights on purpose), so both generate the same tokens and logits. Before
    the bool mask was read as such, every sdpa key sat at position 0."""
    from generated.alibi import Alibi

    runs = {}
    for attention in ("eager", "sdpa"):
        model = _tiny_llama(attention=attention)
        ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
        mask[0, :3], ids[0, :3] = 0, 0
        use_posgen_attention(model, lambda layer: Alibi(heads=4, head_dim=16), strict=False)
        with torch.no_grad():
            runs[attention] = model.generate(
                ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
    assert torch.equal(runs["eager"].sequences, runs["sdpa"].sequences)
    for eager, sdpa in zip(runs["eager"].logits, runs["sdpa"].logits, strict=True):
        torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)


class _RecordingRope(Rope):
    """Rope that records how each call masks (``causal``, whether a mask was given)."""

    calls: list[tuple[bool, bool]] = []

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls.append((bool(kwargs.get("causal")), kwargs.get("attn_mask") is not None))
        return super().forward(*args, **kwargs)


def test_packed_sequences_without_a_mask_stay_causal_by_token_order() -> None:
    """Two documents packed into one row with positions restarting at each (the
    padding-free batches of DataCollatorWithFlattening), under SDPA: HF hands the layers
    no mask and attends causally by token order. A causal mask by position let token 0
    read the second document (logits 0.15-0.30 off, and changing the second document
    moved token 0's). Logits and every parameter's gradient now match HF's own; rows
    whose positions increase keep the plain causal call, with no mask."""
    reference = _tiny_llama(attention="sdpa")
    model = _tiny_llama(attention="sdpa")
    _RecordingRope.calls = []
    use_posgen_attention(model, lambda layer: _RecordingRope(heads=4, head_dim=16))
    ids = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    packed = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    for positions, masked in ((packed, True), (torch.arange(3, 15)[None], False)):
        _RecordingRope.calls.clear()
        outputs = {}
        for name, m in (("hf", reference), ("posgen", model)):
            m.zero_grad()
            result = m(ids, position_ids=positions, labels=ids)
            result.loss.backward()
            grads = [p.grad.clone() for p in m.parameters()]
            outputs[name] = (result.logits.detach(), grads)
        torch.testing.assert_close(outputs["posgen"][0], outputs["hf"][0], rtol=1e-5, atol=1e-5)
        for got, want in zip(outputs["posgen"][1], outputs["hf"][1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert _RecordingRope.calls == [(not masked, masked)] * 2  # one call per layer
