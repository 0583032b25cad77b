"""Run a Hugging Face model's attention through a posgen module.

``use_posgen_attention(model, encoding)`` swaps the forward of every self-attention layer
of a ``transformers`` model of a supported family; the projections stay the model's, the
positional encoding and the attention are the posgen module's. With the matching spec
the logits equal the original model's to float32 rounding; with another spec the same
weights run under another encoding, which is how an idea is tried on a real
architecture. The families, found by the layers' structure or class:

- Llama family (Llama, Mistral, Qwen2 and others whose ``self_attn`` has
  ``q_proj``/``k_proj``/``v_proj``/``o_proj``): matching spec ``rope`` (half pairing,
  the model's ``rope_theta``), or the layer's spec from ``posgen from-hf``. Positions
  are the ``position_ids`` the layer receives, or, where the model hands its layers
  none (Llama 4, Cohere 2), those the model's rotary embedding module turned into the
  layers' cos and sin (a forward hook keeps them), so packed documents and
  ``generate``'s chunked prefill rotate as HF does; Llama 4's NoPE layers scale their
  queries by ``cache_position``, as HF's temperature tuning does. Keys are cached
  rotated: a decode step rotates its new keys once (``rotate_keys``) and attends with
  ``keys_rotated=True``. The layer's own query and key norms are applied before the
  module (``q_norm``/``k_norm`` per head as Qwen3 and Gemma 3 do, or over the whole
  projection as OLMo 2 and OLMoE do; StableLM's ``qk_layernorm``, a LayerNorm per
  head; Llama 4's ``qk_norm``, which the model applies after rotating, is the same
  before it: a rotation keeps the norm), and so is OLMo's and OLMoE's ``clip_qkv`` (q,
  k and v clamped after any such norm). Sliding windows and Llama 4's chunks arrive in
  HF's 4-D mask. M-RoPE models (Qwen2-VL, Qwen3-VL) run while their three position
  axes agree (text): HF hands a layer only the axes' cos and sin, so a forward whose
  axes differ is refused. What the adapter cannot reproduce is refused by
  ``use_posgen_attention`` (logit soft-capping), and so, with ``strict``, is a module
  that would not give the layer's own positions: by kind when attached, and by value
  at the layer's first forward, where its rotation must match the layer's own modeling
  code (``posgen.hf_strict``). Attention dropout in training (``attention_dropout``
  above 0) and ``output_attentions`` are refused at the forward, as BLOOM's are. Keys
  from the cache are numbered back from the last query that is not padding over the
  keys the mask keeps, so a window's cache, which drops the oldest keys, and a window
  that masks them give them their own positions.
- BLOOM (``BloomAttention``: fused ``query_key_value`` laid out [.., heads, 3,
  head_dim], ``dense`` output): matching spec ``alibi`` (``generated.alibi.Alibi`` with
  the model's head count; BLOOM's slopes are ALiBi's for every head count). The model's
  own ``alibi`` tensor is not used: BLOOM adds ``slope * p_j`` for key position ``p_j``,
  which differs from ALiBi's ``-slope * (p_i - p_j)`` by ``slope * p_i``, a constant per
  query row that softmax cancels. Positions count the tokens the 2-D attention mask
  keeps, as BLOOM's do (read from the last row of the 4-D mask the layer receives), so
  left, right and inner padding match; attention dropout in training, ``head_mask`` and
  ``output_attentions`` are refused.

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
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posgen.hf_strict import (
    UNCHECKED,
    check_first_forward,
    check_llama_family_layer,
    kept_by_mask,
)

SUPPORTED = "Llama-family self_attn (q_proj, k_proj, v_proj, o_proj) or BLOOM's BloomAttention"


def use_posgen_attention(
    model: nn.Module, encoding: Callable[[int], nn.Module], *, strict: bool = True
) -> nn.Module:
    """Route every attention layer of ``model`` through ``encoding(layer_index)``; a
    multimodal model's vision or audio tower keeps its own attention (the layer index
    counts the language model's layers).

    ``encoding`` builds one posgen module per layer (call it with the layer index; return
    the same module for every layer to share one). Returns ``model``, changed in place;
    the modules become submodules ``posgen`` of each attention layer (``self_attn.posgen``
    or ``self_attention.posgen``, so ``.to()`` moves them). Raises ValueError when the
    model has no attention layer of a supported family, when a module's ``head_dim``
    (or, for BLOOM, its head count) differs from the layer's, or when a layer caps its
    logits (Gemma 2).
    With ``strict`` (the default) it also refuses a module whose kind of positions is not
    the layer's: a logit scale other than the layer's where the layer's is not
    1/sqrt(head_dim) (Gemma, Granite), a rotation on a layer without positions or none
    on a rotary layer (where the layer says: SmolLM3's and Llama 4's ``use_rope``,
    Cohere 2's full layers), a position bias, relative or value-side terms, and a query
    scale by position the layer does not have (or none where Llama 4's temperature
    tuning has one). A strictly attached layer's first forward outside torch.compile
    then compares the module's rotation with the layer's own by value and raises
    ValueError where another base, scaling, pairing or rotated part would change the
    logits (``posgen.hf_strict``, which says what it cannot see); take each layer's
    spec from ``posgen from-hf``. ``strict=False`` runs another encoding on the model's
    weights on purpose.
    """
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(
            f"no attention layer posgen.hf supports in {type(model).__name__}: it routes "
            f"{SUPPORTED}"
        )
    for index, (attention, forward) in enumerate(layers):
        module = encoding(index)
        _check_encoding(attention, module, index, strict)
        attention.posgen = module
        attention.forward = types.MethodType(forward, attention)
    rotary_layers = [layer for layer, forward in layers if forward is _posgen_attention_forward]
    _watch_rotary_embeddings(model, rotary_layers)
    return model


def _attention_layers(model: nn.Module) -> list[tuple[nn.Module, Callable[..., Any]]]:
    """The model's self-attention layers, in order, each with its posgen forward; a
    multimodal model's vision or audio tower (``_in_a_tower``) keeps its own."""
    wanted = ("q_proj", "k_proj", "v_proj", "o_proj")
    layers: list[tuple[nn.Module, Callable[..., Any]]] = []
    for name, module in model.named_modules():
        if _in_a_tower(name):
            continue
        if _is_bloom_attention(module):
            layers.append((module, _posgen_bloom_attention_forward))
        elif name.endswith("self_attn") and all(hasattr(module, part) for part in wanted):
            layers.append((module, _posgen_attention_forward))
    return layers


_TOWER_PREFIXES = ("vision", "visual", "audio", "image", "video", "speech")


def _in_a_tower(name: str) -> bool:
    """Whether the submodule ``name`` lies in a multimodal model's encoder of another
    modality (Llama 4's and Mllama's ``vision_model``, Qwen-VL's ``visual``, LLaVA's and
    Gemma 3's ``vision_tower``, ``audio_tower``): its layers, bidirectional over patches
    with 2-D rotations of their own and another forward signature, are no decoder's."""
    return any(part.startswith(_TOWER_PREFIXES) for part in name.split("."))


def _is_bloom_attention(module: nn.Module) -> bool:
    """A ``transformers`` BloomAttention (or a subclass of it)."""
    return any(cls.__name__ == "BloomAttention" for cls in type(module).__mro__)


def _check_encoding(attention: nn.Module, module: nn.Module, index: int, strict: bool) -> None:
    """ValueError when the posgen module cannot serve the layer (with ``strict``: when it
    would not reproduce the layer's own positions)."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"encoding({index}) must return an nn.Module, got {type(module).__name__}")
    if not _is_bloom_attention(attention):
        check_llama_family_layer(attention, module, index, strict)
    layer_dim, module_dim = getattr(attention, "head_dim", None), getattr(module, "head_dim", None)
    if layer_dim is not None and module_dim is not None and layer_dim != module_dim:
        raise ValueError(
            f"layer {index} has head_dim {layer_dim}, encoding({index}) has head_dim {module_dim}"
        )
    layer_heads, module_heads = (
        getattr(attention, "num_heads", None),
        getattr(module, "heads", None),
    )
    if (
        _is_bloom_attention(attention)
        and module_heads is not None
        and layer_heads is not None
        and layer_heads != module_heads
    ):
        raise ValueError(
            f"layer {index} has {layer_heads} heads, encoding({index}) has {module_heads}"
        )


def _projected(layer: Any, part: str, hidden_states: Tensor) -> Tensor:
    """[B, H, N, D]: the layer's ``q``/``k``/``v`` projection of hidden_states [B, N,
    hidden], normalised and clipped as the layer does it, in its order: a
    ``q_norm``/``k_norm`` as wide as the projection (OLMo 2, OLMoE) before the heads are
    split; OLMo's ``clip_qkv``, q, k and v clamped to [-clip, clip]; a norm as wide as a
    head (Qwen3, Gemma 3) or Llama 4's weightless ``qk_norm`` (q and k of its RoPE
    layers) on the split heads; StableLM's ``q_layernorm``/``k_layernorm`` (a LayerNorm
    per head, ``qk_layernorm``) on [B, H, N, D]; Falcon-H1's keys times its
    ``key_multiplier``."""
    batch, n = hidden_states.shape[:2]
    x = getattr(layer, f"{part}_proj")(hidden_states)  # [B, N, heads * D]
    norm = getattr(layer, f"{part}_norm", None)
    if norm is None and part != "v":
        norm = getattr(layer, "qk_norm", None)
    weight = getattr(norm, "weight", None)
    whole = isinstance(weight, Tensor) and weight.shape[-1] == x.shape[-1] != layer.head_dim
    if norm is not None and whole:
        x = norm(x)
    clip = getattr(getattr(layer, "config", None), "clip_qkv", None)
    if clip is not None:
        x = x.clamp(-clip, clip)
    x = x.view(batch, n, -1, layer.head_dim)  # [B, N, heads, D]
    if norm is not None and not whole:
        x = norm(x)
    x = x.transpose(1, 2)  # [B, heads, N, D]
    per_head = getattr(layer, f"{part}_layernorm", None) if part != "v" else None
    x = x if per_head is None else per_head(x)
    multiplier = getattr(layer, "key_multiplier", None) if part == "k" else None
    return x if multiplier is None else x * multiplier  # Falcon-H1's keys


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
    used: the posgen module forms its position terms from ``position_ids``, the layer's
    own, or where the model hands its layers none (Llama 4, Cohere 2) those its rotary
    embedding module made ``position_embeddings`` from (``_rotary_positions``), else
    ``cache_position``; a Llama 4 NoPE layer that tunes its temperature numbers its
    queries by ``cache_position``, as HF's temperature does (``_temperature_by_slot``).
    Masking is HF's: its 4-D mask where the layer gets one (it holds the causal part,
    windows and chunks, as HF's own attention reads it), else causal attention by token
    order (HF's SDPA layers get no mask without padding): by position where each row's
    positions increase, else, for packed sequences whose positions restart, a
    lower-triangular mask (``_token_order_mask``). Under torch.compile, where the module cannot read
    the positions to see that no key lies ahead of a query, a second causal mask would
    be formed and applied per layer for nothing. Attention dropout in training and
    ``output_attentions`` raise ValueError (``_refuse_what_posgen_does_not_do``).
    """
    batch, n = hidden_states.shape[:2]
    q = _projected(self, "q", hidden_states)  # [B, H, N, D]
    k = _projected(self, "k", hidden_states)  # [B, H_kv, N, D]
    v = _projected(self, "v", hidden_states)  # [B, H_kv, N, D]
    _refuse_what_posgen_does_not_do(self, kwargs)
    given = kwargs.get("position_ids")
    if _temperature_by_slot(self):
        given = None  # HF's temperature reads cache_position, not position_ids
    elif given is None:  # Llama 4, Cohere 2: the positions the model rotated by
        given = _rotary_positions(self, position_embeddings, batch, n)
    positions = given if given is not None else cache_position
    if positions is None:
        positions = torch.arange(n)
    positions = positions.to(hidden_states.device)  # [N] or [B, N]
    if self.__dict__.get(UNCHECKED) is not None:  # strict: the first forward, once
        slots = cache_position if cache_position is not None else torch.arange(n)
        check_first_forward(self, position_embeddings, positions, attention_mask, slots)
    k = self.posgen.rotate_keys(k, positions)  # rotated once, then cached rotated
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx, {"cache_position": cache_position})
    m = k.shape[2]
    mask = _four_d(attention_mask, m)  # HF's 4-D mask: padding (and causal) per key
    # cached keys: their positions count back from the last query's over the kept
    # tokens (HF's position_ids for a padded batch), not the cache slots, which a
    # window's cache drops from the front; without a mask they are 0 .. M - 1, the
    # module's default
    k_positions = positions if m == n else None
    if m != n and mask is not None:
        k_positions = _shared_by_layers(
            (attention_mask, given, cache_position),
            (m, q.device),
            lambda: _cached_key_positions(mask, positions, cache_position, m),
        )
    call_mask = mask
    if mask is None and m == n and given is not None:  # HF's SDPA: causal by token order
        call_mask = _shared_by_layers(
            (given,), (m, q.device), lambda: _token_order_mask(positions), _LAST_ORDER_MASK
        )
    out = self.posgen(
        q,
        k,
        v,
        q_positions=positions,
        k_positions=k_positions,
        causal=call_mask is None,
        attn_mask=call_mask,
        keys_rotated=True,
    )  # [B, H, N, D]
    out = out.transpose(1, 2).reshape(batch, n, -1)
    return self.o_proj(out), None


