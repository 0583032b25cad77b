"""posgen from-hf on the families whose modeling code decides what the config leaves unsaid:
the pairing (GPT-J, Cohere, Llama 4 pair neighbours), layers of several kinds (Llama 4,
SmolLM3, Gemma 3, Cohere 2: ``--layer``), a logit scale of their own (Gemma), and the
settings no spec states (soft-capping, latent attention). Each spec is checked against
Hugging Face's own layers or rotary functions (whole models run through posgen.hf with
these specs: test_hf_adapter_families.py)."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from posgen.cli import main
from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.spec.loader import load_spec
from posgen.spec.model import Spec
from posgen.spec.model.query_scale import FloorLogQueryScale
from tests.conftest import from_hf_class, from_hf_spec, llama4_layer_and_module

transformers = pytest.importorskip("transformers")

F64 = torch.float64
LLAMA4_TEXT = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_hidden_layers=8, attention_chunk_size=4, floor_scale=4, attn_scale=0.3,
    rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
)  # fmt: skip


_PROBES = itertools.count()


def _invoke(config: dict[str, Any], tmp_path: Path, *options: str) -> Any:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return CliRunner().invoke(main, ["from-hf", str(path), *options])


def _spec(config: dict[str, Any], tmp_path: Path, *options: str) -> Spec:
    return load_spec(from_hf_spec(config, tmp_path, f"probe_{next(_PROBES)}", *options)).spec


def _llama4_config() -> Any:
    """The multimodal Llama 4 config (from-hf reads its text_config): layers 3 and 7 are
    NoPE, the others rotate with Scout's llama3 scaling (low and high factors equal)."""
    config = transformers.Llama4Config(text_config=LLAMA4_TEXT)
    config.text_config._attn_implementation = "eager"
    return config


