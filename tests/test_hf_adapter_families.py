"""posgen.hf on families whose attention does more than Llama's: query and key norms
(Qwen3, Gemma 3 per head; OLMo 2 over the whole projection; StableLM's LayerNorm per
head; Llama 4's weightless QK RMS norm), OLMo's clipped projections, a
logit scale of their own (Gemma 3), layers of several kinds with sliding windows or
chunks in the mask (Gemma 3, Llama 4). Each tiny model, run with the specs ``posgen
from-hf`` writes for its layers, gives its own logits; a module that cannot reproduce a
layer is refused by name."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from posgen.hf import use_posgen_attention
from posgen.hf_strict import UNCHECKED
from tests.conftest import from_hf_class, generated_class, posgen_layers

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=61, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0, attn_implementation="eager",
)  # fmt: skip


def _logits_through_posgen(
    model: Any, encoding: Any, length: int = 13, **options: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits on a random batch, before and after routing it through posgen."""
    ids = torch.randint(0, 61, (2, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, encoding, **options)
        got = model(ids).logits
    if options.get("strict", True):  # each layer's rotation was compared by value
        assert all(layer.__dict__[UNCHECKED] is None for layer in posgen_layers(model))
    return got, expected


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_query_and_key_norms_are_applied_as_the_layer_applies_them(
    family: str, tmp_path: Path
) -> None:
    """Qwen3 normalises each head of q and k, OLMo 2 the whole projection."""
    config_class = {"qwen3": transformers.Qwen3Config, "olmo2": transformers.Olmo2Config}
    config = config_class[family](num_hidden_layers=2, **TINY)
    rope = from_hf_class(config.to_dict(), tmp_path, f"{family}_positions")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms that are not the identity
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(0.5, 1.5)
    got, expected = _logits_through_posgen(model, lambda index: rope())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_stablelm_layer_norms_per_head_are_applied(tmp_path: Path) -> None:
    """StableLM with qk_layernorm: a LayerNorm per head of q and of k (weights not the
    identity), a quarter of each head rotated (partial_rotary_factor 0.25). The norms
    are added after the model is built: transformers 4.57's initialisation of a
    qk_layernorm model fails on their missing bias."""
    from transformers.models.stablelm.modeling_stablelm import StableLmLayerNormPerHead

    config = transformers.StableLmConfig(num_hidden_layers=2, **TINY)
    rope = from_hf_class(config.to_dict(), tmp_path, "stablelm_positions")
    torch.manual_seed(0)
    model = transformers.StableLmForCausalLM(config).eval()
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.qk_layernorm = True
        attention.q_layernorm = StableLmLayerNormPerHead(8, 4, eps=config.layer_norm_eps)
        attention.k_layernorm = StableLmLayerNormPerHead(8, 2, eps=config.layer_norm_eps)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_layernorm.norms." in name:
                parameter.uniform_(0.5, 1.5)
    got, expected = _logits_through_posgen(model, lambda index: rope())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_olmo_clips_q_k_and_v_as_the_layer_does(tmp_path: Path) -> None:
    """OLMo's clip_qkv: q, k and v clamped to [-0.05, 0.05] before the heads are split;
    a bound that clips most entries of the tiny model's projections, so the logits
    differ from the unclipped model's by far more than the tolerance."""
    clipped = transformers.OlmoConfig(num_hidden_layers=2, clip_qkv=0.05, **TINY)
    rope = from_hf_class(clipped.to_dict(), tmp_path, "olmo_positions")
    torch.manual_seed(0)
    model = transformers.OlmoForCausalLM(clipped).eval()
    torch.manual_seed(0)
    unclipped = transformers.OlmoForCausalLM(
        transformers.OlmoConfig(num_hidden_layers=2, **TINY)
    ).eval()
    got, expected = _logits_through_posgen(model, lambda index: rope())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    plain, _ = _logits_through_posgen(unclipped, lambda index: rope())
    assert (plain - expected).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["smollm3", "cohere2"])
