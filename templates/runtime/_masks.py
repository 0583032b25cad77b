"""Masks by position and document, the same on every backend.

With d = query position - key position: ``causal`` keeps d >= 0, ``window=W`` keeps
|d| < W (with causal, 0 <= d < W, Mistral's window), and ``document_ids`` keeps keys of
the query's own document. They combine with each other and with ``attn_mask``. Also
here: the masked softmax (a fully masked row gives zeros, as SDPA does) and the query
chunks in which masked CPU attention visits only the keys a chunk may see.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._distances import default_distances
from ._first_order import first_order_only
from ._inputs import (
    FLOAT_DTYPES,
    MAX_POSITION,
    check_strided,
    positions_or_default,
    positive_int,
)


def masked_softmax(logits: Tensor) -> Tensor:
    """softmax over the last dim; a row whose every key is masked gives zeros (as SDPA).

    A fully masked row has max logit -inf; it is zeroed before and after the softmax so
    neither the output nor the gradient carries NaN. Without a gradient, only after
    (its NaN overwritten in the fresh weights): a decode step's [1, 8, 1, 512] logits
    took 13 us instead of 25 us on a 2-core CPU.
    """
    if logits.shape[-1] == 0:
        return torch.softmax(logits, dim=-1)
    dead = torch.isneginf(logits.amax(dim=-1, keepdim=True))  # [..., N, 1]
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return torch.softmax(logits, dim=-1).masked_fill_(dead, 0.0)
    weights = torch.softmax(logits.masked_fill(dead, 0.0), dim=-1)
    return weights.masked_fill(dead, 0.0)


def masked_softmax_in_place(logits: Tensor) -> Tensor:
    """``masked_softmax`` of a fresh logits tensor that no one else reads, formed in
    place in it (``masked_softmax_``) with autograd: one node whose backward is
    softmax's, w * (g - sum(g w)), zero in a fully masked row (its weights are 0).
    Through autograd, ``masked_softmax`` takes two full-size masked fills forward and
    two more backward; in Shaw's training step at positions 2 apart (N = 2048, 8 heads,
    2-core x86) those took 17 ms of a 256-query chunk's 100 ms each way. Eager mode;
    elsewhere, and without autograd, ``masked_softmax``."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and logits.requires_grad):
        return masked_softmax(logits)
    weights: Tensor = _MaskedSoftmaxInPlace.apply(logits)
    return weights


