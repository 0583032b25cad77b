"""posgen.hf's strict mode (the default) refuses a module that would not give a
Llama-family layer's own positions: by kind when it is attached (a position bias,
relative terms or a query scale the layer does not have), and by value at the layer's
first forward, where the layer's own modeling code and the module rotate a probe into
logits that differ (another base, frequency scaling, pairing or rotated part). The
modules from-hf writes pass; strict=False runs any of them on purpose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from posgen.hf import _kept_positions, use_posgen_attention
from posgen.hf_strict import UNCHECKED, _kept_tokens
from tests.conftest import from_hf_class, generated_class, posgen_layers

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=61, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=2, pad_token_id=0, attn_implementation="eager",
)  # fmt: skip


def _model(config: Any) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _first_forward(model: Any, encoding: Any, **options: bool) -> torch.Tensor:
    ids = torch.randint(1, 61, (2, 11), generator=torch.Generator().manual_seed(3))
    use_posgen_attention(model, encoding, **options)
    with torch.no_grad():
        return model(ids).logits


def _configs() -> dict[str, Any]:
    """Tiny configs whose layers rotate otherwise than ``rope`` (base 10000, half
    pairing, every feature), each by one thing."""
    llama, cohere, stablelm = (
        transformers.LlamaConfig,
        transformers.CohereConfig,
        transformers.StableLmConfig,
    )
    llama4 = transformers.Llama4TextConfig
    return {
        "base": llama(rope_theta=123456.0, **TINY),
        "base one percent off": llama(rope_theta=10100.0, **TINY),
        "linear scaling": llama(rope_scaling={"rope_type": "linear", "factor": 4.0}, **TINY),
        "yarn attention factor": llama(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            max_position_embeddings=256,
            **TINY,
        ),  # fmt: skip
        "interleaved pairing": cohere(**TINY),
        "a quarter rotated": stablelm(**TINY),
        "llama 4's complex pairs": llama4(
            head_dim=8,
            intermediate_size_mlp=64,
            rope_theta=10000.0,
            no_rope_layers=[1, 1],
            **TINY,
        ),  # fmt: skip
    }


@pytest.mark.parametrize("differs", list(_configs()))
def test_a_rotation_that_is_not_the_layers_is_refused_at_the_first_forward(
    differs: str, tmp_path: Path
) -> None:
    """``rope`` on a layer that turns with another base, scaling, pairing or part of
    each head: ValueError at the first forward naming the layer; strict=False runs it;
    the spec from-hf writes for the config passes the check and gives the logits."""
    config = _configs()[differs]
    rope = generated_class("rope")
    with pytest.raises(ValueError, match="layer 0 rotates its keys otherwise than encoding"):
        _first_forward(_model(config), lambda index: rope(4, 8))
    _first_forward(_model(config), lambda index: rope(4, 8), strict=False)
    own = from_hf_class(config.to_dict(), tmp_path, "own_positions")
    model = _model(config)
    ids = torch.randint(1, 61, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    got = _first_forward(model, lambda index: own())
    assert all(layer.__dict__[UNCHECKED] is None for layer in posgen_layers(model))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_check_reads_the_kept_tokens_on_the_masks_diagonal() -> None:
    """Query i's own key slot in HF's 4-D mask tells whether token i is kept, in an
    additive mask (eager) and a bool one (sdpa), and in a static cache's mask, wider
    than the forward, at the slots the queries fill (cache_position). Padded tokens are
    then left out of the comparison: Llama 4 hands its layers no position_ids, so the
    adapter's positions there differ from HF's by more than a constant (covered end to
    end by the Llama 4 generation tests with left padding)."""
    keeps = torch.tensor([[False, True, True, True], [True, True, True, True]])
    slots = torch.arange(2, 6)  # the forward's 4 tokens fill slots 2..5 of 8
    keys = torch.cat(
        [torch.ones(2, 2, dtype=torch.bool), keeps, torch.zeros(2, 2, dtype=torch.bool)], 1
    )
    causal = torch.arange(8)[None, :] <= slots[:, None]  # [N, M]
    allowed = keys[:, None, None, :] & causal  # [B, 1, N, M]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert torch.equal(_kept_tokens(allowed, slots), keeps)
    assert torch.equal(_kept_tokens(additive, slots), keeps)
    assert _kept_tokens(None, slots) is None
    assert _kept_tokens(allowed, torch.arange(7, 11)) is None  # slots past the mask


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("alibi", "adds a position bias"),
        ("bert_relative_key", "adds relative position terms"),
        ("rope_logn", "layer 0 does not scale its queries by position"),
    ],
)
def test_a_position_term_the_layer_does_not_have_is_refused_when_attached(
    name: str, message: str
) -> None:
    cls = generated_class(name)
    model = _model(transformers.LlamaConfig(**TINY))
    with pytest.raises(ValueError, match=message):
        use_posgen_attention(model, lambda index: cls(4, 8))
    use_posgen_attention(model, lambda index: cls(4, 8), strict=False)  # on purpose


def test_no_rotation_on_a_rotary_layer_is_refused_at_the_first_forward() -> None:
    """A Llama layer does not say that it rotates; the cos and sin the model hands it
    do."""
    nope = generated_class("nope")
    with pytest.raises(ValueError, match="layer 0 rotates q and k, but encoding.0. does not"):
        _first_forward(_model(transformers.LlamaConfig(**TINY)), lambda index: nope(4, 8))


def test_kept_positions_read_additive_and_bool_masks_alike() -> None:
    """HF's eager attention gets an additive mask (0 kept, finfo.min masked), its sdpa
    attention a bool one (True kept): the same padding gives the same positions."""
    keeps = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    allowed = (keeps[:, None, None, :] & causal).contiguous()  # [B, 1, N, M]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(_kept_positions(allowed, 5, torch.device("cpu")), expected)
    assert torch.equal(_kept_positions(additive, 5, torch.device("cpu")), expected)


def test_a_model_cast_to_bfloat16_is_not_refused_for_its_own_rounding() -> None:
    """``model.to(torch.bfloat16)`` casts HF's inverse frequencies too, so its own
    angles drift from the float32 rotation (at 3000 positions by more than the check's
    float32 bound): the matching module is not refused."""
    config = transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 1})
    model = _model(config).to(torch.bfloat16)
    rope = generated_class("rope")
    use_posgen_attention(model, lambda index: rope(4, 8).to(torch.bfloat16))
    with torch.no_grad():
        model(torch.randint(1, 61, (1, 3000), generator=torch.Generator().manual_seed(5)))
    assert posgen_layers(model)[0].__dict__[UNCHECKED] is None
