"""The FlexAttention backend's plumbing (torch.nn.attention.flex_attention).

A position term becomes a ``score_mod`` and the masks a ``mask_mod`` over (batch, head,
query index, key index), read from small captured tensors, so no [B, H, N, M] tensor is
ever formed. Kernels are compiled once per shape, dtype and score_mod in a process;
on the CPU a step that trains takes an unfused reference (FlexAttention has no CPU
backward).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from ._inputs import repeat_kv
from ._masks import masked_softmax
from ._opaque import own_buffer_on_cpu
from ._terms import RelativePart


def flex_mask_mod(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    causal: bool,
    window: int | None,
    documents: Tensor | None,
) -> Any:
    """A FlexAttention mask_mod(b, h, qi, ki) -> bool: ``attention_allowed`` per element.

    Positions as ``flex_positions`` reads them; documents [M] or [B, M]: the keys'
    document ids, query qi reading entry qi + M - N.
    """
    positions = flex_positions(q_positions, k_positions, n, m)
    offset = m - n
    doc_rows = (
        None if documents is None else own_buffer_on_cpu(documents.view(-1, m))
    )  # [1 or B, M]

    def mask_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        allowed: Tensor | None = None
        if causal or window is not None:
            i, j = positions(b, qi, ki)
            distance = i - j  # query minus key position
            if causal:
                allowed = distance >= 0
            if window is not None:
                near = distance < window
                near = near if causal else near & (distance > -window)
                allowed = near if allowed is None else allowed & near
        if doc_rows is not None:
            row = b % doc_rows.shape[0]
            same = doc_rows[row, qi + offset] == doc_rows[row, ki]
            allowed = same if allowed is None else allowed & same
        assert allowed is not None  # the caller passes something to mask
        return allowed

    return mask_mod


def flex_score_mod(
    vec: Tensor | None,
    added: Tensor | None,
    n: int,
    bias_fn: Any = None,
    bias_scale: float = 1.0,
    relative_fn: Any = None,
) -> Any:
    """A FlexAttention score_mod adding a per-distance vector, a captured tensor and/or a
    bias computed per index.

    vec: [H, N + M - 1], entry kv - q + N - 1 (default positions, ``default_distances``);
    added: broadcastable to [B, H, N, M] (a bias or mask as the sdpa backend would add
    it; a dimension of size 1, or absent, is read at index 0);
    bias_fn(b, h, q, kv): a bias per element (an expression), times ``bias_scale``;
    relative_fn(b, h, q, kv): relative terms per element, as they enter the logits.
    None when there is nothing to add.
    """
    if vec is None and added is None and bias_fn is None and relative_fn is None:
        return None
    # bound either way: dynamo reads every closure cell
    per_batch = per_head = per_query = per_key = False
    vec = None if vec is None else own_buffer_on_cpu(vec)
    if added is not None:
        added = own_buffer_on_cpu(added.reshape((1,) * (4 - added.dim()) + tuple(added.shape)))
        # a dimension of size 0 is indexed too: index 0 would be out of range
        per_batch, per_head, per_query, per_key = (size != 1 for size in added.shape)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if vec is not None:
            score = score + vec[h, ki - qi + (n - 1)]
        if added is not None:
            row, column = (qi if per_query else 0), (ki if per_key else 0)
            score = score + added[b if per_batch else 0, h if per_head else 0, row, column]
        if bias_fn is not None:
            score = score + bias_fn(b, h, qi, ki) * bias_scale
        if relative_fn is not None:
            score = score + relative_fn(b, h, qi, ki)
        return score

    return score_mod


def flex_relative_terms(
    parts: list[RelativePart],
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    positions: Any = None,
) -> Any:
    """relative(b, h, qi, ki): the sum of the relative terms ``parts`` for one score,
    each read from its projection at its diagonal's row: O(N·K) captured, no
    [B, H, N, M] tensor.

    Default positions (``positions`` None): N queries, the diagonal's entry
    ki - qi + N - 1. Otherwise ``positions`` (``flex_positions``) gives the query and
    key positions i and j, and the parts are ``_clipped_relative_parts``' with
    N = K + 1: entry clip(j - i, -K, K) + K.
    """
    middle = n - 1  # the diagonal of key minus query 0 (K where the parts are clipped)
    parts = [
        RelativePart(
            side, own_buffer_on_cpu(scores), None if row is None else own_buffer_on_cpu(row)
        )
        for side, scores, row in parts
    ]

    def relative_terms(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if positions is None:
            offset = ki - qi
        else:
            i, j = positions(b, qi, ki)
            offset = (j - i).clamp(-middle, middle)
        total = torch.zeros((), dtype=dtype, device=device)
        for side, scores, diagonal in parts:
            row = None if diagonal is None else diagonal[offset + middle]
            if side == "query":
                total = total + scores[b, h, qi, row]
            elif side == "key":
                total = total + scores[b, h, ki, row]
            elif side == "global":
                total = total + scores[h, row]
            else:  # "content": one value per key
                total = total + scores[b, h, ki]
        return total

    return relative_terms


def flex_positions(q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int) -> Any:
    """positions(b, qi, ki) -> (query position, key position) for a score_mod's indices.

    Default positions: query qi is at qi + M - N, key ki at ki. Explicit ones are read
    from their [N] or [batch, N] rows (a shared row answers every batch index).
    """
    offset = m - n
    q_rows = None if q_positions is None else own_buffer_on_cpu(q_positions.view(-1, n))  # [1|B, N]
    k_rows = None if k_positions is None else own_buffer_on_cpu(k_positions.view(-1, m))  # [1|B, M]

    def positions(b: Tensor, qi: Tensor, ki: Tensor) -> tuple[Tensor, Tensor]:
        i = qi + offset if q_rows is None else q_rows[b % q_rows.shape[0], qi]
        j = ki if k_rows is None else k_rows[b % k_rows.shape[0], ki]
        return i, j

    return positions


def flex_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: Any,
    block_mask: Any,
    scale: float,
    return_lse: bool = False,
) -> Any:
    """What flex_attention computes, unfused and differentiable on any device: the
    output, and with ``return_lse`` also the log-sum-exp of each row's scores [B, H, N]
    (-inf for a fully masked row).

    The score_mod and the block mask's mask_mod are called once on broadcast index
    tensors b [B, 1, 1, 1], h [1, H, 1, 1], q [1, 1, N, 1], kv [1, 1, 1, M]; fully masked
    rows give zeros, as flex_attention does.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    batch, heads, n, m = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # [B, H, N, M]
    device = q.device
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    qi = torch.arange(n, device=device).view(1, 1, -1, 1)
    ki = torch.arange(m, device=device).view(1, 1, 1, -1)
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    if block_mask is not None:
        allowed = block_mask.mask_mod(b, h, qi, ki)
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(masked_softmax(scores), v)
    return (out, torch.logsumexp(scores, dim=-1)) if return_lse else out