class _MaskedSoftmaxInPlace(torch.autograd.Function):
    """``masked_softmax_in_place``'s node."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        weights = masked_softmax_(logits)  # logits' storage
        ctx.mark_dirty(logits)
        ctx.save_for_backward(weights)
        return weights

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (weights,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, weights, -1, weights.dtype)


def masked_softmax_(logits: Tensor) -> Tensor:
    """``masked_softmax`` in place in logits (no autograd): softmax over the last dim, a
    row whose every key is masked gives zeros. Three passes over logits and no new
    tensor of its size (a fresh one of 32 MiB or more is mapped and faulted in afresh
    each time)."""
    top = logits.amax(dim=-1, keepdim=True)  # [..., N, 1]
    top.masked_fill_(top == float("-inf"), 0.0)  # a row of -inf: exp gives 0 everywhere
    weights = logits.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return weights.div_(total.masked_fill_(total == 0.0, 1.0))


def attention_without_keys(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """[batch, heads, N, value_dim] zeros, in v's dtype: attention where N or M is 0.

    With no keys every query row reads none, the rule for fully masked rows; with no
    queries the output is empty. Tied to q, k and v (zero gradients) so that a backward
    through it runs as through any other output.
    """
    batch, heads, n = q.shape[:3]
    tie = (q.sum() + k.sum() + v.sum()).to(v.dtype) * 0  # 0-D, in the autograd graph
    return torch.zeros(batch, heads, n, v.shape[-1], dtype=v.dtype, device=v.device) + tie


def causal_allowed(
    q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int, device: torch.device
) -> Tensor:
    """True where key position <= query position: [n, m], or [batch, 1, n, m]."""
    q_pos = positions_or_default(q_positions, m - n, n, device)
    k_pos = positions_or_default(k_positions, 0, m, device)
    allowed = k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)  # [..., n, m]
    return allowed.unsqueeze(1) if allowed.dim() == 3 else allowed


def check_window(window: int | None) -> int | None:
    """A sliding window: None, or a positive int (ValueError naming ``window``).

    Windows past every distance positions can have (2^53) are clipped to 2^53, which
    keeps them comparable with int64 distances and changes nothing.
    """
    if window is None:
        return None
    return min(positive_int(window, "window"), MAX_POSITION + 1)


def check_document_ids(
    document_ids: Tensor | None, n: int, m: int, batch: int, device: torch.device
) -> Tensor | None:
    """Validate the keys' document ids: integers [M] or [batch or 1, M] on ``device``.

    Packed sequences: key j belongs to document document_ids[..., j], and query i to
    document_ids[..., M - N + i] (the queries are the last N keys, as with a KV cache),
    so N > M raises ValueError. Returns int64 [M] or [batch or 1, M].
    """
    if document_ids is None:
        return None
    name = "document_ids"
    if not isinstance(document_ids, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(document_ids).__name__}")
    check_strided(document_ids, name)
    if (
        document_ids.is_floating_point()
        or document_ids.is_complex()
        or document_ids.dtype == torch.bool
    ):
        raise ValueError(f"{name} must hold integer document ids (int64), got {document_ids.dtype}")
    if document_ids.dim() not in (1, 2) or document_ids.shape[-1] != m:
        raise ValueError(
            f"{name} must have shape [{m}] or [batch, {m}] (one id per key), got "
            f"{list(document_ids.shape)}"
        )
    if document_ids.dim() == 2 and document_ids.shape[0] not in (1, batch):
        raise ValueError(f"{name} has batch {document_ids.shape[0]}, inputs have batch {batch}")
    if document_ids.device != torch.device(device):
        raise ValueError(
            f"{name} is on {document_ids.device}, the inputs on {device}: create it on the "
            "inputs' device"
        )
    if n > m:
        raise ValueError(
            f"{name} gives the keys' documents and the queries are the last N keys, so "
            f"{n} queries need at least as many keys, got {m}"
        )
    return document_ids.to(dtype=torch.int64)


def attention_allowed(
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    n: int,
    m: int,
    device: torch.device,
    causal: bool,
    window: int | None = None,
    document_ids: Tensor | None = None,
    query_documents: Tensor | None = None,
) -> Tensor | None:
    """True where query i may attend key j: [n, m] or [batch, 1, n, m]; None when nothing
    masks.

    With d = query position - key position (positions as ``causal_allowed`` reads them):
    ``causal`` needs d >= 0, ``window`` needs |d| < window (with causal:
    0 <= d < window), and ``document_ids`` (keys' documents, [M] or [batch, M]) needs
    query i's document, ``query_documents[..., i]`` (by default
    document_ids[..., M - N + i]: the queries are the last N keys), to be key j's.
    """
    if not causal and window is None and document_ids is None:
        return None
    allowed: Tensor | None = None
    if causal or window is not None:
        q_pos = positions_or_default(q_positions, m - n, n, device)
        k_pos = positions_or_default(k_positions, 0, m, device)
        distance = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # [..., n, m] query - key
        if causal:
            allowed = distance >= 0  # the key at or before the query
        if window is not None:
            near = distance < window if causal else distance.abs() < window
            allowed = near if allowed is None else allowed & near
    if document_ids is not None:
        if query_documents is None:
            query_documents = document_ids[..., m - n :]
        same = query_documents.unsqueeze(-1) == document_ids.unsqueeze(-2)
        allowed = same if allowed is None else allowed & same  # [..., n, m]
    assert allowed is not None
    return allowed.unsqueeze(1) if allowed.dim() == 3 else allowed


def distance_allowed(
    n: int, m: int, device: torch.device, causal: bool, window: int | None
) -> Tensor | None:
    """``attention_allowed`` per diagonal for default positions: bool [n + m - 1] (entry t
    at key minus query position r = t - (M - 1), see ``default_distances``), or None."""
    if not causal and window is None:
        return None
    r = default_distances(n, m, device)  # key - query
    allowed = r <= 0 if causal else None
    if window is not None:
        near = r > -window if causal else r.abs() < window
        allowed = near if allowed is None else allowed & near
    return allowed


def key_span(i0: int, i1: int, n: int, m: int, causal: bool, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that queries i0 .. i1 - 1 of n may read at default positions (the
    queries are the last n of m keys), under ``causal`` and ``window``."""
    first, last = m - n + i0, m - n + i1 - 1  # the positions of the first and last query
    hi = last + 1 if causal else m
    lo = 0
    if window is not None:
        lo = max(0, first - window + 1)
        hi = min(hi, last + window)
    return lo, hi