def _refuse_what_posgen_does_not_do(layer: Any, kwargs: dict[str, Any]) -> None:
    """ValueError where a Llama-family layer is asked for what the posgen attention does
    not do, rather than leave it out unsaid: attention dropout in training (HF's
    layers drop ``attention_dropout`` of the weights when ``training``) and the
    attention weights (``output_attentions``, in the call or the model's config: HF
    collects the layers' second output, which here is None)."""
    dropout = getattr(layer, "attention_dropout", 0.0)
    if isinstance(dropout, nn.Dropout):
        dropout = dropout.p
    if layer.training and isinstance(dropout, float | int) and dropout > 0:
        raise ValueError(
            f"posgen attention has no attention dropout, and the layer's attention_dropout "
            f"is {dropout}: call model.eval(), or build the model with "
            "config.attention_dropout=0.0 to train"
        )
    wanted = kwargs.get("output_attentions")
    if wanted is None:
        wanted = getattr(getattr(layer, "config", None), "output_attentions", False)
    if wanted is True:
        raise ValueError("posgen.hf does not return attention weights: output_attentions=False")


def _watch_rotary_embeddings(model: nn.Module, layers: list[nn.Module]) -> None:
    """Hook each ``*RotaryEmbedding`` module of ``model`` (once per module) and link each
    of ``layers`` (its Llama-family attention layers) to the nearest one.

    HF's rotary embedding module turns the model's ``position_ids`` into the cos and sin
    (Llama 4: ``freqs_cis``) every layer rotates by. Some models hand their layers only
    those, not the positions (Llama 4's and Cohere 2's decoder layers call ``self_attn``
    without ``position_ids``; Qwen2-VL's text layers where the positions have three
    axes), so a layer would fall back to ``cache_position``, which agrees with the
    model's positions only up to a constant per row: packed documents, whose positions
    restart, and ``generate``'s chunked prefill of a padded batch rotated otherwise
    than HF. Two hooks therefore watch the positions the module receives:

    - a forward pre-hook refuses M-RoPE axes that differ (``_refuse_distinct_axes``);
    - a forward hook records them (``_record_positions``) on the first tensor of the
      module's output, which the layers receive as ``position_embeddings`` (exact under
      gradient checkpointing, whose recomputation hands the layer that same tensor),
      and on the module itself, for a layer handed a copy of it (accelerate's hooks
      move it to a layer on another device).

    A layer reads them through ``_rotary_positions``. Its rotary module is the one
    whose parent holds the layer (the longest such name: a multimodal model's language
    model, not its vision tower), kept in the layer's ``__dict__``, not as a submodule
    (it is the model's, and its parameters are not the layer's)."""
    rotary = {
        name: module
        for name, module in model.named_modules()
        if type(module).__name__.endswith("RotaryEmbedding")
    }
    for module in rotary.values():
        if not getattr(module, _POSITIONS_WATCHED, False):
            module.register_forward_pre_hook(_refuse_distinct_axes, with_kwargs=True)
            module.register_forward_hook(_record_positions, with_kwargs=True)
            setattr(module, _POSITIONS_WATCHED, True)
    names = {id(module): name for name, module in model.named_modules()}
    for layer in layers:
        holders = [other for other in rotary if names[id(layer)].startswith(_parent(other))]
        if holders:
            nearest = max(holders, key=lambda other: len(_parent(other)))
            layer.__dict__[_ROTARY_MODULE] = rotary[nearest]


