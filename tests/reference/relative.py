"""Independent float64 references for relative position terms read from a table.

Written from the papers (and, where a paper leaves a detail open, from the public code of
the reference implementation, read for facts only). Literal loops over (i, j); nothing
here imports from ``posgen``, ``generated`` or ``templates``. Shared pieces (the DeBERTa
log bucket, Shaw attention, Transformer-XL scores) live in :mod:`tests.reference.formulas`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tests.reference.formulas import deberta_log_bucket_position

F64 = torch.float64

__all__ = ["clipped_relative_logits", "disentangled_logits"]


def _ints(positions: Tensor) -> list[int]:
    return [int(p) for p in positions.tolist()]


def clipped_relative_logits(
    q: Tensor,
    k: Tensor,
    table: Tensor,
    q_positions: Tensor,
    k_positions: Tensor,
    clip: int,
    key_side: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Relative key (and query) embeddings over query-minus-key distances.

    Shaw et al. 2018 (arXiv:1803.02155) key-side term with the sign and layout of the
    BERT ``relative_key`` / ``relative_key_query`` attention (Huang et al. 2020,
    arXiv:2009.13658, method 4)::

        d_ij  = clip(p_i - p_j, -clip, clip)
        a_ij  = scale * (q_i . k_j + q_i . table[d_ij + clip] [+ k_j . table[d_ij + clip]])

    ``q`` ``[..., N, d]``, ``k`` ``[..., M, d]``, ``table`` ``[2 clip + 1, d]`` (shared by
    heads); ``scale`` defaults to 1/sqrt(d). Returns ``[..., N, M]`` float64.
    """
    q64, k64, t64 = q.to(F64), k.to(F64), table.to(F64)
    if t64.shape[0] != 2 * clip + 1:
        raise ValueError(f"table must have 2 * clip + 1 = {2 * clip + 1} rows")
    s = 1.0 / math.sqrt(q64.shape[-1]) if scale is None else float(scale)
    qs, ks = _ints(q_positions), _ints(k_positions)
    rows = []
    for i, pi in enumerate(qs):
        row = []
        for j, pj in enumerate(ks):
            r = t64[min(max(pi - pj, -clip), clip) + clip]
            total = (q64[..., i, :] * k64[..., j, :]).sum(-1) + (q64[..., i, :] * r).sum(-1)
            if key_side:
                total = total + (k64[..., j, :] * r).sum(-1)
            row.append(s * total)
        rows.append(torch.stack(row, dim=-1))
    return torch.stack(rows, dim=-2)


def disentangled_logits(
    q: Tensor,
    k: Tensor,
    pos_key: Tensor,
    pos_query: Tensor,
    q_positions: Tensor,
    k_positions: Tensor,
    bucket_size: int,
    max_position: int,
) -> Tensor:
    """DeBERTa disentangled attention logits, He et al. 2021 (arXiv:2006.03654), eq. (4).

    With δ(r) = clamp(bucket(r) + span, 0, 2 span - 1), span = bucket_size and
    ``bucket`` = :func:`deberta_log_bucket_position`::

        c2p_ij = q_i . pos_key[δ(p_i - p_j)]            (content -> position)
        p2c_ij = k_j . pos_query[clamp(-bucket(p_j - p_i) + span, 0, 2 span - 1)]
                                                        (position -> content)
        a_ij   = (q_i . k_j + c2p_ij + p2c_ij) / sqrt(3 d)

    (the p2c index is the key-to-query relative position negated, as in the DeBERTa-v2
    code). ``pos_key`` / ``pos_query`` are the projected relative embeddings per head,
    ``[..., 2 span, d]`` broadcast against q and k. Returns ``[..., N, M]`` float64.
    """
    q64, k64 = q.to(F64), k.to(F64)
    pk, pq = pos_key.to(F64), pos_query.to(F64)
    span = bucket_size
    d = q64.shape[-1]
    s = 1.0 / math.sqrt(3 * d)
    qs, ks = _ints(q_positions), _ints(k_positions)

    def clamp(row: int) -> int:
        return min(max(row, 0), 2 * span - 1)

    rows = []
    for i, pi in enumerate(qs):
        row = []
        for j, pj in enumerate(ks):
            c2p_row = clamp(deberta_log_bucket_position(pi - pj, bucket_size, max_position) + span)
            p2c_row = clamp(-deberta_log_bucket_position(pj - pi, bucket_size, max_position) + span)
            content = (q64[..., i, :] * k64[..., j, :]).sum(-1)
            c2p = (q64[..., i, :] * pk[..., c2p_row, :]).sum(-1)
            p2c = (k64[..., j, :] * pq[..., p2c_row, :]).sum(-1)
            row.append(s * (content + c2p + p2c))
        rows.append(torch.stack(row, dim=-1))
    return torch.stack(rows, dim=-2)