def test_llama4_layers_differ_and_the_message_lists_them(tmp_path: Path) -> None:
    result = _invoke(_llama4_config().to_dict(), tmp_path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "RoPE on layers 0, 1, 2, 4, 5, 6; NoPE on layers 3, 7" in result.output
    assert "choose one with --layer INDEX" in result.output
    result = _invoke(_llama4_config().to_dict(), tmp_path, "--layer", "8")
    assert result.exit_code == 2 and "--layer 8: the config has 8 layers (0 to 7)" in result.output


def test_a_llama4_rope_layer_gives_hugging_faces_attention(tmp_path: Path) -> None:
    """Layer 0 of a Llama 4: interleaved pairs, llama3 scaling with equal factors (one cut),
    QK L2 norm and chunked attention applied as the spec's notes say (normalise q and k
    first, document_ids = positions // chunk): Llama4TextAttention's output in float64."""
    from transformers.models.llama4.modeling_llama4 import (
        Llama4TextAttention,
        Llama4TextRotaryEmbedding,
    )

    config = _llama4_config()
    spec_path = from_hf_spec(config.to_dict(), tmp_path, "llama4_rope", "--layer", "0")
    notes = spec_path.read_text("utf-8")
    assert "document_ids=positions // 4" in notes and "so apply it" in notes
    rotate = load_spec(spec_path).spec.rotation
    assert rotate is not None and rotate.pairing == "interleaved"
    assert rotate.frequencies.kind == "llama3" and rotate.frequencies.high_freq_factor == 1.0
    cls = encoding_class(module_from_spec(spec_path))
    pe = cls().double()
    text = config.text_config
    expected_frequencies = Llama4TextRotaryEmbedding(text).inv_freq
    frequencies = sys.modules[cls.__module__]._inverse_frequencies(8, None, torch.device("cpu"))
    torch.testing.assert_close(frequencies, expected_frequencies.double(), rtol=2e-7, atol=0)
    layer = Llama4TextAttention(text, layer_idx=0).double().eval()
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 32, dtype=F64)
    positions = torch.arange(8190, 8197)  # past the cut: long waves turn 16 times slower
    query, key = positions[:, None], positions[None, :]
    allowed = (key <= query) & (key // 4 == query // 4)
    mask = torch.zeros(7, 7, dtype=F64).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        freqs = Llama4TextRotaryEmbedding(text)(hidden, positions[None].expand(2, -1))
    expected, got = llama4_layer_and_module(
        layer, pe, hidden, positions, mask, freqs, document_ids=positions // 4
    )
    # Hugging Face turns the pairs in float32 (torch.polar of float32 angles near 8190)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_llama4_nope_layer_gives_the_configs_temperature_tuning(tmp_path: Path) -> None:
    """Layer 3: ``nope_llama4`` with the config's floor_scale 4 and attn_scale 0.3, against
    Llama4TextAttention on that layer (no rotation, no QK norm), float64; without
    attn_temperature_tuning the layer is plain NoPE."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    config = _llama4_config()
    spec = _spec(config.to_dict(), tmp_path, "--layer", "3")
    assert spec.query_scale is not None and spec.rotation is None
    assert (spec.query_scale.floor_scale, spec.query_scale.attn_scale) == (4, 0.3)  # type: ignore[union-attr]
    pe = from_hf_class(config.to_dict(), tmp_path, "llama4_nope", "--layer", "3")().double()
    layer = Llama4TextAttention(config.text_config, layer_idx=3).double().eval()
    hidden = torch.randn(2, 6, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(1, 7)  # tau steps at positions 3 and 7 (floor 4)
    mask = torch.full((6, 6), float("-inf"), dtype=F64).triu(1)[None, None]
    expected, got = llama4_layer_and_module(layer, pe, hidden, positions, mask)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)
    untuned = {**config.to_dict()}
    untuned["text_config"] = {**untuned["text_config"], "attn_temperature_tuning": False}
    assert _spec(untuned, tmp_path, "--layer", "3").query_scale is None


@pytest.mark.parametrize(
    ("stated", "query_scale"),
    [
        ({"attn_temperature_tuning": 4}, (4, 0.3)),  # Llama 4 Scout's config: truthy
        ({"attn_temperature_tuning": 0}, None),
        ({"floor_scale": 4.0}, (4, 0.3)),  # an integral float, as HF divides by it
        ({"floor_scale": 8.0, "attn_scale": 0.1}, (8, 0.1)),
        ({"attn_scale": 0}, None),  # a factor of exactly 1: plain NoPE
    ],
)
def test_llama4_temperature_settings_are_read_as_hugging_face_reads_them(
    stated: dict[str, Any], query_scale: tuple[int, float] | None, tmp_path: Path
) -> None:
    """The NoPE layer's spec from a multimodal config whose text_config states these
    (floor_scale 4 and attn_scale 0.3 otherwise): HF tests attn_temperature_tuning
    for truth and divides by floor_scale, so 4 is on, 0 off, 4.0 is 4."""
    config = {"model_type": "llama4", "text_config": {**LLAMA4_TEXT, **stated}}
    got = _spec(config, tmp_path, "--layer", "3").query_scale
    if query_scale is None:
        assert got is None
    else:
        assert isinstance(got, FloorLogQueryScale)
        assert (got.floor_scale, got.attn_scale) == query_scale
        assert type(got.floor_scale) is int


def test_smollm3_and_cohere2_layers_take_their_kind(tmp_path: Path) -> None:
    """SmolLM3 rotates halves with its own default base 2·10^6 except on every 4th layer;
    Cohere 2 rotates neighbours on its sliding layers and nothing on its full ones (their
    logits through posgen.hf: test_hf_adapter_families.py)."""
    smol = transformers.SmolLM3Config(num_hidden_layers=4, hidden_size=32, num_attention_heads=4)
    rotation = _spec(smol.to_dict(), tmp_path, "--layer", "1").rotation
    assert rotation is not None and rotation.base == 2e6 and rotation.pairing == "half"
    assert _spec(smol.to_dict(), tmp_path, "--layer", "3").rotation is None
    cohere2 = transformers.Cohere2Config(num_hidden_layers=4, hidden_size=32, num_attention_heads=4)
    rotation = _spec(cohere2.to_dict(), tmp_path, "--layer", "0").rotation
    assert rotation is not None and rotation.pairing == "interleaved"
    assert _spec(cohere2.to_dict(), tmp_path, "--layer", "3").rotation is None


@pytest.mark.parametrize("layer", [0, 5])
def test_gemma3_layers_take_their_base_scaling_and_logit_scale(layer: int, tmp_path: Path) -> None:
    """Gemma 3: sliding layer 0 turns with rope_local_base_freq and no scaling, full layer 5
    with rope_theta and linear scaling 8; the logits are scaled by query_pre_attn_scalar^-1/2.
    The spec's logits equal Hugging Face's rotated q·kᵀ times the layer's scaling."""
    from transformers.models.gemma3.modeling_gemma3 import (
        Gemma3Attention,
        Gemma3TextModel,
        apply_rotary_pos_emb,
    )

    config = transformers.Gemma3TextConfig(
        vocab_size=61, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, query_pre_attn_scalar=24,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_implementation="eager",
    )  # fmt: skip
    spec_path = from_hf_spec(config.to_dict(), tmp_path, f"gemma3_{layer}", "--layer", str(layer))
    assert ("window=4096" in spec_path.read_text("utf-8")) == (layer == 0)
    pe = encoding_class(module_from_spec(spec_path))().double()
    model = Gemma3TextModel(config).double()
    rotary = model.rotary_emb_local if layer == 0 else model.rotary_emb
    scaling = Gemma3Attention(config, layer).scaling
    q, k = torch.randn(2, 2, 4, 9, 16, dtype=F64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(9) * 211  # long waves differ by the factor 8 between layers
    with torch.no_grad():
        cos, sin = rotary(q, positions[None])
        q_rotated, k_rotated = apply_rotary_pos_emb(q, k, cos, sin)
        expected = q_rotated @ k_rotated.transpose(-1, -2) * scaling
        got = pe.scores(q, k, q_positions=positions, k_positions=positions)
    assert scaling == pytest.approx(24**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gptj_rotates_its_rotary_dim_in_neighbouring_pairs(tmp_path: Path) -> None:
    """GPT-J: rotary_dim 16 of each 64-feature head, pairs 2k and 2k + 1, base 10000,
    as modeling_gptj's apply_rotary_pos_emb turns them (from its float32 sin/cos table:
    angles up to 370 rad carry float32's rounding, ~2e-5)."""
    from transformers.models.gptj.modeling_gptj import (
        apply_rotary_pos_emb,
        create_sinusoidal_positions,
    )

    config = transformers.GPTJConfig(n_embd=256, n_head=4, rotary_dim=16)
    rotate = _spec(config.to_dict(), tmp_path).rotation
    assert rotate is not None and rotate.rotary_dims.fraction == 0.25
    pe = from_hf_class(config.to_dict(), tmp_path, "gptj_positions")().double()
    x = torch.randn(2, 11, 4, 64, dtype=F64, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(11) * 37
    sincos = create_sinusoidal_positions(500, 16).double()[positions][None]  # [1, N, 16]
    sin, cos = torch.split(sincos, 8, dim=-1)
    expected = x.clone()
    expected[..., :16] = apply_rotary_pos_emb(x[..., :16], sin, cos)
    got, _ = pe.rotate(x, x, positions, positions, layout="bnhd")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gpt_neox_turns_by_rotary_emb_base_over_a_truncated_width(tmp_path: Path) -> None:
    """GPT-NeoX reads rotary_emb_base and rotary_pct (its configuration class copies them
    over rope_theta and partial_rotary_factor, which agree here) and rotates int(64 *
    0.42) = 26 features with frequencies over 26, where 64 * 0.42 rounds to 27: posgen's
    spec states the fraction of those 26, and turns as modeling_gpt_neox does."""
    from transformers.models.gpt_neox.modeling_gpt_neox import (
        GPTNeoXRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = transformers.GPTNeoXConfig(
        hidden_size=256, num_attention_heads=4, rotary_pct=0.42, rotary_emb_base=5e4
    )
    rotate = _spec(config.to_dict(), tmp_path).rotation
    assert rotate is not None and rotate.base == 5e4
    assert rotate.rotary_dims.fraction == 26 / 64
    pe = from_hf_class(config.to_dict(), tmp_path, "gpt_neox_positions")().double()
    generator = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 4, 9, 64, dtype=F64, generator=generator) for _ in "qk")
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [3, 5, 8, 13, 21, 34, 55, 89, 144]])
    rotary = GPTNeoXRotaryEmbedding(config).double()
    cos, sin = rotary(q, positions)
    assert cos.shape[-1] == 26
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = pe.rotate(q, k, positions, positions)
    # HF's angles are float32 (inv_freq @ positions in float32): ~2e-6 at position 144
    torch.testing.assert_close(got_q, expected_q, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(got_k, expected_k, rtol=1e-4, atol=2e-5)


LLAMA_LIKE = {"num_attention_heads": 4, "hidden_size": 64, "rope_theta": 1e4}
REFUSED = [
    ({"model_type": "newlm", **LLAMA_LIKE}, (), "pass --pairing half"),
    ({"model_type": "cohere", **LLAMA_LIKE}, ("--pairing", "half"), "cohere pairs interleaved"),
    ({"model_type": "deepseek_v3", **LLAMA_LIKE}, (), "multi-head latent attention"),
    ({"model_type": "gpt_oss", **LLAMA_LIKE}, (), "attention sinks: a learned logit per head"),
    ({"model_type": "gemma2", **LLAMA_LIKE, "attn_logit_softcapping": 50.0}, (), "caps its logits"),
    ({"model_type": "falcon", **LLAMA_LIKE, "alibi": True}, (), "Falcon's own slopes"),
    ({"model_type": "llama", **LLAMA_LIKE, "num_hidden_layers": 2}, ("--layer", "2"),
     "--layer 2: the config has 2 layers (0 to 1)"),
    ({"model_type": "smollm3", **LLAMA_LIKE, "num_hidden_layers": 4, "no_rope_layers": [1, 1]},
     ("--layer", "0"), "no_rope_layers: lists 2 layers, num_hidden_layers is 4"),
    ({"model_type": "smollm3", **LLAMA_LIKE, "no_rope_layers": [1, 2]}, ("--layer", "0"),
     "no_rope_layers: must be a non-empty list of 0s and 1s, got [1, 2]"),
    ({"model_type": "smollm3", **LLAMA_LIKE}, ("--layer", "0"), "num_hidden_layers: missing"),
    ({"model_type": "cohere2", **LLAMA_LIKE, "layer_types": ["sliding_attention", "x"]},
     ("--layer", "0"), "layer_types[1]: must be one of"),
    ({"model_type": "gptj", "n_head": 4, "n_embd": 64, "rotary_dim": 7}, (),
     "rotary_dim: must be even and at most head_dim 16, got 7"),
    ({"model_type": "newlm", **LLAMA_LIKE, "layer_types": ["sliding_attention", "full_attention"]},
     ("--pairing", "half"), "layers of several kinds"),
    ({"model_type": "newlm", **LLAMA_LIKE, "attention_multiplier": 0.01}, ("--pairing", "half"),
     "attention_multiplier: model_type 'newlm' sets it (a logit scale of its own)"),
    ({"model_type": "newlm", **LLAMA_LIKE, "qk_rope_head_dim": 64}, ("--pairing", "half"),
     "qk_rope_head_dim: model_type 'newlm' sets it (latent attention"),
    ({"model_type": "gemma2", **LLAMA_LIKE}, (), "attn_logit_softcapping 50: the model caps"),
    ({"relative_attention_num_buckets": 32, "num_heads": 8}, ("--pairing", "half"),
     "does not rotate"),
    ({"model_type": "gemma3_text", **LLAMA_LIKE, "num_hidden_layers": 1,
      "query_pre_attn_scalar": 1e-5}, (), "scale.factor is in [0.001, 1000]"),
    # GPT-NeoX's configuration class copies rotary_emb_base and rotary_pct over these
    ({"model_type": "gpt_neox", **LLAMA_LIKE, "rope_theta": 5e4}, (),
     "rope_theta: 50000 is not the base this family's modeling code turns by, "
     "rotary_emb_base (10000)"),
    ({"model_type": "gpt_neox", **LLAMA_LIKE, "rotary_pct": 0.25, "partial_rotary_factor": 0.5},
     (), "partial_rotary_factor: 0.5 is not the rotated share"),
    # GPT-J's create_sinusoidal_positions: base 10000, no scaling
    ({"model_type": "gptj", "n_head": 4, "n_embd": 256, "rotary_dim": 16, "rope_theta": 5e4},
     (), "rope_theta: 50000 is not the base this family's modeling code turns by, 10000"),
    ({"model_type": "codegen", "n_head": 4, "n_embd": 256, "rotary_dim": 16,
      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, (),
     "rope_scaling: this family's modeling code applies no scaling"),
    # int(64 * 0.4) = 25 features, frequencies over a width of 25
    ({"model_type": "phi", **LLAMA_LIKE, "hidden_size": 256, "partial_rotary_factor": 0.4}, (),
     "partial_rotary_factor: 0.4 of head_dim 64 is 25.6 features, of which Hugging Face "
     "rotates int() = 25"),
    # Qwen2-VL's code lays M-RoPE's sections in runs and Qwen3-VL's deals them out,
    # whatever mrope_interleaved says
    ({"model_type": "qwen2_vl", **LLAMA_LIKE, "rope_scaling": {"rope_type": "default",
      "mrope_section": [4, 2, 2], "mrope_interleaved": True}}, (),
     "rope_scaling.mrope_interleaved: true, but this family's modeling code lays them in "
     "runs"),
    ({"model_type": "qwen3_vl_text", **LLAMA_LIKE, "rope_scaling": {"rope_type": "default",
      "mrope_section": [4, 2, 2], "mrope_interleaved": False}}, (),
     "rope_scaling.mrope_interleaved: false, but this family's modeling code deals them out"),
    # Llama 4's temperature settings, named where a multimodal config holds them
    ({"model_type": "llama4", "text_config": {**LLAMA_LIKE, "num_hidden_layers": 4,
      "attn_temperature_tuning": "false"}}, ("--layer", "3"),
     "text_config.attn_temperature_tuning: must be true, false or an integer (0: false), "
     'as Hugging Face tests its truth, got "false"'),
    ({"model_type": "llama4", "text_config": {**LLAMA_LIKE, "num_hidden_layers": 4,
      "floor_scale": 4.5}}, ("--layer", "3"),
     "text_config.floor_scale: 4.5 is not a whole number; Hugging Face's temperature steps "
     "at floor((i + 1) / 4.5)"),
    ({"model_type": "llama4", "text_config": {**LLAMA_LIKE, "num_hidden_layers": 4,
      "no_rope_layers": [1, 1]}}, ("--layer", "0"),
     "text_config.no_rope_layers: lists 2 layers, text_config.num_hidden_layers is 4"),
    ({"model_type": "llama4", "text_config": {**LLAMA_LIKE, "num_hidden_layers": 4,
      "rope_scaling": {"rope_type": "llama3", "factor": "4"}}}, ("--layer", "0"),
     'text_config.rope_scaling.factor: must be a finite positive number, got "4"'),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(REFUSED)))
def test_what_from_hf_cannot_state_is_refused_by_name(index: int, tmp_path: Path) -> None:
    """Exit 2 with one message naming the setting; nothing printed on stdout."""
    config, options, message = REFUSED[index]
    result = _invoke(config, tmp_path, *options)
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert result.stdout == "" and "Traceback" not in result.output


def test_families_fill_in_their_own_defaults_and_pairing(tmp_path: Path) -> None:
    """A hand-written config that leaves keys out takes the family's defaults (GLM rotates
    half of each head, interleaved; Mixtral's base is 10^6); an unknown family rotates
    with the stated --pairing; Granite's attention_multiplier becomes the scale; Llama 4
    scales with llama3 whatever its rope_type says, as Llama4TextRotaryEmbedding does."""
    glm = _spec({"model_type": "glm", **LLAMA_LIKE}, tmp_path).rotation
    assert glm is not None and glm.pairing == "interleaved" and glm.rotary_dims.fraction == 0.5
    mixtral = {"model_type": "mixtral", "num_attention_heads": 4, "hidden_size": 64}
    assert _spec(mixtral, tmp_path).rotation.base == 1e6  # type: ignore[union-attr]
    stated = _spec({"model_type": "newlm", **LLAMA_LIKE}, tmp_path, "--pairing", "interleaved")
    assert stated.rotation is not None and stated.rotation.pairing == "interleaved"
    scout = {**LLAMA4_TEXT["rope_scaling"], "rope_type": "linear"}  # type: ignore[dict-item]
    llama4 = {
        "model_type": "llama4_text",
        **LLAMA_LIKE,
        "no_rope_layers": [1],
        "rope_scaling": scout,
    }
    rotation = _spec(llama4, tmp_path).rotation  # Hugging Face's Llama 4 reads llama3 keys
    assert rotation is not None and rotation.frequencies.kind == "llama3"
    granite = _spec(
        {"model_type": "granite", **LLAMA_LIKE, "attention_multiplier": 0.125}, tmp_path
    )
    head_dim = granite.defaults.head_dim
    assert 1 / math.sqrt(granite.scale.factor * head_dim) == pytest.approx(0.125, rel=1e-15)


def test_keys_a_config_leaves_out_take_the_configuration_classs_defaults(tmp_path: Path) -> None:
    """As Hugging Face's configuration classes fill them in: Gemma's and Llama 4's
    head_dim (256, 128) rather than hidden_size // heads, Gemma 3's 8 heads, Cohere 2's
    sliding window of 4096 (its sliding layers rotate; a null window: no layer does),
    Gemma 2's soft-capping of 50 (null: none), Llama 4's empty no_rope_layers (the
    every-4th default) and a text_config without its model_type."""
    gemma = _spec({"model_type": "gemma", **LLAMA_LIKE}, tmp_path)
    assert (gemma.defaults.heads, gemma.defaults.head_dim) == (4, 256)
    gemma3_text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6}
    gemma3 = _spec(gemma3_text, tmp_path, "--layer", "5")
    assert (gemma3.defaults.heads, gemma3.defaults.head_dim) == (8, 256)
    cohere2 = {"model_type": "cohere2", **LLAMA_LIKE, "num_hidden_layers": 4}
    assert _spec(cohere2, tmp_path, "--layer", "0").rotation is not None
    no_window = _spec({**cohere2, "sliding_window": None}, tmp_path)  # one kind: no --layer
    assert no_window.rotation is None
    assert _spec({"model_type": "gemma2", **LLAMA_LIKE, "attn_logit_softcapping": None}, tmp_path)
    scout = {**LLAMA4_TEXT, "no_rope_layers": []}
    untyped = {"model_type": "llama4", "text_config": scout}  # no text_config.model_type
    nope = _spec(untyped, tmp_path, "--layer", "3")
    assert nope.rotation is None and nope.query_scale is not None
    rope = _spec(untyped, tmp_path, "--layer", "2").rotation
    assert rope is not None and rope.pairing == "interleaved"


def test_posgen_check_confirms_every_claim_a_from_hf_spec_states(tmp_path: Path) -> None:
    """from-hf states only the claims that hold for any sizes: at 16-wide heads and base
    10^4 RoFormer's decay bound breaks, so decay is measured rather than claimed; the
    NoPE layer with Llama 4's temperature tuning keeps nope_llama4's claims."""
    gemma3 = transformers.Gemma3TextConfig(
        num_hidden_layers=6, hidden_size=64, num_attention_heads=4, head_dim=16
    )
    specs = [
        from_hf_spec(gemma3.to_dict(), tmp_path, "gemma3_local", "--layer", "0"),
        from_hf_spec(_llama4_config().to_dict(), tmp_path, "llama4_nope", "--layer", "3"),
    ]
    assert load_spec(specs[0]).spec.claims.decay is None
    result = CliRunner().invoke(main, ["check", *map(str, specs), "--max-examples", "20"])
    assert result.exit_code == 0, result.output
    assert "2 specs checked" in result.output and "all claims hold" in result.output


def test_a_sliding_window_is_noted_where_the_model_uses_it(tmp_path: Path) -> None:
    """Mistral's sliding_window becomes a note with the module argument; Qwen2 with
    use_sliding_window false gets none."""
    mistral = {"model_type": "mistral", **LLAMA_LIKE, "sliding_window": 4096}
    text = from_hf_spec(mistral, tmp_path, "mistral_positions").read_text("utf-8")
    assert text.startswith("# where the model attends a sliding window of 4096 keys")
    assert "window=4096" in text
    qwen = {
        "model_type": "qwen2",
        **LLAMA_LIKE,
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    assert "window" not in from_hf_spec(qwen, tmp_path, "qwen_positions").read_text("utf-8")
