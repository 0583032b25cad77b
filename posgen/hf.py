"""Run a Hugging Face Llama-family model's attention through a posgen module.

``use_posgen_attention(model, encoding)`` swaps the forward of every self-attention layer
of a ``transformers`` Llama-family model (Llama, Mistral, Qwen2 and others whose
attention has ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and receives ``position_ids``):
the projections stay the model's, the positional encoding and the attention are the
posgen module's. With the matching spec (for Llama: ``rope``, half pairing, the model's
``rope_theta``) the logits equal the original model's to float32 rounding; with another
spec the same weights run under another encoding, which is how an idea is tried on a
real architecture.

Keys are cached rotated: a decode step rotates its new keys once (``rotate_keys``) and
attends with ``keys_rotated=True``.

    from transformers import LlamaForCausalLM
    from generated.rope import Rope
    from posgen.hf import use_posgen_attention

    model = LlamaForCausalLM(config)
    use_posgen_attention(model, lambda layer: Rope(heads=..., head_dim=...))

``transformers`` is not a dependency of posgen: this module imports it only through the
model it is given.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def use_posgen_attention(model: nn.Module, encoding: Callable[[int], nn.Module]) -> nn.Module:
    """Route every attention layer of ``model`` through ``encoding(layer_index)``.

    ``encoding`` builds one posgen module per layer (call it with the layer index; return
    the same module for every layer to share one). Returns ``model``, changed in place;
    the modules become submodules ``self_attn.posgen`` (so ``.to()`` moves them).
    """
    layers = _attention_layers(model)
    if not layers:
        raise ValueError("no attention layer with q_proj, k_proj, v_proj and o_proj found")
    for index, attention in enumerate(layers):
        attention.posgen = encoding(index)
        attention.forward = types.MethodType(_posgen_attention_forward, attention)
    return model


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention layers, in order."""
    wanted = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [
        module
        for name, module in model.named_modules()
        if name.endswith("self_attn") and all(hasattr(module, part) for part in wanted)
    ]


def _posgen_attention_forward(
    self: Any,
    hidden_states: Tensor,
    position_embeddings: Any = None,
    attention_mask: Tensor | None = None,
    past_key_values: Any = None,
    cache_position: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention of a Llama-family layer with posgen's encoding and attention.

    hidden_states: [B, N, hidden]; HF's own cos/sin (``position_embeddings``) are not
    used: the posgen module forms its position terms from ``position_ids``.
    """
    batch, n = hidden_states.shape[:2]
    shape = (batch, n, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H, N, D]
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H_kv, N, D]
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # [B, H_kv, N, D]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = cache_position if cache_position is not None else torch.arange(n)
    positions = positions.to(hidden_states.device)  # [N] or [B, N]
    k = self.posgen.rotate_keys(k, positions)  # rotated once, then cached rotated
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx, {"cache_position": cache_position})
    m = k.shape[2]
    mask = None
    if attention_mask is not None:  # HF's 4-D mask: padding (and causal) per key
        mask = attention_mask[:, :, :, :m]
    out = self.posgen(
        q,
        k,
        v,
        q_positions=positions,
        k_positions=positions if m == n else torch.arange(m, device=q.device),
        causal=True,
        attn_mask=mask,
        keys_rotated=True,
    )  # [B, H, N, D]
    out = out.transpose(1, 2).reshape(batch, n, -1)
    return self.o_proj(out), None