def query_chunks(
    n: int,
    m: int,
    device_type: str,
    causal: bool,
    window: int | None,
    views: bool = False,
    mask_row_bytes: int = 0,
) -> list[tuple[int, int, int, int]]:
    """(i0, i1, lo, hi) per SDPA call: queries i0 .. i1 - 1 and the keys [lo, hi) they may
    read (``key_span``), ``SDPA_QUERY_CHUNK`` queries at a time on ``device_type``, or
    ``SDPA_LONG_QUERY_CHUNK``'s larger chunks for long sequences where every chunk's
    mask is a view (``views``) and no window limits the keys; one call over every key
    where it sets no chunk or n fits in one. ``mask_row_bytes``: where each chunk builds
    a mask of its own, the bytes of one query's row of it, which caps the chunk at
    ``SDPA_MASK_CHUNK_BYTES`` (``mask_chunk_rows``)."""
    chunk = SDPA_QUERY_CHUNK.get(device_type)
    long = SDPA_LONG_QUERY_CHUNK.get(device_type)
    if chunk is not None and long is not None and views and window is None and n >= long[0]:
        chunk = max(chunk, long[1])
    if chunk is not None and mask_row_bytes:
        chunk = min(chunk, mask_chunk_rows(device_type, mask_row_bytes))
    if chunk is None or n <= chunk:
        return [(0, n, 0, m)]
    return [
        (i0, min(i0 + chunk, n), *key_span(i0, min(i0 + chunk, n), n, m, causal, window))
        for i0 in range(0, n, chunk)
    ]


def document_spans(
    spans: list[tuple[int, int, int, int]], document_ids: Tensor | None, n: int, m: int
) -> list[tuple[int, int, int, int]]:
    """``spans`` (i0, i1, lo, hi) with each one's keys narrowed to those sharing a
    document with one of its queries in some batch row (query i's document is key
    M - N + i's): from the first such key to the last. Keys outside are masked for every
    query of the span, so packed documents cost each chunk only its own documents' keys.

    document_ids: validated int64 [M] or [batch, M], or None (spans unchanged). A span's
    keys need not hold its queries' own keys (``position_spans`` narrows them by
    position first): a span none of whose keys shares a document with its queries keeps
    its keys (its mask hides them all). One read of the ids per call (a host sync):
    eager mode with several spans only; otherwise the spans as given.
    """
    if document_ids is None or len(spans) < 2 or torch.compiler.is_compiling():
        return spans
    ids = document_ids if document_ids.dim() == 2 else document_ids.unsqueeze(0)  # [B, M]
    # (batch row, document) as one code, so that one isin serves every row
    distinct, dense = torch.unique(ids, return_inverse=True)  # dense: [B, M] in [0, U)
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)  # [B, 1]
    codes = dense + rows * distinct.numel()  # [B, M]
    bounds = []
    for i0, i1, lo, hi in spans:
        keys = codes[:, lo:hi].contiguous()  # [B, hi - lo]
        shared = torch.isin(keys, codes[:, m - n + i0 : m - n + i1].reshape(-1)).any(0)
        shared = shared.to(torch.uint8)  # [hi - lo]: 1 where a key shares a document
        # argmax gives the first 1, or 0 where there is none: then (lo, hi) stay
        first = shared.argmax()
        last = (hi - lo - 1) - shared.flip(0).argmax()
        bounds.append(torch.stack([first, last]) + lo)
    firsts_and_lasts = torch.stack(bounds).tolist()  # one sync for every span
    return [
        (i0, i1, first, last + 1)
        for (i0, i1, _, _), (first, last) in zip(spans, firsts_and_lasts, strict=True)
    ]


