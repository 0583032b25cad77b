"""Independent float64 reference for untied absolute positions (TUPE).

Ke, He and Liu 2021, "Rethinking Positional Encoding in Language Pre-training"
(arXiv:2006.15595), eq. (6)-(7). Per head, with d the head dimension:

    a_ij = 1/sqrt(2d) (x_i W_q)(x_j W_k)^T              content, untied from positions
         + 1/sqrt(2d) (p_i U_q)(p_j U_k)^T              positions, their own projections
         + b_(j-i)                                       TUPE-R only: T5's bucketed bias

p is a learned [max_positions, model_dim] table that is never added to the input; U_q, U_k
map model_dim to heads * head_dim (head h owns output features h*d .. h*d + d - 1). The
authors' released code also normalises each table row with a LayerNorm and gives the
projections an offset; both are optional arguments here (``norm``, ``q_bias``/``k_bias``).

[CLS] reset (paper section 3.3, ``first_token_reset``): the first token's scores are not
tied to a position. As the authors' code lays it out, the table has one leading row (row 0)
and position t reads row t + 1; every score of query position 0 is the per-head constant
theta_1 = (r_0 U_q)(r_0 U_k)^T, every other score against key position 0 is theta_2 =
(r_1 U_q)(r_1 U_k)^T, and the relative bias uses the spare bucket rows num_buckets / 2
(query 0) and num_buckets (key 0) of a [num_buckets + 1, heads] table.

Written with Python loops over scalars, from the formula, not from the generated code. The
relative bucket comes from :func:`tests.reference.formulas.t5_relative_bucket`, itself
pinned to hand values. Nothing here imports ``posgen``, ``generated`` or ``templates``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tests.reference.formulas import attention, t5_relative_bucket

F64 = torch.float64

__all__ = ["layer_norm_row", "project_row", "tupe_attention", "tupe_logits", "tupe_position_scores"]


def layer_norm_row(
    row: list[float], gain: list[float], shift: list[float], eps: float
) -> list[float]:
    """LayerNorm of one row: (x - mean) / sqrt(var + eps) * gain + shift (biased variance)."""
    n = len(row)
    mean = sum(row) / n
    var = sum((x - mean) ** 2 for x in row) / n
    scale = 1.0 / math.sqrt(var + eps)
    return [(x - mean) * scale * g + s for x, g, s in zip(row, gain, shift, strict=True)]


def project_row(
    row: list[float], weight: list[list[float]], bias: list[float] | None
) -> list[float]:
    """u_o = sum_i weight[o][i] * row[i] (+ bias[o]): nn.Linear's [out, in] layout."""
    out = []
    for o, weights in enumerate(weight):
        total = sum(w * x for w, x in zip(weights, row, strict=True))
        out.append(total + (bias[o] if bias is not None else 0.0))
    return out


def _rows(t: Tensor | None) -> list | None:
    return None if t is None else t.detach().to(F64).tolist()


def tupe_position_scores(
    table: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    heads: int,
    head_dim: int,
    q_positions: list[int],
    k_positions: list[int],
    scale: float,
    q_bias: Tensor | None = None,
    k_bias: Tensor | None = None,
    norm: tuple[Tensor, Tensor, float] | None = None,
    relative_table: Tensor | None = None,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
    bias_inside_scale: bool = False,
    first_token_reset: bool = False,
) -> Tensor:
    """The position-only logits [heads, N, M]:

        scale * sum_e (p_i U_q)[h*d + e] (p_j U_k)[h*d + e]  (+ table[bucket(j - i), h])

    (with ``bias_inside_scale`` the bias is added before multiplying by the scale).
    Positions at or past the table's length raise ValueError: a learned table has no rows
    for them.
    """
    rows = _rows(table)
    shift = 1 if first_token_reset else 0
    for pos in list(q_positions) + list(k_positions):
        if not 0 <= pos + shift < len(rows):
            raise ValueError(f"position {pos} has no row in a table of {len(rows)} rows")
    wq, wk, bq, bk = _rows(q_weight), _rows(k_weight), _rows(q_bias), _rows(k_bias)
    rel = _rows(relative_table)

    def prepared(pos: int) -> list[float]:
        row = rows[pos]
        if norm is not None:
            gain, shift, eps = norm
            row = layer_norm_row(row, _rows(gain), _rows(shift), eps)
        return row

    uq = [project_row(prepared(i + shift), wq, bq) for i in q_positions]
    uk = [project_row(prepared(j + shift), wk, bk) for j in k_positions]

    def head_dot(u: list[float], w: list[float], h: int) -> float:
        return sum(u[h * head_dim + e] * w[h * head_dim + e] for e in range(head_dim))

    slot_q = [project_row(prepared(r), wq, bq) for r in (0, 1)]
    slot_k = [project_row(prepared(r), wk, bk) for r in (0, 1)]
    out = torch.zeros(heads, len(q_positions), len(k_positions), dtype=F64)
    for h in range(heads):
        for a, i in enumerate(q_positions):
            for b, j in enumerate(k_positions):
                dot = head_dot(uq[a], uk[b], h)
                bucket = None
                if rel is not None:
                    bucket = t5_relative_bucket(j - i, bidirectional, num_buckets, max_distance)
                if first_token_reset and i == 0:
                    dot, bucket = head_dot(slot_q[0], slot_k[0], h), num_buckets // 2
                elif first_token_reset and j == 0:
                    dot, bucket = head_dot(slot_q[1], slot_k[1], h), num_buckets
                extra = rel[bucket][h] if rel is not None else 0.0
                value = (dot + extra) * scale if bias_inside_scale else dot * scale + extra
                out[h, a, b] = value
    return out


def tupe_logits(q: Tensor, k: Tensor, position_scores: Tensor, scale: float) -> Tensor:
    """a_ij = scale * q_i . k_j + position_scores[h, i, j] for q [heads, N, d], k [heads, M, d]."""
    heads, n, d = q.shape
    m = k.shape[1]
    q64, k64 = q.to(F64).tolist(), k.to(F64).tolist()
    out = torch.zeros(heads, n, m, dtype=F64)
    for h in range(heads):
        for i in range(n):
            for j in range(m):
                content = sum(q64[h][i][e] * k64[h][j][e] for e in range(d))
                out[h, i, j] = scale * content + float(position_scores[h, i, j])
    return out


def tupe_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    position_scores: Tensor,
    scale: float,
    causal_q_positions: list[int] | None = None,
    causal_k_positions: list[int] | None = None,
) -> Tensor:
    """softmax_j(a_ij) v_j for one batch row or many, q/k/v [batch, heads, seq, dim]."""
    causal = {}
    if causal_q_positions is not None:
        causal = {
            "causal_q_positions": torch.tensor(causal_q_positions),
            "causal_k_positions": torch.tensor(causal_k_positions),
        }
    return attention(q, k, v, bias=position_scores, scale=scale, **causal)