def _parent(name: str) -> str:
    """The dotted prefix of a submodule's parent: "model." of "model.rotary_emb", "" at
    the top."""
    return name.rpartition(".")[0] + "." if "." in name else ""


_POSITIONS_WATCHED = "_posgen_watches_positions"
# the attribute, on a rotary module's output and on the module, that holds the
# position_ids it last turned into cos and sin (``_record_positions``)
_POSITIONS_SEEN = "_posgen_position_ids"
# the key, in an attention layer's __dict__, of the rotary module it reads them from
_ROTARY_MODULE = "_posgen_rotary_module"


def _record_positions(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """Keep the position_ids the rotary embedding module was called with, on its
    output's first tensor and on the module (``_watch_rotary_embeddings``)."""
    positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
    if not isinstance(positions, Tensor):
        return  # a vision tower's rotary module takes no positions
    module.__dict__[_POSITIONS_SEEN] = positions
    first = output[0] if isinstance(output, tuple | list) and output else output
    if isinstance(first, Tensor):
        setattr(first, _POSITIONS_SEEN, positions)


def _rotary_positions(layer: Any, position_embeddings: Any, batch: int, n: int) -> Tensor | None:
    """int64 [B or 1, N]: the position_ids the model's rotary embedding module made the
    layer's ``position_embeddings`` from, for a layer the model hands no
    ``position_ids`` (``_watch_rotary_embeddings``); None where none fit the layer's
    B x N tokens (a layer called on its own: ``cache_position`` then serves).

    Read from ``position_embeddings`` itself where it is the module's output, else from
    the module's last forward (the embeddings were copied: moved to another device).
    M-RoPE's [axes, B, N] gives its first axis: the axes agree, or the forward was
    refused (``_refuse_distinct_axes``)."""
    first = position_embeddings
    if isinstance(first, tuple | list):
        first = first[0] if first else None
    positions = getattr(first, _POSITIONS_SEEN, None) if isinstance(first, Tensor) else None
    if positions is None:
        rotary = layer.__dict__.get(_ROTARY_MODULE)
        positions = None if rotary is None else rotary.__dict__.get(_POSITIONS_SEEN)
    if not isinstance(positions, Tensor):
        return None
    if positions.dim() == 3:
        positions = positions[0]
    if positions.dim() != 2 or positions.shape[-1] != n or positions.shape[0] not in (1, batch):
        return None
    return positions


def _temperature_by_slot(layer: Any) -> bool:
    """Whether the layer scales its queries by ``cache_position``: Llama 4's NoPE layers
    with ``attn_temperature_tuning``, whose factor HF computes from the cache positions
    (a token's slot in the sequence, padding counted), not from ``position_ids``;
    HF's own test of the setting, truthiness and ``not use_rope``."""
    tuning = getattr(layer, "attn_temperature_tuning", False)
    return bool(tuning) and not getattr(layer, "use_rope", True)


def _refuse_distinct_axes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """ValueError where the rotary embedding's position_ids [axes, B, N] differ across
    their axes (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: text, height and width).

    HF turns those positions into cos and sin in the model's rotary embedding module
    and hands its layers only those (per axis, or Qwen3-VL's already dealt out over the
    pairs), so the adapter rotates by one axis: right while the axes agree (text),
    wrong at an image's or a video's tokens. Compared once per forward and in eager
    mode only: a compiled graph reads no values on the host, so under torch.compile the
    axes are not checked."""
    positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
    if torch.compiler.is_compiling() or not isinstance(positions, Tensor):
        return
    if positions.dim() != 3 or positions.shape[0] == 1:
        return
    if bool((positions[1:] != positions[:1]).any()):
        raise ValueError(
            f"the model rotates by {positions.shape[0]} position axes (M-RoPE: text, "
            "height, width) that differ in this forward, at an image's or a video's "
            "tokens; HF hands its layers only their cos and sin, not the positions, so "
            "posgen.hf cannot rotate by them: it runs M-RoPE models on inputs whose axes "
            "agree (text)"
        )


def _posgen_bloom_attention_forward(
    self: Any,
    hidden_states: Tensor,
    residual: Tensor,
    alibi: Tensor | None = None,
    attention_mask: Tensor | None = None,
    layer_past: Any = None,
    head_mask: Tensor | None = None,
    use_cache: bool = False,
    output_attentions: bool = False,
    cache_position: Tensor | None = None,
) -> tuple[Tensor, None]:
    """BloomAttention.forward with posgen's encoding and attention.

    hidden_states: [B, N, hidden]; returns (residual + dense(attention), None) as
    BloomAttention does, without the attention weights. BLOOM's ``alibi`` tensor is not
    used: the posgen module forms its bias from the positions (see the module docstring).
    """
    if output_attentions:
        raise ValueError("posgen.hf does not return attention weights: output_attentions=False")
    if head_mask is not None:
        raise ValueError("posgen.hf does not support BLOOM's head_mask")
    if self.training and self.attention_dropout.p > 0:
        raise ValueError(
            "posgen attention has no attention dropout: call model.eval() or set "
            "config.attention_dropout=0.0 to train"
        )
    batch, n, _ = hidden_states.shape
    fused = self.query_key_value(hidden_states).view(batch, n, self.num_heads, 3, self.head_dim)
    q, k, v = (fused[..., part, :].transpose(1, 2) for part in range(3))  # [B, H, N, D]
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx, {"cache_position": cache_position})
    m = k.shape[2]
    mask = _four_d(attention_mask, m)  # [B, 1, N, M]

    def positions() -> tuple[Tensor, Tensor]:
        k_positions = _kept_positions(mask, m, hidden_states.device)  # [B, M] or [M]
        slots = cache_position if cache_position is not None else torch.arange(m - n, m)
        return k_positions[..., slots.to(hidden_states.device)], k_positions  # queries' slots

    q_positions, k_positions = _shared_by_layers(
        (attention_mask, cache_position), (m, hidden_states.device), positions
    )
    out = self.posgen(
        q,
        k,
        v,
        q_positions=q_positions,
        k_positions=k_positions,
        causal=True,
        attn_mask=mask,
    )  # [B, H, N, D]
    out = out.transpose(1, 2).reshape(batch, n, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # BLOOM's sliced dense, as it sums
        step = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(out)
        for i in range(self.pretraining_tp):
            lo, hi = int(i * step), int((i + 1) * step)
            output = output + F.linear(out[:, :, lo:hi], self.dense.weight[:, lo:hi])
    else:
        output = self.dense(out)
    output = residual + F.dropout(output, p=self.hidden_dropout, training=self.training)
    return output, None


def _four_d(attention_mask: Tensor | None, m: int) -> Tensor | None:
    """HF's 4-D mask over the first m keys, or ValueError for another form of mask.

    A float mask marks a masked key with the dtype's least value (``finfo.min``); those
    entries become -inf, a key masked outright. A query row of left padding, whose every
    key is masked, then gives zeros as posgen's masks do (HF's eager attention weighs
    such a row's keys alike; neither reads it), and its gradients are those of the
    forward: CPU flash attention's backward, given finfo.min, read a log-sum-exp that
    had lost the log of the row's key count beside it, and gave such rows' keys and
    values gradients that did not match its own forward."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4:
        got = list(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask
        raise ValueError(
            "posgen.hf needs the 4-D attention mask of attn_implementation 'eager' or "
            f"'sdpa', got {type(attention_mask).__name__} {got!r}"
        )
    mask = attention_mask[:, :, :, :m]
    if not mask.is_floating_point():
        return mask

    def masked_outright() -> Tensor:  # [B, 1, N, M]: 0 for a kept key, finfo.min masked
        if not torch.compiler.is_compiling():  # a graph keeps nothing between calls
            weakref.finalize(attention_mask, _forget_the_mask_of_a_freed_input)
        return mask.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))

    # one tensor for every layer, as the modules read a mask once per tensor
    return _shared_by_layers((attention_mask,), (m, mask.device), masked_outright, _LAST_MASK)


# What the last layer made from its mask (and cache positions): [stamps of those
# tensors, (the key count, the device), the positions].
_LAST_LAYER_POSITIONS: list[Any] = []
# The same for the mask that ``_four_d`` made from HF's: [stamps, shape, the mask],
# let go once HF's mask is freed (it is as large as that mask).
_LAST_MASK: list[Any] = []
# The same for the mask of causal attention by token order (``_token_order_mask``).
_LAST_ORDER_MASK: list[Any] = []


def _token_order_mask(positions: Tensor) -> Tensor | None:
    """The mask of causal attention by token order where ``position_ids`` (int64 [N] or
    [B, N], no padding mask) would not give it: None where each row's positions
    increase (causal by position is then causal by order: plain sequences, a prompt
    at an offset), else bool [N, N], key j allowed for query i where j <= i. That is
    what HF's own SDPA layers do without a mask (``is_causal``), for packed sequences
    whose positions restart at each document (``DataCollatorWithFlattening``'s
    padding-free batches), where a causal mask by position let a query read the later
    tokens of an earlier document. One read of the positions (a host sync on a GPU),
    shared by the layers of a forward; under torch.compile, which cannot read them,
    always the mask."""
    n = positions.shape[-1]
    if n < 2:
        return None
    if not torch.compiler.is_compiling():
        if bool((positions[..., 1:] > positions[..., :-1]).all()):  # one read
            return None
    return torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()


def _forget_the_mask_of_a_freed_input() -> None:
    """Empty ``_LAST_MASK`` where the HF mask it was made from has been freed."""
    if _LAST_MASK and _LAST_MASK[0][0][0]() is None:
        _LAST_MASK.clear()


def _shared_by_layers(
    inputs: tuple[Tensor | None, ...],
    shape: tuple[int, torch.device],
    make: Callable[[], Any],
    last: list[Any] | None = None,
) -> Any:
    """``make()``, the positions a layer forms from ``inputs`` (the mask and cache
    positions HF gives every layer of a forward), or what the previous layer made from
    the same tensors, unchanged, for the same key count and device (``shape``: a model
    split over devices forms them again on each). The layers of one forward then
    pass the same position tensors, which the posgen modules read once (a host sync on
    a GPU) per forward rather than once per layer. Inference tensors count no version,
    so an edit in place would go unseen: positions formed from them are never shared.
    ``last``: where the previous layer's is kept (default ``_LAST_LAYER_POSITIONS``; the
    mask's own, ``_LAST_MASK``). Under torch.compile every layer makes its own: the
    graph reads no values on the host, and the weak references and version counts
    would break it (HF's static cache with a fullgraph-compiled forward)."""
    last = _LAST_LAYER_POSITIONS if last is None else last
    if torch.compiler.is_compiling():  # traced once per graph: nothing to share at run time
        return make()
    if any(t is not None and t.is_inference() for t in inputs):
        return make()
    if last:
        last_stamps, last_shape, last_positions = last
        same = len(last_stamps) == len(inputs) and all(
            _unchanged(t, stamp) for t, stamp in zip(inputs, last_stamps, strict=True)
        )
        if same and last_shape == shape:
            return last_positions
    made = make()
    stamps = tuple(None if t is None else (weakref.ref(t), t._version) for t in inputs)
    last[:] = [stamps, shape, made]
    return made


def _unchanged(t: Tensor | None, stamp: tuple[Any, int] | None) -> bool:
    """Whether ``stamp`` (weak reference, version; None for None) was taken of t, and t
    has not changed since."""
    if t is None or stamp is None:
        return t is None and stamp is None
    return stamp[0]() is t and stamp[1] == t._version


def _cached_key_positions(
    mask: Tensor, positions: Tensor, cache_position: Tensor | None, m: int
) -> Tensor:
    """A Llama-family layer's key positions, int64 [B, M] (0 at a key no query keeps),
    when some keys come from the cache: counted back from a query's position over the
    keys the mask keeps.

    mask: HF's 4-D mask [B, 1, N, M] over the M keys; positions: the N queries'
    ([N] or [B, N]); cache_position: their places in the sequence ([N]). The keys some
    query keeps are the tokens from the earliest query's window (or chunk) on, less
    padding, so the kept keys' positions run on by one from key to kept key, as
    ``generate``'s position_ids count the kept tokens. Numbering them from the left
    (as BLOOM's positions do) would start them at 0 wherever a window left earlier
    tokens out, so they are numbered back from the row's last query that is not
    padding (whose own key is kept), at its position. A query's key is its slot in
    the cache: the cache position, or as far from the last key as the query is from
    the last query where the cache holds fewer keys than that (a window's cache
    drops the oldest: HF's sliding-window layers keep the window, not the sequence).
    Tested against a full forward with windows, left, right and inner padding, and
    dynamic and static caches fed in chunks (tests/test_hf_windows_and_refusals.py).
    """
    n = mask.shape[-2]
    kept = kept_by_mask(mask[:, 0]).any(-2).to(torch.int64)  # [B, M]: kept by some query
    if cache_position is None:
        slots = torch.arange(m - n, m, device=kept.device)
    else:
        cache_position = cache_position.to(kept.device)
        slots = cache_position - (cache_position[-1] - (m - 1)).clamp(min=0)  # [N]
    batch = max(kept.shape[0], positions.shape[0] if positions.dim() > 1 else 1)
    kept = kept.expand(batch, m)
    positions = positions.to(torch.int64).expand(batch, n)
    own = kept[:, slots]  # [B, N]: 1 where the query's own key is kept (not padding)
    order = torch.arange(1, n + 1, device=kept.device)
    last = (own * order).argmax(-1, keepdim=True)  # [B, 1]: the last such query
    later = kept.flip(-1).cumsum(-1).flip(-1)  # [B, M]: kept keys from each key on
    from_last = later - later.gather(-1, slots[last])  # kept keys from each up to it
    # a row whose queries are all padding (right padding) has no such query: its
    # outputs are read by nothing, and its keys' positions are kept from going negative
    return ((positions.gather(-1, last) - from_last) * kept).clamp(min=0)


def _kept_positions(mask: Tensor | None, m: int, device: torch.device) -> Tensor:
    """Key positions counting kept keys: int64 [B, M] (0 at padding), or [M] without a mask.

    The last query row of HF's 4-D mask (additive from eager attention, bool from sdpa)
    lets every key up to that query through except padding, so the keys it keeps (0, or
    True) are the 2-D attention mask's ones;
    BLOOM numbers them ``cumsum - 1`` and gives padding 0 (it is masked anyway); those
    are also the ``position_ids`` ``generate`` gives a Llama-family model's kept tokens.
    """
    if mask is None:
        return torch.arange(m, device=device)
    kept = kept_by_mask(mask[:, 0, -1, :]).to(torch.int64)  # [B, M]
    return (kept.cumsum(-1) - 1) * kept