def reachable_query_chunks(
    n: int,
    m: int,
    device_type: str,
    causal: bool,
    window: int | None,
    document_ids: Tensor | None,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    mask_row_bytes: int = 0,
) -> list[tuple[int, int, int, int]]:
    """``query_chunks`` over the keys each chunk may read: those its causal mask or
    window allows, by index at default positions (both None), and at explicit ones by
    position (``position_spans``); then narrowed to its documents' keys
    (``document_spans``). ``mask_row_bytes``: see ``query_chunks``."""
    by_index = q_positions is None and k_positions is None
    spans = query_chunks(
        n,
        m,
        device_type,
        causal and by_index,
        window if by_index else None,
        mask_row_bytes=mask_row_bytes,
    )
    spans = position_spans(spans, q_positions, k_positions, causal, window, n, m)
    return document_spans(spans, document_ids, n, m)


def position_spans(
    spans: list[tuple[int, int, int, int]],
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    causal: bool,
    window: int | None,
    n: int,
    m: int,
) -> list[tuple[int, int, int, int]]:
    """``spans`` (i0, i1, lo, hi) with each one's keys narrowed, where masking follows
    explicit positions, to the first and last key that the causal mask or window may
    let one of its queries read: a key at or before the span's latest query position
    (causal), within ``window`` of its earliest (causal) or of any (not causal), in some
    batch row. Keys outside are masked for every query of the span, so increasing
    positions given with a causal mask (Hugging Face's ``position_ids``, say) skip the
    keys after each chunk, as default positions do. A span whose queries may read no
    key keeps its keys.

    q_positions: [N] or [batch, N]; k_positions: [M] or [batch, M]; either None for
    the defaults. Key bounds come from prefix and suffix minima and maxima of the key
    positions (O(M), no [spans, M] grid) and one read of them per call (a host sync):
    eager mode with several spans only; otherwise the spans as given."""
    given = q_positions is not None or k_positions is not None
    masked = causal or window is not None
    if not (given and masked) or len(spans) < 2 or torch.compiler.is_compiling():
        return spans
    given_positions = q_positions if q_positions is not None else k_positions
    assert given_positions is not None  # given
    device = given_positions.device
    q_pos = positions_or_default(q_positions, m - n, n, device).reshape(-1, n)  # [B or 1, N]
    k_pos = positions_or_default(k_positions, 0, m, device).reshape(-1, m)  # [B or 1, M]
    # each span's latest and earliest query position over its queries and batch rows
    sizes = torch.tensor([i1 - i0 for i0, i1, _, _ in spans], device=device)
    span_of = torch.repeat_interleave(torch.arange(len(spans), device=device), sizes)  # [N]
    latest = _per_span(q_pos.amax(0), span_of, len(spans), "amax")  # [S]
    earliest = _per_span(q_pos.amin(0), span_of, len(spans), "amin")  # [S]
    k_low, k_high = k_pos.amin(0), k_pos.amax(0)  # [M]: the keys' lowest and highest positions
    # keys some query may read: position <= top (k_low), and > bottom (k_high)
    top = latest if window is None or causal else latest + (window - 1)
    first, last = _index_range_at_most(k_low, top)  # [S] each
    if window is not None:
        first_above, last_above = _index_range_above(k_high, earliest - window)
        first, last = torch.maximum(first, first_above), torch.minimum(last, last_above)
    bounds = torch.stack([first, last]).t().tolist()  # one sync for every span
    return [
        (i0, i1, max(lo, first_key), min(hi, last_key + 1))
        if first_key <= last_key and max(lo, first_key) < min(hi, last_key + 1)
        else (i0, i1, lo, hi)
        for (i0, i1, lo, hi), (first_key, last_key) in zip(spans, bounds, strict=True)
    ]


def _per_span(per_query: Tensor, span_of: Tensor, spans: int, reduce: str) -> Tensor:
    """``reduce`` ("amax" or "amin") of ``per_query`` [N] over each span's queries
    (``span_of`` [N]: the span of each query) -> [spans]."""
    out = per_query.new_zeros(spans)
    return out.scatter_reduce_(0, span_of, per_query, reduce, include_self=False)


def _index_range_at_most(values: Tensor, bound: Tensor) -> tuple[Tensor, Tensor]:
    """The first and last index j of ``values`` [M] with values[j] <= bound, for each
    entry of ``bound`` [S] (first > last where there is none): searches in the running
    minimum from the left (non-increasing) and from the right (non-decreasing)."""
    from_left = values.cummin(0).values  # [M], non-increasing
    from_right = values.flip(0).cummin(0).values.flip(0)  # [M], non-decreasing
    first = torch.searchsorted(-from_left, -bound)  # first j with from_left[j] <= bound
    last = torch.searchsorted(from_right, bound, right=True) - 1  # last j with from_right <= bound
    return first, last