def test_a_model_with_nope_layers_runs_with_one_spec_per_kind_of_layer(
    family: str, tmp_path: Path
) -> None:
    """SmolLM3 (use_rope 0 on every 4th layer) and Cohere 2 (no positions on its full
    layers, every 4th; neighbours paired on its sliding ones): the specs of layers 0 and
    3, routed per layer, give the model's own logits."""
    classes = {
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM),
    }
    config_class, model_class = classes[family]
    config = config_class(num_hidden_layers=4, **TINY)
    rope = from_hf_class(config.to_dict(), tmp_path, f"{family}_rope", "--layer", "0")
    nope = from_hf_class(config.to_dict(), tmp_path, f"{family}_nope", "--layer", "3")
    torch.manual_seed(0)
    model = model_class(config).eval()
    got, expected = _logits_through_posgen(model, lambda index: nope() if index == 3 else rope())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _model_with_two_kinds_of_layer(
    model_class: Any, config: Any, tmp_path: Path, names: tuple[str, str], other_layer: int
) -> tuple[Any, Any]:
    """The tiny model and its encoding per layer index: the spec ``posgen from-hf``
    writes for layer 0 (named names[0]) on every layer but ``other_layer``, which gets
    the spec written for it (names[1])."""
    first = from_hf_class(config.to_dict(), tmp_path, names[0], "--layer", "0")
    other = from_hf_class(config.to_dict(), tmp_path, names[1], "--layer", str(other_layer))
    torch.manual_seed(0)
    return model_class(config).eval(), (lambda index: other() if index == other_layer else first())


def _gemma3_and_its_encodings(tmp_path: Path) -> tuple[Any, Any]:
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=6, head_dim=8, query_pre_attn_scalar=12, sliding_window=5,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, **TINY,
    )  # fmt: skip
    names = ("gemma3_local", "gemma3_full")  # sliding layers 0-4, a full layer 5
    return _model_with_two_kinds_of_layer(
        transformers.Gemma3ForCausalLM, config, tmp_path, names, 5
    )


def _llama4_and_its_encodings(tmp_path: Path) -> tuple[Any, Any]:
    config = transformers.Llama4TextConfig(
        num_hidden_layers=4, head_dim=8, attention_chunk_size=4, floor_scale=4,
        attn_scale=0.3, intermediate_size_mlp=64, **TINY,
    )  # fmt: skip
    names = ("llama4_rope", "llama4_nope")  # RoPE layers 0-2, a NoPE layer 3
    return _model_with_two_kinds_of_layer(
        transformers.Llama4ForCausalLM, config, tmp_path, names, 3
    )


