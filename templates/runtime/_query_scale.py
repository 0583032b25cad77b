"""Query scales: the factor tau(i) each query vector is multiplied by, from its position.

The factors are computed from integer positions in float64 (exact for every position
below 2^53: the floor of (i + 1) / s is an integer division); ``scaled_queries``
multiplies q by them (and by a trained factor per head, where the scale has one) in
float32 (float64 for float64 queries) and rounds once to q's dtype, as Hugging Face's
Llama 4 attention does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def floor_log_query_scales(positions: Tensor, floor_scale: int, attn_scale: float) -> Tensor:
    """tau(i) = 1 + attn_scale * ln(1 + floor((i + 1) / floor_scale)) per position,
    float64, of positions' shape (Llama 4's attention temperature tuning)."""
    steps = torch.div(positions + 1, floor_scale, rounding_mode="floor")  # int64, exact
    return torch.log1p(steps.to(torch.float64)) * attn_scale + 1.0


def log_length_query_scales(positions: Tensor, original_max_positions: int) -> Tensor:
    """tau(i) = max(1, ln(i + 1) / ln(original_max_positions)) per position, float64, of
    positions' shape (log-length scaling, Qwen's LogN-Scaling)."""
    ratio = torch.log1p(positions.to(torch.float64)) / math.log(original_max_positions)
    return ratio.clamp(min=1.0)


def log_count_query_scales(positions: Tensor) -> Tensor:
    """ln(i + 1) per position, float64, of positions' shape: the log of the keys a causal
    query at position i sees (Scalable-Softmax's ln n, times s per head)."""
    return torch.log1p(positions.to(torch.float64))


def scaled_queries(q: Tensor, scales: Tensor, per_head: Tensor | None = None) -> Tensor:
    """q [B, H, N, D] times scales [N] or [B, N] (float64) per query, and times
    per_head [H] (a trained factor, whose gradient flows) where given, computed in
    float32 (float64 for float64 q) and rounded once to q's dtype."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    per_query = scales.to(dtype)  # [N] or [B, N]
    per_query = per_query[:, None, :, None] if per_query.dim() == 2 else per_query[:, None]
    if per_head is not None:  # [H, N, 1] or [B, H, N, 1]
        per_query = per_query * per_head.to(dtype)[:, None, None]
    return (q * per_query).to(q.dtype)  # [B, H, N, D]