def _index_range_above(values: Tensor, bound: Tensor) -> tuple[Tensor, Tensor]:
    """The first and last index j of ``values`` [M] with values[j] > bound, for each
    entry of ``bound`` [S] (first > last where there is none)."""
    first, last = _index_range_at_most(-values, -bound - 1)  # -v <= -b - 1 <=> v > b (ints)
    return first, last


def mask_chunk_rows(device_type: str, mask_row_bytes: int) -> int:
    """The most queries per chunk whose own mask, at ``mask_row_bytes`` a query, fits in
    ``SDPA_MASK_CHUNK_BYTES`` on ``device_type``: at least ``SDPA_MASK_CHUNK_MIN_ROWS``
    (no cap where the device sets no budget)."""
    budget = SDPA_MASK_CHUNK_BYTES.get(device_type)
    if budget is None:
        return 1 << 62
    return max(SDPA_MASK_CHUNK_MIN_ROWS, budget // max(mask_row_bytes, 1))


def document_chunks_serve(spans: list[tuple[int, int, int, int]], n: int, m: int) -> bool:
    """Whether attention with no position term runs in the chunks ``spans`` (narrowed to
    their documents' keys, or to the keys explicit positions may reach) rather than one
    call with the mask: several of them, holding at most ``DOCUMENT_CHUNKS_MAX_COVER``
    of the N x M pairs."""
    pairs = sum((i1 - i0) * (hi - lo) for i0, i1, lo, hi in spans)
    return len(spans) > 1 and pairs <= DOCUMENT_CHUNKS_MAX_COVER * n * m


def relative_positions(
    q_positions: Tensor | None, k_positions: Tensor | None, n: int, m: int, device: torch.device
) -> Tensor:
    """Key position minus query position: [n, m], or [batch, n, m] for batched positions."""
    q_pos = positions_or_default(q_positions, m - n, n, device)
    k_pos = positions_or_default(k_positions, 0, m, device)
    return k_pos.unsqueeze(-2) - q_pos.unsqueeze(-1)


def check_attn_mask(attn_mask: Tensor | None, q: Tensor, m: int) -> Tensor | None:
    """attn_mask: bool (True = attend) or additive float, broadcastable to [B, H, N, M];
    returned on q's device with at least 2 dims (a [M] or 0-d mask as the [1, M] or
    [1, 1] that broadcasting reads, as SDPA needs)."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, Tensor):
        raise ValueError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
    check_strided(attn_mask, "attn_mask")
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"attn_mask must be bool, float16, bfloat16, float32 or float64, got {attn_mask.dtype}"
        )
    if attn_mask.is_meta and not q.is_meta:  # moved to q's device below: it has no values
        raise ValueError(
            f"attn_mask is on the meta device (it holds no values); q is on {q.device}"
        )
    target = (q.shape[0], q.shape[1], q.shape[2], m)
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got {attn_mask.dim()}")
    # each of the mask's (trailing-aligned) dims is 1 or the target's: broadcasting the
    # two shapes must give [B, H, N, M] itself, not a larger shape
    if not broadcasts_into(tuple(attn_mask.shape), target):
        raise ValueError(
            f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to {list(target)}"
        )
    if attn_mask.dim() < 2:
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
    return attn_mask.to(q.device)


def attn_mask_reads(attn_mask: Tensor) -> Tensor:
    """True where a checked attn_mask (``check_attn_mask``) lets the query read the key:
    a bool mask's True entries, a float mask's entries above half its dtype's lowest
    value (-inf masks, and so does a finite entry as hard as Hugging Face's finfo.min,
    whose softmax weight is 0). Bool, the mask's shape."""
    if attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask > torch.finfo(attn_mask.dtype).min / 2


def attn_mask_span(
    attn_mask: Tensor | None, n: int, m: int, i0: int, i1: int, lo: int, hi: int
) -> Tensor | None:
    """Rows i0 .. i1 - 1 (of n queries) and columns lo .. hi - 1 (of m keys) of an
    attn_mask broadcastable to [B, H, n, m]; a dimension that broadcasts (size 1, or
    absent) stays as it is."""
    if attn_mask is None:
        return None
    if attn_mask.dim() >= 2 and attn_mask.shape[-2] == n:
        attn_mask = attn_mask[..., i0:i1, :]
    if attn_mask.shape[-1] == m:
        attn_mask = attn_mask[..., lo:hi]
    return attn_mask


def pair_documents(document_ids: Tensor | None, n: int, m: int) -> tuple[Tensor, Tensor] | None:
    """(the queries' documents [..., N], the keys' documents [..., M]) of packed
    ``document_ids`` (the keys' documents, [M] or [batch, M]; the queries are the last N
    keys), for terms that read keys other than the pair's own (CoPE's count); None
    without documents."""
    if document_ids is None:
        return None
    return document_ids[..., m - n :], document_ids


def same_document(documents: tuple[Tensor, Tensor]) -> Tensor:
    """True where query i and key j are in one document: [N, M] or [batch, 1, N, M]."""
    query_documents, key_documents = documents
    same = query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)  # [..., N, M]
    return same.unsqueeze(1) if same.dim() == 3 else same