def test_gemma3_runs_with_its_local_and_global_layer_specs(tmp_path: Path) -> None:
    """Gemma 3: per-head q/k norms, the logit scale 1/sqrt(query_pre_attn_scalar), sliding
    layers (a window of 5 in HF's mask) turning with the local base, a full layer with
    rope_theta and linear scaling."""
    model, encoding = _gemma3_and_its_encodings(tmp_path)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.uniform_(-0.5, 0.5)  # Gemma's norms scale by 1 + weight
    got, expected = _logits_through_posgen(model, encoding, length=40)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_llama4_runs_with_its_rope_and_nope_layer_specs(tmp_path: Path) -> None:
    """Llama 4 text: RoPE layers with QK L2 norm and chunks of 4 (HF's mask), NoPE layer 3
    with temperature tuning (floor_scale 4, attn_scale 0.3), 13 positions."""
    model, encoding = _llama4_and_its_encodings(tmp_path)
    got, expected = _logits_through_posgen(model, encoding)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_greedy_generation_with_a_cache_and_left_padding_gives_the_same_tokens(
    family: str, compiled: bool, tmp_path: Path
) -> None:
    """12 new tokens after a 7-token prompt, one row left-padded by 2: past Gemma 3's
    window of 5 (its sliding layers cache 5 keys) and across Llama 4's chunks of 4 and
    temperature steps of 4. ``compiled``: HF's recipe for fast decoding, a static cache
    and ``model.forward`` under torch.compile with fullgraph, against HF's own
    uncompiled tokens."""
    build = {"gemma3": _gemma3_and_its_encodings, "llama4": _llama4_and_its_encodings}
    model, encoding = build[family](tmp_path)
    ids = torch.randint(1, 61, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    options = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    if compiled:
        options["cache_implementation"] = "static"
    with torch.no_grad():
        expected = model.generate(ids, **options)
        use_posgen_attention(model, encoding)
        if compiled:
            model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
        got = model.generate(ids, **options)
    assert torch.equal(got, expected)


def _cohere2_and_its_encodings(tmp_path: Path) -> tuple[Any, Any]:
    config = transformers.Cohere2Config(num_hidden_layers=4, **TINY)
    names = ("cohere2_rope", "cohere2_nope")  # sliding RoPE layers 0-2, a full NoPE layer 3
    return _model_with_two_kinds_of_layer(
        transformers.Cohere2ForCausalLM, config, tmp_path, names, 3
    )


def _logits_and_gradients(model: Any, ids: torch.Tensor, positions: torch.Tensor) -> list[Any]:
    """The logits of one training step of ``model`` on ``ids`` at ``positions``, then
    every parameter's gradient of its loss, in the parameters' order."""
    model.train()
    model.zero_grad()
    result = model(ids, position_ids=positions, labels=ids)
    result.loss.backward()
    return [result.logits.detach()] + [parameter.grad for parameter in model.parameters()]


@pytest.mark.parametrize("family", ["llama4", "cohere2"])
def test_layers_handed_no_position_ids_rotate_by_the_models_packed_positions(
    family: str, tmp_path: Path
) -> None:
    """Llama 4's and Cohere 2's decoder layers call self_attn without position_ids;
    the model rotates by those its rotary embedding module turned into cos and sin
    (``freqs_cis``). Two documents packed in each row, positions restarting at each,
    past Llama 4's chunk of 4 and its temperature steps of 4 (which HF numbers by
    cache_position, not position_ids): posgen's logits and every gradient of a
    training step are HF's own. The adapter rotated by cache_position, 0.1 off in the
    logits, and the strict check refused the first forward."""
    build = {"llama4": _llama4_and_its_encodings, "cohere2": _cohere2_and_its_encodings}
    reference, encoding = build[family](tmp_path)
    model = copy.deepcopy(reference)
    use_posgen_attention(model, encoding)
    ids = torch.randint(1, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    packed = torch.tensor(
        [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7]]
    )
    with torch.no_grad():  # the first forward: the strict check by value sees packed positions
        got, expected = (
            model(ids, position_ids=packed).logits,
            reference(ids, position_ids=packed).logits,
        )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert all(layer.__dict__[UNCHECKED] is None for layer in posgen_layers(model))
    got_step = _logits_and_gradients(model, ids, packed)
    expected_step = _logits_and_gradients(reference, ids, packed)
    for got_tensor, expected_tensor in zip(got_step, expected_step, strict=True):
        torch.testing.assert_close(got_tensor, expected_tensor, rtol=1e-5, atol=1e-5)


def test_llama4_layers_handed_a_copy_of_the_embeddings_read_the_rotary_modules_positions(
    tmp_path: Path,
) -> None:
    """A layer handed a copy of the rotary embedding module's output (accelerate's hooks
    move it to a layer on another device) finds the positions on the module: packed
    positions give HF's logits."""
    reference, encoding = _llama4_and_its_encodings(tmp_path)
    model = copy.deepcopy(reference)
    use_posgen_attention(model, encoding)

    def copied(layer: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return args, {**kwargs, "position_embeddings": kwargs["position_embeddings"].clone()}

    for layer in model.model.layers:
        layer.register_forward_pre_hook(copied, with_kwargs=True)
    ids = torch.randint(1, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        got = model(ids, position_ids=packed).logits
        expected = reference(ids, position_ids=packed).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_llama4_generation_with_a_chunked_prefill_gives_hfs_scores(tmp_path: Path) -> None:
    """``generate(prefill_chunk_size=4)`` on 10 tokens with a row left-padded by 3: HF
    passes its prefill chunks position_ids equal to cache_position and its decode
    steps the kept tokens' count, and rotates by those; each of 4 steps' scores is
    HF's own (0.09 off when the adapter rotated by cache_position)."""
    reference, encoding = _llama4_and_its_encodings(tmp_path)
    model = copy.deepcopy(reference)
    use_posgen_attention(model, encoding)
    ids = torch.randint(1, 61, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    options = dict(
        attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
        prefill_chunk_size=4, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    with torch.no_grad():
        got, expected = model.generate(ids, **options), reference.generate(ids, **options)
    torch.testing.assert_close(
        torch.stack(got.scores), torch.stack(expected.scores), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(got.sequences, expected.sequences)


def _llama4_through_from_hf_specs(
    tmp_path: Path, config: Any, from_hf_config: dict[str, Any]
) -> tuple[Any, Any, Any]:
    """The tiny Llama 4 of ``config``, a deep copy of it routed (strictly) through the
    specs ``posgen from-hf`` writes from ``from_hf_config`` for its RoPE layer 0 and NoPE
    layer 3, and the NoPE layer's class."""
    rope = from_hf_class(from_hf_config, tmp_path, "llama4_rope", "--layer", "0")
    nope = from_hf_class(from_hf_config, tmp_path, "llama4_nope", "--layer", "3")
    torch.manual_seed(0)
    reference = transformers.Llama4ForCausalLM(config).eval()
    model = copy.deepcopy(reference)
    use_posgen_attention(model, lambda index: nope() if index == 3 else rope())
    return reference, model, nope


def _logits_of_both(reference: Any, model: Any, length: int = 13) -> tuple[Any, Any]:
    ids = torch.randint(1, 61, (2, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits, reference(ids).logits


def test_llama4_scouts_temperature_settings_give_hfs_logits(tmp_path: Path) -> None:
    """Llama 4 Scout's published config states ``"attn_temperature_tuning": 4``, which
    HF tests for truth, and a JSON writer may give ``floor_scale`` as 4.0, which HF
    divides by alike: from-hf reads both from a multimodal config's text_config (it
    refused the 4), and 13 positions (temperature steps at 3, 7 and 11) give HF's own
    logits."""
    config = transformers.Llama4TextConfig(
        num_hidden_layers=4, head_dim=8, attention_chunk_size=4, floor_scale=4.0,
        attn_scale=0.3, attn_temperature_tuning=4, intermediate_size_mlp=64, **TINY,
    )  # fmt: skip
    scout = {"model_type": "llama4", "text_config": config.to_dict()}
    reference, model, nope = _llama4_through_from_hf_specs(tmp_path, config, scout)
    assert nope.has_query_scale
    got, expected = _logits_of_both(reference, model)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_llama4_with_attn_scale_0_runs_its_plain_nope_layer_strictly(tmp_path: Path) -> None:
    """attn_scale 0 with temperature tuning on scales every query by exactly 1: from-hf
    writes plain ``nope`` for the NoPE layer, and strict mode, which refused that very
    spec (the layer "scales its queries by position"), runs it to HF's logits."""
    config = transformers.Llama4TextConfig(
        num_hidden_layers=4, head_dim=8, attention_chunk_size=4, floor_scale=4,
        attn_scale=0.0, intermediate_size_mlp=64, **TINY,
    )  # fmt: skip
    reference, model, nope = _llama4_through_from_hf_specs(tmp_path, config, config.to_dict())
    assert not nope.has_query_scale
    got, expected = _logits_of_both(reference, model)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _refusal(model: Any, encoding: Any, **options: bool) -> str:
    with pytest.raises(ValueError) as caught:
        use_posgen_attention(model, encoding, **options)
    return str(caught.value)


def test_a_module_that_cannot_reproduce_a_layer_is_refused_by_name(tmp_path: Path) -> None:
    """Soft-capping always; with strict (the default) a logit scale, a rotation or a
    query scale the layer does not have; strict=False runs another encoding on purpose."""
    rope, nope = generated_class("rope"), generated_class("nope")
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(num_hidden_layers=1, **TINY))
    assert "attn_logit_softcapping 50" in _refusal(gemma2, lambda index: rope(4, 8))
    assert "attn_logit_softcapping 50" in _refusal(gemma2, lambda index: rope(4, 8), strict=False)
    gemma3_config = transformers.Gemma3TextConfig(
        num_hidden_layers=1, head_dim=8, query_pre_attn_scalar=12, **TINY
    )
    gemma3 = transformers.Gemma3ForCausalLM(gemma3_config)
    message = _refusal(gemma3, lambda index: rope(4, 8))
    assert "layer 0 scales its logits by 0.288675, encoding(0) by 0.353553" in message
    smol = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(num_hidden_layers=4, **TINY))
    message = _refusal(smol, lambda index: rope(4, 8))
    assert "layer 3 has use_rope 0, but encoding(3) rotates" in message
    assert "layer 0 has use_rope 1, but encoding(0) does not rotate" in _refusal(
        smol, lambda index: nope(4, 8)
    )
    use_posgen_attention(smol, lambda index: rope(4, 8), strict=False)  # on purpose
    llama4_config = transformers.Llama4TextConfig(
        num_hidden_layers=4, head_dim=8, intermediate_size_mlp=64, **TINY
    )
    llama4 = transformers.Llama4ForCausalLM(llama4_config)
    message = _refusal(llama4, lambda index: nope(4, 8) if index == 3 else rope(4, 8))
    assert "layer 3 scales its queries by position" in message
    scout = generated_class("nope_llama4")  # floor_scale 8192, attn_scale 0.1: Scout's
    for floor_scale, attn_scale, at, layer_factor, module_factor in [
        (4, 0.1, 3, "1.06931", "1"),  # another step: the first ends at position 3
        (8192, 0.3, 8191, "1.20794", "1.06931"),  # another growth per step
    ]:
        other = transformers.Llama4TextConfig(
            num_hidden_layers=4, head_dim=8, intermediate_size_mlp=64, floor_scale=floor_scale,
            attn_scale=attn_scale, **TINY,
        )  # fmt: skip
        message = _refusal(
            transformers.Llama4ForCausalLM(other),
            lambda index: scout(4, 8) if index == 3 else rope(4, 8),
        )
        assert (
            f"layer 3 scales its queries by {layer_factor} at position {at} (floor_scale "
            f"{floor_scale}, attn_scale {attn_scale}), encoding(3) by {module_factor}"
        ) in message
    same = transformers.Llama4TextConfig(
        num_hidden_layers=4, head_dim=8, intermediate_size_mlp=64, floor_scale=8192,
        attn_scale=0.1, **TINY,
    )  # fmt: skip
    use_posgen_attention(  # Scout's own settings pass
        transformers.Llama4ForCausalLM(same),
        lambda index: scout(4, 8) if index == 3 else rope(4, 8),
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_runs_while_its_position_axes_agree_and_is_refused_where_they_differ(
    family: str, tmp_path: Path
) -> None:
    """Qwen2.5-VL's and Qwen3-VL's language models rotate by three position axes (text,
    height, width; mrope_section [2, 3, 3] in runs, or [4, 2, 2] dealt out in turn) but
    hand their layers only cos and sin: text, whose axes agree, gives the model's own
    output through its from-hf spec; an image's tokens, whose axes differ, are refused
    rather than rotated by one axis."""
    config_class, model_class, sections = {
        "qwen2_5_vl": (transformers.Qwen2_5_VLTextConfig, transformers.Qwen2_5_VLTextModel,
                       [2, 3, 3]),
        "qwen3_vl": (transformers.Qwen3VLTextConfig, transformers.Qwen3VLTextModel, [4, 2, 2]),
    }[family]  # fmt: skip
    config = config_class(
        rope_scaling={"type": "mrope", "mrope_section": sections}, num_hidden_layers=2,
        **{**TINY, "hidden_size": 64, "head_dim": 16},
    )  # fmt: skip
    config._attn_implementation = "eager"
    mrope = from_hf_class(config.to_dict(), tmp_path, "qwen_vl_positions")
    torch.manual_seed(0)
    model = model_class(config).eval()
    ids = torch.randint(1, 61, (2, 11), generator=torch.Generator().manual_seed(3))
    text = torch.arange(11).expand(3, 2, 11)
    image = text.clone()
    image[1, :, 4:8] -= torch.tensor([0, 0, 1, 1])  # a 2 x 2 grid: rows on axis 1
    image[2, :, 4:8] -= torch.tensor([0, 1, 1, 2])  # columns on axis 2
    with torch.no_grad():
        expected = model(ids, position_ids=text).last_hidden_state
        use_posgen_attention(model, lambda index: mrope())
        got = model(ids, position_ids=text).last_hidden_state
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="3 position axes .M-RoPE: text, height, width"):
            model(ids, position_ids=image)


# families whose layers need nothing beyond Llama's, with what a tiny config must set
PLAIN_FAMILIES = {
    "glm": {"head_dim": 16}, "glm4": {"head_dim": 16}, "helium": {"head_dim": 16},
    "ernie4_5": {"head_dim": 16}, "gemma": {"head_dim": 16}, "cohere": {},
    "granite": {"attention_multiplier": 0.3}, "granitemoe": {}, "starcoder2": {},
    "mistral": {}, "mixtral": {}, "qwen2": {}, "qwen3_moe": {}, "olmoe": {},
}  # fmt: skip


@pytest.mark.parametrize("family", list(PLAIN_FAMILIES))
def test_each_family_runs_with_its_from_hf_spec_under_the_strict_check(
    family: str, tmp_path: Path
) -> None:
    """Half and interleaved pairings (Cohere, GLM, Helium, ERNIE 4.5), partial rotation
    (GLM), logit scales of their own (Granite), mixtures of experts: a left-padded
    batch gives the model's own logits at every kept token through the spec from-hf
    writes, and every layer's rotation passes the check by value."""
    config = transformers.AutoConfig.for_model(
        family, num_hidden_layers=2, **{**TINY, "hidden_size": 64}, **PLAIN_FAMILIES[family]
    )
    config._attn_implementation = "eager"
    own = from_hf_class(config.to_dict(), tmp_path, f"{family}_positions")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 61, (2, 13), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        use_posgen_attention(model, lambda index: own())
        got = model(ids, attention_mask=mask).logits
    assert all(layer.__dict__[UNCHECKED] is None for layer in posgen_layers(model))
    kept = mask.bool()
    torch.testing.assert_close(got[kept], expected[kept], rtol=1e-5, atol=1e-5)


def test_a_multimodal_models_vision_tower_keeps_its_own_attention(tmp_path: Path) -> None:
    """Llama4ForConditionalGeneration: its vision encoder's layers are also ``self_attn``
    with q/k/v/o projections, but bidirectional over patches with 2-D rotations of
    their own. Only the language model's layers are routed (indices 0, 1), its logits
    stay HF's, and the vision tower's output is unchanged."""
    from transformers.models.llama4 import configuration_llama4 as llama4

    text = llama4.Llama4TextConfig(
        num_hidden_layers=2, head_dim=8, intermediate_size_mlp=64, **TINY
    )  # fmt: skip
    vision = llama4.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=32,  # the pixel shuffle's 4 x 32 features into the projector
    )  # fmt: skip
    config = llama4.Llama4Config(text_config=text, vision_config=vision)
    rope = from_hf_class(config.to_dict(), tmp_path, "llama4_text_rope", "--layer", "0")
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(4))
    indices: list[int] = []

    def encoding(index: int) -> torch.nn.Module:
        indices.append(index)
        return rope()

    with torch.no_grad():
        expected = model(ids).logits
        seen_before = model.vision_model(pixels).last_hidden_state
        use_posgen_attention(model, encoding)
        got = model(ids).logits
        seen_after = model.vision_model(pixels).last_hidden_state
    assert indices == [0, 1]
    routed = [name for name, module in model.named_modules() if hasattr(module, "posgen")]
    assert routed and all(name.startswith("language_model.") for name in routed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(seen_after, seen_before)