_COMPILED_FLEX: dict[str, Any] = {}

#: recompilations TorchDynamo may make of flex_attention while posgen calls it: each
#: (score_mod, shape, dtype, mask) is one, and past dynamo's default limit (8) it falls
#: back, with a warning, to the unfused kernel that materialises the scores
FLEX_RECOMPILE_LIMIT = 256


def flex_kernel_options(q: Tensor, has_score_mod: bool) -> dict[str, Any] | None:
    """Triton options for the compiled flex kernel (None: FlexAttention's defaults).

    On CUDA a score_mod (they read captured vectors and tables) gets BLOCK_M = BLOCK_N =
    64 and one pipeline stage: the default tiles ran out of shared memory on an H100
    (torch 2.11) and, for T5 at N = 8192, ran a causal forward 2.8x slower
    (benchmarks/results/attention_backends_cuda_bfloat16_options.md). So do features
    wider than 128 other than 256 (whose tiles torch picks per GPU), such as TUPE-A's
    untied term folded into q and k (64 + 66): padded to 256 with torch's tiles for
    widths it has no entry for (three stages), they asked an H100 for 245,760 bytes of
    shared memory where it has 232,448 (torch 2.11, 2026-12-06).
    """
    width = q.shape[-1]
    if q.device.type == "cuda" and (has_score_mod or (width > 128 and width != 256)):
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
    return None


