"""Independent float64 references for input-level (absolute) position encodings.

Written from the papers' formulas as literal loops and scalar ``math``, never from the
generated code. Nothing here imports from ``posgen``, ``generated`` or ``templates``.
Shared formulas that were pinned earlier (hierarchical positions, complex order) live in
:mod:`tests.reference.formulas`; this module adds the rest.

All tensors returned are ``torch.float64``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

F64 = torch.float64

__all__ = [
    "combine_input",
    "depthwise_conv1d",
    "depthwise_conv2d_grid",
    "floater_dynamics",
    "ode_trajectory",
    "plain_logits",
]


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


def depthwise_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None, padding: str) -> Tensor:
    """Conditional position encoding, Chu et al. 2021 (CPVT, arXiv:2102.10882), in 1-D.

    The position encoding generator is a depthwise convolution with zero padding; per
    feature ``d`` and token ``i`` (kernel size ``k``, cross-correlation like PyTorch)::

        c[b, i, d] = bias[d] + sum_{t=0}^{k-1} weight[d, t] * x[b, i + t - left, d]

    with ``x`` taken as 0 outside ``[0, seq)``; ``left = (k - 1) // 2`` for ``"same"``
    (CPVT's (k-1)/2 zero padding) and ``left = k - 1`` for ``"causal"`` (only tokens
    ``<= i`` are read). ``x`` is ``[batch, seq, dim]``, ``weight`` ``[dim, k]`` (or
    ``[dim, 1, k]``), ``bias`` ``[dim]`` or None. Returns ``c`` ``[batch, seq, dim]``
    float64 (the generator's output, before it is added to ``x``). A literal loop.
    """
    x64 = x.to(F64)
    w64 = weight.to(F64).reshape(weight.shape[0], -1)
    k = w64.shape[1]
    if padding == "same":
        left = (k - 1) // 2
    elif padding == "causal":
        left = k - 1
    else:
        raise ValueError(f"padding must be 'same' or 'causal', got {padding!r}")
    batch, seq, dim = x64.shape
    out = torch.zeros(batch, seq, dim, dtype=F64)
    for b in range(batch):
        for i in range(seq):
            for d in range(dim):
                total = 0.0 if bias is None else float(bias[d])
                for t in range(k):
                    source = i + t - left
                    if 0 <= source < seq:
                        total += float(w64[d, t]) * float(x64[b, source, d])
                out[b, i, d] = total
    return out


def ode_trajectory(
    h: Callable[[Tensor, float], Tensor],
    p0: Tensor,
    count: int,
    delta: float,
    steps: int,
    method: str,
) -> Tensor:
    """Fixed-step solution of dp/dt = h(p, t), p(0) = p0, sampled at t = 0, delta, ...

    FLOATER (Liu et al. 2020, arXiv:2003.09229) takes position i's encoding as
    p(i * delta). Each interval [i delta, (i + 1) delta] is crossed in ``steps`` equal
    steps of size ``s = delta / steps``, by

    * ``"euler"``:  p <- p + s h(p, t)
    * ``"rk4"`` (classic Runge-Kutta)::

          k1 = h(p, t)                 k2 = h(p + s/2 k1, t + s/2)
          k3 = h(p + s/2 k2, t + s/2)  k4 = h(p + s k3, t + s)
          p <- p + s/6 (k1 + 2 k2 + 2 k3 + k4)

    with ``t`` advanced as ``start + j s`` (``start`` = the interval's left end). ``h``
    maps a float64 state ``[d]`` and a float time to ``[d]``. Returns ``[count, d]``
    float64: rows p(0), p(delta), ..., p((count - 1) delta).
    """
    if method not in ("euler", "rk4"):
        raise ValueError(f"method must be 'euler' or 'rk4', got {method!r}")
    if steps < 1 or delta <= 0:
        raise ValueError("steps must be >= 1 and delta > 0")
    p = p0.to(F64).clone()
    s = delta / steps
    rows = [p.clone()]
    for interval in range(count - 1):
        start = interval * delta
        for j in range(steps):
            t = start + j * s
            if method == "euler":
                p = p + s * h(p, t)
            else:
                k1 = h(p, t)
                k2 = h(p + (s / 2) * k1, t + s / 2)
                k3 = h(p + (s / 2) * k2, t + s / 2)
                k4 = h(p + s * k3, t + s)
                p = p + (s / 6) * (k1 + 2 * k2 + 2 * k3 + k4)
        rows.append(p.clone())
    return torch.stack(rows)


def floater_dynamics(
    w_in: Tensor, b_in: Tensor, w_out: Tensor, b_out: Tensor, activation: str
) -> Callable[[Tensor, float], Tensor]:
    """FLOATER's one-hidden-layer dynamics with time appended to each layer's input.

    As the authors' ``flow_func_linear`` (``Linear_t`` layers: the time is one more
    input feature, the last one)::

        a_k     = sum_m w_in[k, m] p_m + w_in[k, d] t + b_in[k]
        h_k     = act(a_k)
        out_n   = sum_k w_out[n, k] h_k + w_out[n, H] t + b_out[n]

    ``w_in`` is ``[H, d + 1]``, ``w_out`` ``[d, H + 1]``. Written with scalar loops
    and ``math`` (``gelu`` is the exact erf form). Returns h(p, t) -> ``[d]`` float64.
    """
    wi, bi, wo, bo = (w.detach().to(F64).tolist() for w in (w_in, b_in, w_out, b_out))
    acts = {
        "relu": lambda a: max(a, 0.0),
        "tanh": math.tanh,
        "sigmoid": lambda a: 1.0 / (1.0 + math.exp(-a)),
        "gelu": lambda a: 0.5 * a * (1.0 + math.erf(a / math.sqrt(2.0))),
    }
    act = acts[activation]

    def h(p: Tensor, t: float) -> Tensor:
        state = p.tolist()
        d = len(state)
        hidden = []
        for k in range(len(bi)):
            a = sum(wi[k][m] * state[m] for m in range(d)) + wi[k][d] * t + bi[k]
            hidden.append(act(a))
        width = len(hidden)
        out = [
            sum(wo[n][k] * hidden[k] for k in range(width)) + wo[n][width] * t + bo[n]
            for n in range(len(bo))
        ]
        return torch.tensor(out, dtype=F64)

    return h


def depthwise_conv2d_grid(
    x: Tensor, weight: Tensor, bias: Tensor | None, height: int, width: int
) -> Tensor:
    """CPVT's position encoding generator on an H x W token grid (Chu et al. 2021).

    Tokens are row-major (token ``r * W + c`` sits at row r, column c). Per feature d,
    with a ``k x k`` kernel and ``(k - 1) / 2`` zeros on every side::

        c[b, r*W + col, d] = bias[d] + sum_{u, v} weight[d, u, v]
                                       * x[b, (r + u - a)*W + (col + v - a), d]

    ``a = (k - 1) // 2``, terms outside the grid being 0. ``weight`` is ``[dim, k, k]``
    or ``[dim, 1, k, k]``. Returns ``c`` ``[batch, H*W, dim]`` float64; a literal loop.
    """
    x64 = x.to(F64)
    w64 = weight.to(F64).reshape(weight.shape[0], weight.shape[-2], weight.shape[-1])
    k = w64.shape[-1]
    a = (k - 1) // 2
    batch, tokens, dim = x64.shape
    if tokens != height * width:
        raise ValueError(f"{tokens} tokens do not fill a {height}x{width} grid")
    out = torch.zeros(batch, tokens, dim, dtype=F64)
    for b in range(batch):
        for r in range(height):
            for col in range(width):
                for d in range(dim):
                    total = 0.0 if bias is None else float(bias[d])
                    for u in range(k):
                        for v in range(k):
                            rr, cc = r + u - a, col + v - a
                            if 0 <= rr < height and 0 <= cc < width:
                                total += float(w64[d, u, v]) * float(x64[b, rr * width + cc, d])
                    out[b, r * width + col, d] = total
    return out