def documents_joined(
    attn_mask: Tensor | None, documents: tuple[Tensor, Tensor] | None
) -> Tensor | None:
    """An attn_mask (or a block of one, or None) with the packed documents' rule joined:
    a pair of different documents is masked (False, or -inf in an additive mask).
    documents: the queries' and keys' documents of that block (``pair_documents``, or
    their slices), or None (the mask as given)."""
    if documents is None:
        return attn_mask
    same = same_document(documents)  # [rows, keys] or [batch, 1, rows, keys]
    if attn_mask is None:
        return same
    if attn_mask.dtype == torch.bool:
        return attn_mask & same
    return torch.where(same, attn_mask, float("-inf"))


def apply_masks(logits: Tensor, allowed: Tensor | None, attn_mask: Tensor | None) -> Tensor:
    """Add masks to float logits: -inf where not allowed, plus an additive attn_mask."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float("-inf"))
        else:
            logits = logits + attn_mask.to(logits.dtype)
    return logits


def bias_with_attn_mask(bias: Tensor, attn_mask: Tensor | None) -> Tensor:
    """A float bias [..., N, M] with an attn_mask broadcastable against it (bool: True =
    attend, -inf elsewhere; float: added in the bias's dtype), as one tensor of their
    broadcast shape (one op, where ``apply_masks`` keeps the bias's own shape)."""
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return torch.where(attn_mask, bias, float("-inf"))
    return bias + attn_mask.to(bias.dtype)


def accumulated(total: Tensor | None, term: Tensor) -> Tensor:
    """total + term, in place where total is a fresh tensor of the broadcast shape (the
    caller's own sum); term itself where there is no total yet (then it must be fresh:
    later terms are added into it)."""
    if total is None:
        return term
    if broadcasts_into(term.shape, total.shape):
        return total.add_(term)
    return total + term


def broadcasts_into(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether broadcasting ``shape`` against ``target`` gives ``target`` itself: each of
    its dims, aligned at the end, is 1 or the target's. (``torch.broadcast_shapes``
    takes 11 us a call on a 2-core CPU, a few percent of a decode step.)"""
    if len(shape) > len(target):
        return False
    aligned = target[len(target) - len(shape) :]
    return all(size in (1, want) for size, want in zip(shape, aligned, strict=True))


def sum_into_new(parts: list[Tensor]) -> Tensor:
    """The sum of broadcastable tensors as one freshly allocated tensor (summed in place).

    The largest part comes first so that every later one broadcasts into it.
    """
    largest = 0
    for index, part in enumerate(parts):  # a loop, not sorted(key=...): torch.compile traces it
        if part.dim() > parts[largest].dim():
            largest = index
    rest = parts[:largest] + parts[largest + 1 :]
    total = parts[largest] + rest[0] if rest else parts[largest].clone()
    for part in rest[1:]:
        total.add_(part)
    return total


def block_fresh(scores: Tensor, allowed: Tensor) -> Tensor:
    """-inf where not allowed, in place when the freshly made ``scores`` has the full shape."""
    if broadcasts_into(allowed.shape, scores.shape):
        return scores.masked_fill_(~allowed, float("-inf"))
    return scores.masked_fill(~allowed, float("-inf"))


#: queries per SDPA call (``query_chunks``), per device type, None: one call; used at
#: default positions for a bias of j - i alone that is masked (causal, window) or
#: trained, for other biases and relative terms under causal or window masking (built
#: per chunk at its positions), and for a window or causal last-N-of-M queries without
#: a bias. Each call
#: reads only the keys its queries may see (``key_span``): SDPA's kernels skip no
#: masked block once a mask is given, and a mask that requires grad takes the CPU's
#: unfused math kernel, whose [B, H, rows, M] scores then stay in cache. CPU, float32,
#: N = 2048, B=2, H=16, D=64, 2 threads, against plain SDPA: causal ALiBi forward
#: 1.72x -> 1.20x, T5 training 6.65x -> 2.63x causal and 3.87x -> 3.56x not
#: (benchmarks/results/attention_backends_cpu_float32_bias_flushed.md, chunk none
#: against chunk 256); a causal window of 256 (..._window256.md): rope forward
#: 1.26x -> 0.49x SDPA with the window's mask
SDPA_QUERY_CHUNK: dict[str, int | None] = {"cpu": 256}
#: where every chunk of queries builds a mask of its own (a position bias at explicit
#: positions, or one that no per-distance vector gives), the bytes that one chunk's
#: mask may take, per device type, and the fewest queries a chunk is cut to; where the
#: masks need no gradient, the chunks keep ``SDPA_QUERY_CHUNK`` queries and only each
#: part of their masks is cut so (``_mask_buffer.AssembledMasks``). glibc's
#: malloc gives each block of more than 32 MiB back to the system when it is freed, so
#: the next chunk's block is paged in afresh (a fault per 4 KiB, about 1 us each);
#: smaller blocks are reused from the heap. 2-core CPU, float32, N = 2048, batch 2, 16
#: heads, positions 2 apart, against plain SDPA, chunks of 256 -> masks of at most
#: 8 MiB (64 queries): forward ALiBi 2.45x -> 2.25x, T5 2.96x -> 2.42x, FIRE 3.03x ->
#: 2.85x (causal 2.99x -> 2.30x; ALiBi and T5 causal within noise), training steps T5
#: 3.04x -> 2.51x, FIRE 3.55x -> 2.80x (causal 2.52x -> 2.21x, 3.95x -> 2.45x); peak
#: extra memory of the forward 118 -> 42 MiB; 4 MiB lost to per-chunk work
#: (benchmarks/results/attention_backends_cpu_float32_mask_chunks.md)
SDPA_MASK_CHUNK_BYTES: dict[str, int] = {"cpu": 8 << 20}
SDPA_MASK_CHUNK_MIN_ROWS = 32
#: with packed documents and no position term, the sdpa backend runs its queries in
#: chunks (each over its documents' keys, ``document_spans``) only where the chunks hold
#: at most this fraction of the N x M pairs (``document_chunks_serve``), else one SDPA call with
#: the mask. `rope` at N = 2048 on 2 threads, against plain SDPA with the documents'
#: mask (which is what one call runs): chunks over every key 1.27x
#: (attention_backends_cpu_float32_documents.md, before this threshold); one document,
#: causal (5/8 of the pairs), 0.73x in chunks against 1.13x in one call
#: (..._documents_rope1.md)
DOCUMENT_CHUNKS_MAX_COVER = 0.75
#: where every chunk's mask is a view (no per-chunk [B, H, rows, M] tensor) and no
#: window limits the keys (``query_chunks(..., views=True)``), per device type: from the
#: first number of queries on, chunks of the second. The CPU flash kernel splits a
#: call's queries into blocks of 256 rows from 768 queries on (64 below) and reads
#: every block of keys once per block of queries, so a long sequence in chunks of 1024
#: reads its keys a quarter as often. ALiBi, causal, 2-core CPU, float32, B=2, H=16,
#: D=64, against plain SDPA, chunks of 256 -> 1024: N = 8192 forward 1.31x -> 1.16x,
#: training step 1.50x -> 1.16x; N = 4096 forward 1.22x -> 1.25x, training 1.33x ->
#: 1.23x; at N = 2048 chunks of 1024 lost (forward 1.19x -> 1.36x, training 1.22x ->
#: 1.33x) (benchmarks/results/attention_backends_cpu_float32_chunks.md)
SDPA_LONG_QUERY_CHUNK: dict[str, tuple[int, int]] = {"cpu": (4096, 1024)}
