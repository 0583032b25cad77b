"""What ``use_posgen_attention(..., strict=True)`` checks on a Llama-family layer.

Strict mode refuses a posgen module that would not reproduce the layer's own positions,
in two steps:

- when the module is attached, by kind: a logit scale other than the layer's own, a
  rotation on a layer without positions or none on a rotary layer (where the layer
  says so: ``use_rope``, Cohere 2's full layers), a position term the layer does not
  have (a bias, content-dependent relative terms, a value-side term), and a query scale
  by position (Llama 4's temperature tuning on its NoPE layers) on a layer without one,
  or none where the layer has it (an ``attn_scale`` of 0 scales by exactly 1: none),
  and where both have one, its factors at a few positions by value;
- at the layer's first forward outside torch.compile, by value: the layer receives its
  rotation from the model (``position_embeddings``: cos and sin, or Llama 4's complex
  ``freqs_cis``), so a random probe rotated at that forward's positions by the layer's
  own modeling code (``apply_rotary_pos_emb``, or Llama 4's ``apply_rotary_emb``) and by
  the module's ``rotate_keys`` must agree. That compares everything a rotation is made
  of, base, frequency scaling, attention factor, pairing and rotated features, at the
  positions of that forward: a schedule that differs only past them (a scaling of the
  low frequencies seen at short positions) is caught once a forward reaches them only if
  it is the first. A layer whose rotation the check cannot state (M-RoPE's 3-axis cos
  and sin, a modeling file with neither function) is not compared by value, and
  neither is a model whose cos and sin arrive in half precision (its own rounded
  angles drift as far as another base's would).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

#: the attribute that holds the layer's index until its first forward has been checked
UNCHECKED = "_posgen_unchecked_index"

#: what a layer that looks like Llama's may hold beside its projections, which
#: posgen.hf applies (norms before the module) or which holds nothing the forward uses
_APPLIED_PARTS = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "qk_norm")
    + ("q_layernorm", "k_layernorm", "rotary_emb", "attention_dropout")
)

#: parts of layers posgen.hf cannot run, with what they do (any other unknown part is
#: refused too, by its name)
_UNAPPLIED_PARTS = {
    "sinks": "attention sinks (GPT-OSS: a learned logit per head joins every row's softmax)",
    "query_layernorm": "a weighted norm of q and k after the rotation (HunYuan), which "
    "does not commute with it",
    "key_layernorm": "a weighted norm of q and k after the rotation (HunYuan), which does "
    "not commute with it",
    "attn_sub_norm": "a norm of the attention's output before o_proj (BitNet)",
    "lambda_q1": "differential attention (DiffLlama: one softmax less another)",
    "dt_proj": "a dynamic mask made from the values (Doge)",
}

#: position terms no Llama-family layer has, by the module flag that marks them
_TERMS_BEYOND_ROTATION = {
    "has_position_bias": "a position bias",
    "has_relative_terms": "relative position terms",
    "has_value_term": "a value-side position term",
}


def check_llama_family_layer(
    attention: nn.Module, module: nn.Module, index: int, strict: bool
) -> None:
    """ValueError where the module cannot give this Llama-family layer's attention (with
    ``strict``: its own kind of positions and logit scale). With ``strict``, the layer is
    marked for the check by value at its first forward (``check_first_forward``)."""
    cap = getattr(attention, "attn_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"layer {index} caps its logits (attn_logit_softcapping {cap:g}); posgen's "
            "attention does not"
        )
    _refuse_unapplied_parts(attention, index)
    setattr(attention, UNCHECKED, index if strict else None)
    if not strict:
        return
    _check_logit_scale(attention, module, index)
    rotates, why = layer_rotates(attention)
    module_rotates = getattr(module, "has_rotation", None)
    if rotates is not None and module_rotates is not None and rotates != module_rotates:
        does = "rotates" if module_rotates else "does not rotate"
        raise ValueError(f"layer {index} {why}, but encoding({index}) {does}")
    for flag, term in _TERMS_BEYOND_ROTATION.items():
        if getattr(module, flag, False):
            raise ValueError(
                f"layer {index} has no position term but its rotation, encoding({index}) "
                f"adds {term} (strict=False runs it on the model's weights on purpose)"
            )
    tuned = rotates is False and _scales_queries(attention)
    if tuned != bool(getattr(module, "has_query_scale", tuned)):
        raise ValueError(
            f"layer {index} {'scales' if tuned else 'does not scale'} its queries by "
            f"position (Llama 4's attention temperature tuning), encoding({index}) "
            f"{'does not' if tuned else 'does'}: take the layer's spec from `posgen from-hf`"
        )
    if tuned:
        _check_temperature_values(attention, module, index)


def _check_temperature_values(attention: nn.Module, module: Any, index: int) -> None:
    """ValueError where the module's query factors are not the layer's temperature
    1 + attn_scale * ln(1 + floor((i + 1) / floor_scale)) (HF's, in float32) within
    1e-6, at positions on both sides of its first steps and far out: another
    ``floor_scale`` or ``attn_scale`` (Scout's 8192 and 0.1) would change the logits."""
    layer: Any = attention  # HF's Llama4TextAttention: plain attributes, not submodules
    floor_scale, attn_scale = float(layer.floor_scale), float(layer.attn_scale)
    steps = torch.arange(0, 5, dtype=torch.float64) * floor_scale  # [5]
    positions = torch.cat([steps[1:] - 1, steps, torch.tensor([2.0**20, 2.0**24])])
    positions = positions.to(torch.int64).clamp(min=0).unique()  # [P]
    tau = torch.log(torch.floor((positions.float() + 1.0) / floor_scale) + 1.0)
    expected = (tau * attn_scale + 1.0).double()  # [P], as HF forms it
    probe = torch.ones(1, module.heads, len(positions), module.head_dim, dtype=torch.float64)
    with torch.no_grad():
        got = module.scale_queries(probe, positions)[0, :, :, 0]  # [H, P]
    differs = ((got - expected).abs() > 1e-6 * expected).any(dim=0)  # [P]
    if bool(differs.any()):
        first = int(differs.nonzero()[0])
        raise ValueError(
            f"layer {index} scales its queries by {float(expected[first]):.6g} at position "
            f"{int(positions[first])} (floor_scale {floor_scale:g}, attn_scale "
            f"{attn_scale:g}), encoding({index}) by {float(got[0, first]):.6g}: take the "
            "layer's spec from `posgen from-hf`"
        )


def _scales_queries(attention: nn.Module) -> bool:
    """Whether a layer without a rotation scales its queries by position: Llama 4's
    attention temperature tuning, 1 + attn_scale * ln(1 + floor((i + 1) / floor_scale)),
    where ``attn_temperature_tuning`` is true (HF tests its truth) and ``attn_scale`` is
    not 0. With ``attn_scale`` 0 the factor is exactly 1 at every position: no scale,
    which is what the plain ``nope`` from-hf writes for such a layer states."""
    tuning = bool(getattr(attention, "attn_temperature_tuning", False))
    return tuning and getattr(attention, "attn_scale", None) != 0


def _refuse_unapplied_parts(attention: nn.Module, index: int) -> None:
    """ValueError where the layer holds a submodule or parameter of its own that
    posgen.hf would leave out of its attention (GPT-OSS's sinks, HunYuan's norms after
    the rotation, BitNet's output norm, DiffLlama's and Doge's): the forward would run
    without it, silently another model, whatever ``strict`` says."""
    parts = [name for name, _ in attention.named_children()]
    parts += [name for name, _ in attention.named_parameters(recurse=False)]
    for name in parts:
        if name in _APPLIED_PARTS or name == "posgen":
            continue
        what = _UNAPPLIED_PARTS.get(name, "a part posgen.hf does not know")
        raise ValueError(
            f"layer {index} ({type(attention).__name__}) has {name}: {what}; posgen.hf "
            "runs the projections, the query and key norms before the rotation and the "
            "attention, and would leave it out"
        )


def _check_logit_scale(attention: nn.Module, module: nn.Module, index: int) -> None:
    """ValueError where the layer scales its logits by its own factor (not
    1/sqrt(head_dim): Gemma's query_pre_attn_scalar, Granite's attention_multiplier) and
    the module by another."""
    scaling, scale = getattr(attention, "scaling", None), getattr(module, "scale", None)
    head_dim = getattr(attention, "head_dim", None)
    if isinstance(scaling, float) and isinstance(scale, float) and isinstance(head_dim, int):
        own_scale = not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6)
        if own_scale and not math.isclose(scaling, scale, rel_tol=1e-6):
            raise ValueError(
                f"layer {index} scales its logits by {scaling:.6g}, encoding({index}) by "
                f"{scale:.6g}: take the layer's spec from `posgen from-hf` (it reads "
                "query_pre_attn_scalar and attention_multiplier)"
            )


def layer_rotates(attention: nn.Module) -> tuple[bool | None, str]:
    """Whether the layer rotates q and k (None: it does not say), and the reason."""
    use_rope = getattr(attention, "use_rope", None)  # SmolLM3, Llama 4
    if use_rope is not None:
        return bool(use_rope), f"has use_rope {int(use_rope)}"
    if any(cls.__name__ == "Cohere2Attention" for cls in type(attention).__mro__):
        sliding = getattr(attention, "sliding_window", None) is not None
        return sliding, "is a sliding layer" if sliding else "is a full layer (no positions)"
    if any(cls.__name__ == "Exaone4Attention" for cls in type(attention).__mro__):
        # rotates where the model has no window, else on its sliding layers only
        windowless = getattr(attention, "sliding_window", None) is None
        sliding = bool(getattr(attention, "is_sliding", False))
        if windowless or sliding:
            return True, "is a sliding layer" if sliding else "rotates (no sliding window)"
        return False, "is a full layer of a model with sliding layers (no positions)"
    return None, ""


def check_first_forward(
    layer: nn.Module,
    position_embeddings: Any,
    positions: Tensor,
    attention_mask: Any,
    slots: Tensor,
) -> None:
    """ValueError where a strictly attached module does not rotate as the layer would.

    Runs once per layer, at its first forward outside torch.compile (a host sync, and a
    rotation of a [B, 1, N, head_dim] probe); positions: the forward's, [N] or [B, N];
    slots: int64 [N], the queries' key slots in ``attention_mask`` (HF's 4-D mask).
    A layer that does not say whether it rotates (``layer_rotates``) rotates when the
    model hands it ``position_embeddings``, as every Llama-family modeling file does."""
    index = layer.__dict__.get(UNCHECKED)
    if index is None or torch.compiler.is_compiling():
        return
    module: Any = layer.posgen
    rotates, why = layer_rotates(layer)
    if rotates is None:
        rotates = position_embeddings is not None
        why = "rotates q and k" if rotates else "receives no rotary position embeddings"
    module_rotates = bool(getattr(module, "has_rotation", rotates))
    if rotates != module_rotates:
        does = "rotates" if module_rotates else "does not rotate"
        raise ValueError(
            f"layer {index} {why}, but encoding({index}) {does} (strict=False runs it on "
            "the model's weights on purpose)"
        )
    if rotates and position_embeddings is not None and positions.dim() <= 2:
        with torch.no_grad():
            kept = _kept_tokens(attention_mask, slots)
            if not _compare_rotations(layer, module, position_embeddings, positions, kept, index):
                return  # nothing compared (one token, or a form not read here): next time
    setattr(layer, UNCHECKED, None)


def _kept_tokens(attention_mask: Any, slots: Tensor) -> Tensor | None:
    """bool [B, N]: the tokens of the forward that the layer's 4-D mask keeps, read on
    the diagonal (query i's own key slot, ``slots[i]``: HF masks a padded token's
    column in every row, its own too), None where every token counts."""
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4:
        return None
    if slots.dim() != 1 or int(slots.max()) >= attention_mask.shape[-1]:
        return None
    rows = torch.arange(slots.shape[0], device=attention_mask.device)
    own = attention_mask[:, 0, rows, slots.to(attention_mask.device)]  # [B, N]
    return kept_by_mask(own)


def kept_by_mask(entries: Tensor) -> Tensor:
    """bool, entries' shape: True where HF's 4-D mask lets a key through (0 in the
    additive mask of eager attention, True in the bool mask of sdpa)."""
    return entries if entries.dtype == torch.bool else entries == 0


def _compare_rotations(
    layer: nn.Module,
    module: Any,
    position_embeddings: Any,
    positions: Tensor,
    kept: Tensor | None,
    index: int,
) -> bool:
    """ValueError where the layer's own code and the module's ``rotate_keys`` rotate
    a random probe x [B, 1, N, D] into logits that differ by more than the rounding of
    the angles; False where nothing could be compared.

    Compared per batch row: the logit of each kept token i with the row's last kept
    token a, <R(p_i) x_i, R(p_a) x_a>, as a fraction of |x_i| |x_a|. Logits see only
    that, so positions that differ by a constant per row agree, and padded tokens,
    which both mask, are left out. The bound per token: 4
    ulps of the dtype the model hands cos and sin in, plus 16 float32 ulps of angles as
    large as p_i and p_a (the two compute p·θ in their own order).

    A model that hands cos and sin in half precision is compared by kind only (True):
    HF rounds them to that dtype, and a model cast with ``.to(torch.bfloat16)`` holds
    its inverse frequencies in it too, so its own angles drift from the float32
    rotation by p·2^-9 of themselves, which at a few hundred positions is as large as
    another base's."""
    dtype = _embedding_dtype(position_embeddings)
    if dtype not in (torch.float32, torch.float64):
        return True  # a model cast to half precision: its own angles are rounded (see above)
    batch, n = (positions.shape[0] if positions.dim() == 2 else 1), positions.shape[-1]
    batch = max(batch, 1 if kept is None else kept.shape[0])  # the mask's batch rows
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(batch, 1, n, module.head_dim, generator=generator)  # [B, 1, N, D]
    probe = probe.to(positions.device)
    expected = _rotated_by_layer(layer, probe, position_embeddings)  # [B', 1, N, D]
    if expected is None:
        return False
    got = module.rotate_keys(probe, positions).float()  # [B, 1, N, D]
    got, expected = torch.broadcast_tensors(got[:, 0], expected[:, 0])  # [B, N, D]
    kept = torch.ones(got.shape[:2], dtype=torch.bool, device=got.device) if kept is None else kept
    kept = torch.broadcast_to(kept.to(got.device), got.shape[:2])  # [B, N]
    steps = torch.arange(n, device=got.device)
    anchor = torch.where(kept, steps, -1).amax(-1)  # [B]: the last kept token
    rows = torch.arange(got.shape[0], device=got.device)
    compared = kept & (steps != anchor[:, None])  # [B, N]
    if not bool(compared.any()):
        return False

    def logits(rotated: Tensor) -> Tensor:  # [B, N]
        return (rotated * rotated[rows, anchor][:, None]).sum(-1)

    sizes = got.norm(dim=-1)  # [B, N]
    error = (logits(got) - logits(expected)).abs() / (sizes * sizes[rows, anchor][:, None])
    reach = torch.broadcast_to(positions.abs().to(torch.float32), got.shape[:2])  # [B, N]
    reach = reach + reach[rows, anchor][:, None] + 2
    float32_ulp = torch.finfo(torch.float32).eps / 2
    bound = 4 * torch.finfo(dtype).eps + 16 * reach * float32_ulp
    excess = torch.where(compared, error / bound, 0)  # [B, N]
    worst = int(excess.argmax())
    row, column = divmod(worst, n)
    if float(excess[row, column]) <= 1:
        return True
    at = torch.broadcast_to(positions, got.shape[:2])
    raise ValueError(
        f"layer {index} rotates its keys otherwise than encoding({index}): the logit of "
        f"positions {int(at[row, column])} and {int(at[row, anchor[row]])} differs by "
        f"{float(error[row, column]):.3g} of its largest size, past the rounding of the "
        "angles, so the base, frequency scaling, pairing or rotated features are not the "
        "layer's: take the layer's spec from `posgen from-hf` (strict=False runs another "
        "rotation on purpose)"
    )


def _embedding_dtype(position_embeddings: Any) -> torch.dtype:
    """The real dtype the model hands its cos and sin (or freqs_cis) in."""
    first = position_embeddings[0] if isinstance(position_embeddings, tuple | list) else None
    tensor = first if isinstance(first, Tensor) else position_embeddings
    if not isinstance(tensor, Tensor):
        return torch.float32
    return tensor.real.dtype if tensor.is_complex() else tensor.dtype


def _rotated_by_layer(layer: nn.Module, probe: Tensor, position_embeddings: Any) -> Tensor | None:
    """probe [B, 1, N, D] rotated as the layer's modeling code rotates its keys, in
    float32, or None where that code or those embeddings are not of a form read here."""
    modeling = sys.modules.get(type(layer).__module__)
    if isinstance(position_embeddings, Tensor) and position_embeddings.is_complex():
        apply_complex: Callable[..., Any] | None = getattr(modeling, "apply_rotary_emb", None)
        if apply_complex is None or position_embeddings.dim() != 3:
            return None
        x = probe.transpose(1, 2)  # [B, N, 1, D], Llama 4's layout
        return _called(lambda: apply_complex(x, x, position_embeddings)[1].transpose(1, 2))
    apply: Callable[..., Any] | None = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply is None or not isinstance(position_embeddings, tuple | list):
        return None
    if len(position_embeddings) != 2:
        return None
    cos, sin = (t.float() for t in position_embeddings)  # [B, N, rotated]
    if cos.dim() != 3:  # M-RoPE's [3, B, N, rotated]
        return None
    rotated = getattr(layer, "rotary_ndims", None)  # StableLM slices the rotated part itself
    if isinstance(rotated, int) and 0 < rotated < probe.shape[-1]:
        part, rest = probe[..., :rotated], probe[..., rotated:]
        return _called(lambda: torch.cat([apply(part, part, cos, sin)[1], rest], -1))
    return _called(lambda: apply(probe, probe, cos, sin)[1])


def _called(rotate: Callable[[], Any]) -> Tensor | None:
    """rotate() in float32, or None where the layer's code does not take the probe in
    that form (a shape it does not expect)."""
    try:
        result = rotate()
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None
    return result.float() if isinstance(result, Tensor) else None
