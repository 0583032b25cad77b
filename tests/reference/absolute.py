"""Independent float64 references for input-level (absolute) position encodings.

Written from the papers' formulas as literal loops and scalar ``math``, never from the
generated code. Nothing here imports from ``posgen``, ``generated`` or ``templates``.
Shared formulas that were pinned earlier (hierarchical positions, complex order) live in
:mod:`tests.reference.formulas`; this module adds the rest.

All tensors returned are ``torch.float64``.
"""

from __future__ import annotations

import torch
from torch import Tensor

F64 = torch.float64

__all__ = ["combine_input", "plain_logits"]


def plain_logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Content-only logits of attention without positions (NoPE, Kazemnejad et al. 2023).

    Formula::

        logits[b, h, i, j] = scale * sum_d q[b, h, i, d] * k[b, h, j, d]

    written as a loop over the feature index, in float64. Returns ``[B, H, N, M]``.
    """
    q64, k64 = q.to(F64), k.to(F64)
    out = torch.zeros(q64.shape[0], q64.shape[1], q64.shape[2], k64.shape[2], dtype=F64)
    for d in range(q64.shape[-1]):
        out += q64[..., :, d].unsqueeze(-1) * k64[..., :, d].unsqueeze(-2)
    return out * float(scale)



def combine_input(x: Tensor, table: Tensor, how: str) -> Tensor:
    """Token embeddings combined with per-position vectors, feature by feature.

    Formula (``how = "add"``, Vaswani et al. 2017, Sec. 3.5; ``how = "multiply"``, the
    element-wise product)::

        out[b, s, d] = x[b, s, d] + table[s, d]      or      x[b, s, d] * table[s, d]

    ``x`` is ``[batch, seq, dim]``; ``table`` is ``[seq, dim]`` (shared by the batch) or
    ``[batch, seq, dim]``. A literal triple loop in float64.
    """
    x64, t64 = x.to(F64), table.to(F64)
    if t64.dim() == 2:
        t64 = t64.unsqueeze(0).expand(x64.shape[0], -1, -1)
    if how not in ("add", "multiply"):
        raise ValueError(f"how must be 'add' or 'multiply', got {how!r}")
    out = torch.empty_like(x64)
    for b in range(x64.shape[0]):
        for s in range(x64.shape[1]):
            for d in range(x64.shape[2]):
                a, p = float(x64[b, s, d]), float(t64[b, s, d])
                out[b, s, d] = a + p if how == "add" else a * p
    return out