def _recompile_room() -> Any:
    """A context raising dynamo's per-function recompile limit to FLEX_RECOMPILE_LIMIT
    for the call (the setting is ``recompile_limit``, ``cache_size_limit`` before 2.7)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), FLEX_RECOMPILE_LIMIT)})


UNFUSED_FLEX_WARNING = "flex_attention called without torch.compile"
"""The start of the warning torch gives once per process on an unfused flex call, which
posgen makes on purpose (the CPU's default: ``flex_compile = None`` compiles on CUDA
only)."""


def run_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: Any,
    block_mask: Any,
    scale: float,
    gqa: bool,
    compiled: bool,
    trains_terms: bool = False,
    return_lse: bool = False,
) -> Any:
    """flex_attention, compiled once per process with static shapes (a kernel per shape,
    dtype and score_mod; the dynamic-shape recompile of torch 2.13's CPU code generator
    failed to compile C++ for a second score_mod in one process), with room for
    FLEX_RECOMPILE_LIMIT kernels and the options of ``flex_kernel_options``: the output
    [B, H, N, value_dim], and with ``return_lse`` also each row's log-sum-exp of its
    scores [B, H, N] (float32, float64 for float64 inputs).

    ``trains_terms``: gradients flow into what the score_mod captures (the module's
    parameters). On the CPU that, or q, k or v requiring grad, takes ``flex_reference``:
    FlexAttention has no CPU backward (and refuses such inputs even under no_grad).
    """
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" and (trains_terms or any(t.requires_grad for t in (q, k, v))):
        return flex_reference(q, k, v, score_mod, block_mask, scale, return_lse)
    options: Any = flex_kernel_options(q, score_mod is not None)  # FlexKernelOptions
    keywords: dict[str, Any] = {"score_mod": score_mod, "block_mask": block_mask}
    keywords.update(scale=scale, enable_gqa=gqa, **(_lse_request() if return_lse else {}))
    if torch.compiler.is_compiling():  # inside the caller's torch.compile: inlined
        # the CPU kernel reads q, k and v as 4-D buffers of their own (``own_buffer_on_cpu``):
        # interleaved pairs rotated and flattened from 5-D failed to compile ("too many
        # values to unpack (expected 4)")
        q, k, v = (own_buffer_on_cpu(t) for t in (q, k, v))
        result = flex_attention(q, k, v, kernel_options=options, **keywords)
    elif not compiled:  # the unfused implementation (exact, materialises the scores)
        with warnings.catch_warnings():  # chosen, and documented: torch's advice is noise
            warnings.filterwarnings("ignore", UNFUSED_FLEX_WARNING, UserWarning)
            result = flex_attention(q, k, v, **keywords)
    else:
        function = _COMPILED_FLEX.get("flex")
        if function is None:
            compiled_flex = torch.compile(flex_attention, dynamic=False)
            function = _COMPILED_FLEX.setdefault("flex", compiled_flex)
        with _recompile_room():
            result = function(q, k, v, kernel_options=options, **keywords)
    if return_lse and "return_aux" in keywords:
        out, aux = result
        return out, aux.lse
    return result


def _lse_request() -> dict[str, Any]:
    """flex_attention's keyword asking for the log-sum-exp: ``return_aux`` where torch
    has it (``return_lse`` is deprecated there), else ``return_lse``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before AuxRequest
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}
