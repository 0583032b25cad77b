"""CPU training steps of a per-distance bias with a few trained scalars per head: each
scalar's gradient from one more flash forward, no per-pair pass.

A bias of j - i alone at default positions, b_h(j - i) = vec[h, t] (``_distances``),
whose vector is a function of a few scalars per head (KERPLE's r1 and r2, trained ALiBi
slopes): the gradient of a scalar θ_h is a weighted sum of dS = dL/d(logit),

    dL/dθ_h = Σ_{b,i,j} dS_bhij w_h(j - i),   w = ∂vec/∂θ,
    dS_ij = P_ij (dO_i · v_j - δ_i),   δ_i = dO_i · O_i,

which the per-pair path (``clipped_bias_gradient`` over every key) forms pair by pair
from recomputed weights: two more products of the scores' size and a dozen passes over
[B, H, rows, M] chunks. Summed over keys first, with w ≥ 0,

    Σ_j dS_ij w_ij = Σ_j P_ij w_ij (dO_i · v_j) - δ_i Σ_j P_ij w_ij
                   = μ_i (dO_i · O'_i - δ_i),

where O' is attention with the bias vec + log w (softmax weights P'_ij ∝ P_ij w_ij)
and μ_i = Σ_j P_ij w_ij = exp(lse'_i - lse_i) the ratio of its rows' log-sum-exp to the
forward's. So one flash forward of the same shape per scalar, over a per-distance
vector like the forward's (a strided view, no [H, N, M] tensor), gives that scalar's
gradient for every head; a w of both signs takes two, w⁺ and w⁻. The directions w come
from the vector's own graph by forward-mode differentiation done twice in reverse
(w = J 1 as the gradient, with respect to a probe u, of Jᵀu), so any formula serves
whose scalars meet the contract of ``AttentionTerms.distance_bias_parameters``: each
0-dimensional (shared by the heads) or 1-dimensional with entry h reaching only row h
of the vector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._chunked_flash import Span, cpu_flash_serves, flash_chunks_backward, flash_chunks_forward
from ._distances import distance_chunk_views
from ._first_order import first_order_only
from ._trained_bias import flash_spans, flash_training_serves

#: devices where a training step of such a bias runs as ``directional_bias_attention``;
#: only the CPU's flash kernel returns the log-sum-exp it needs
DIRECTIONAL_BIAS_DEVICES: set[str] = {"cpu"}

#: the path serves calls of at least this many keys, without and with a causal mask.
#: Against the query chunks' trained masks (``trained_mask_attention``) in one run
#: (2-core CPU, float32, batch 2, 16 heads, head_dim 64, training steps as time over
#: plain SDPA's, attention_backends_cpu_float32_directional.md): KERPLE (two scalars
#: per head) and trained ALiBi slopes (one) at N = 768 1.78x and 1.42x against 2.04x
#: and 1.72x; at 2048 1.71x and 1.36x against 3.17x and 3.14x; causal at 1024 1.69x
#: and 1.39x against 1.49x and 1.57x (tied overall, with 65 against 168 MiB), at 1536
#: 1.79x and 1.45x against 2.14x and 1.96x, at 2048 1.83x and 1.52x against 2.27x and
#: 2.36x. At 512 the two ran the same code (1.64-1.94x: that run's noise)
DIRECTIONAL_BIAS_MIN_KEYS = {False: 768, True: 1024}


def directional_bias_serves(
    q: Tensor,
    v: Tensor,
    window: int | None,
    causal: bool,
    parameters: tuple[Tensor, ...],
) -> bool:
    """Whether ``directional_bias_attention`` runs a training step: gradients on and
    into one of ``parameters``, a device in ``DIRECTIONAL_BIAS_DEVICES``, at least
    ``DIRECTIONAL_BIAS_MIN_KEYS[causal]`` keys, and the CPU flash kernels' conditions
    (``flash_training_serves``: float32 or float64, more than one query, no window;
    ``cpu_flash_serves``: eager mode, since TorchDynamo does not trace the backward's
    second-order gradient, and values as wide as the queries)."""
    return (
        torch.is_grad_enabled()
        and any(p.requires_grad for p in parameters)
        and q.device.type in DIRECTIONAL_BIAS_DEVICES
        and v.shape[2] >= DIRECTIONAL_BIAS_MIN_KEYS[causal]
        and flash_training_serves(q, window)
        and cpu_flash_serves(q, v)
    )


def directional_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    vector_of: Callable[[], Tensor],
    parameters: tuple[Tensor, ...],
    scale: float,
    causal: bool,
) -> Tensor:
    """softmax(scale q kᵀ + b) v at default positions (the queries are the last N of M
    keys), b_h(j - i) = vec[h, j - i + M - 1] from ``vector_of()`` [H, N + M - 1] (with
    -inf on the distances a causal mask excludes, as SDPA's mask would be), a function of
    ``parameters`` alone, each 0-D or 1-D with entry h reaching only row h.

    q: [B, H, N, D]; k, v: [B, H, M, D] (heads repeated for grouped queries by the
    caller) -> [B, H, N, D], differentiable (once) in q, k, v and ``parameters``. See
    the module docstring.
    """
    out: Tensor = _DirectionalBias.apply(q, k, v, vector_of, scale, causal, *parameters)
    return out


class _DirectionalBias(torch.autograd.Function):
    """``directional_bias_attention`` as one autograd node (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        vector_of: Callable[[], Tensor],
        scale: float,
        causal: bool,
        *parameters: Tensor,
    ) -> Tensor:
        n, m = q.shape[2], k.shape[2]
        vec = vector_of()  # [H, N + M - 1], no graph (autograd.Function forward)
        spans = flash_spans(n, m, causal)
        out, lse = flash_chunks_forward(q, k, v, spans, distance_chunk_views(vec, n), scale, True)
        ctx.save_for_backward(q, k, v, vec, out, lse, *parameters)
        ctx.vector_of, ctx.scale, ctx.causal = vector_of, scale, causal
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, vec, out, lse, *parameters = ctx.saved_tensors
        n, m = q.shape[2], k.shape[2]
        spans, scale = flash_spans(n, m, ctx.causal), ctx.scale
        grad_out = grad_out.contiguous()
        dq, dk, dv = flash_chunks_backward(
            grad_out, q, k, v, out, lse, spans, distance_chunk_views(vec, n), scale, True
        )
        trained = [p for p in parameters if p.requires_grad]
        directions = iter(_directions_and_passes(ctx.vector_of, trained))
        delta = (grad_out * out).sum(-1)  # [B, H, N]: δ_i = dO_i . O_i
        grads: list[Tensor | None] = []
        for parameter in parameters:
            if not parameter.requires_grad:
                grads.append(None)
                continue
            per_head = vec.new_zeros(vec.shape[0])  # [H]
            direction, up, down = next(directions)
            for sign in (1.0, -1.0):
                part = direction.mul(sign).clamp_(min=0)  # [H, N + M - 1]: w+ or w-
                if bool(part.any()):
                    part.masked_fill_(vec == float("-inf"), 0.0)
                    sums = _weighted_dS_sums(q, k, v, vec, part, lse, grad_out, delta, spans, scale)
                    per_head += sign * sums
            grad = _per_parameter(per_head, parameter)
            # up (down): where a positive (negative) gradient goes through to the parameter
            grads.append(torch.where(grad > 0, grad * up, torch.where(grad < 0, grad * down, grad)))
        return dq, dk, dv, None, None, None, *grads


def _directions_and_passes(
    vector_of: Callable[[], Tensor], trained: list[Tensor]
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """For each trained scalar set θ_p, (w_p, up, down), from one build of the vector's
    graph.

    w_p = ∂vec/∂θ_p [H, N + M - 1] (entry h reaching row h, or a 0-D scalar every row):
    the graph differentiated forward (J 1) as the reverse-mode gradient, with respect to a
    probe u, of Jᵀu.

    up (down), of θ_p's shape, is 1 where the graph passes a positive (negative) gradient
    to θ_p and 0 where it stops it: a scalar read through ``clamp_toward_range`` and lying
    outside its range passes only the gradient that moves it back, which w (taken at the
    clamped value, a linearisation) cannot say. Pulling w (-w) back through the graph
    gives θ_p's entry h the gradient s_h Σ_t (∂vec_ht/∂c_h)² (its negative) at the clamp
    c_h, s_h > 0 from the readings before it (softplus), so that pull is zero exactly
    where the clamp stops a gradient of that sign (or where w is zero, and with it the
    gradient)."""
    with torch.enable_grad():
        vec = vector_of()  # [H, N + M - 1], with its graph
        probe = torch.zeros_like(vec, requires_grad=True)
        pulled = torch.autograd.grad(vec, trained, probe, create_graph=True, allow_unused=True)
        found = []
        for parameter, back in zip(trained, pulled, strict=True):
            if back is None or not back.requires_grad:  # the vector does not move with it
                direction = torch.zeros_like(vec)
            else:
                ones = torch.ones_like(parameter)
                (forward,) = torch.autograd.grad(back, probe, ones, retain_graph=True)
                direction = forward.detach()
            passes = []
            for sign in (1.0, -1.0):
                (pull,) = torch.autograd.grad(
                    vec, parameter, sign * direction, retain_graph=True, allow_unused=True
                )
                passes.append(
                    torch.zeros_like(parameter) if pull is None else (pull != 0).to(parameter.dtype)
                )
            found.append((direction, passes[0], passes[1]))
    return found


def _weighted_dS_sums(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    vec: Tensor,
    weights: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    delta: Tensor,
    spans: list[Span],
    scale: float,
) -> Tensor:
    """Σ_{b,i,j} dS_bhij w_h(j - i) per head [H], for ``weights`` w ≥ 0 [H, N + M - 1]
    (0 where vec is -inf): one flash forward over vec + log w, over the forward's
    ``spans``, gives O' and lse' (see the module docstring); a row that reads no
    positive weight adds nothing."""
    n = q.shape[2]
    shifted = vec + weights.log()  # [H, N + M - 1], -inf where w = 0
    views = distance_chunk_views(shifted, n)
    out_w, lse_w = flash_chunks_forward(q, k, v, spans, views, scale, True)
    reads = _rows_reading(weights, n)  # [H, N]: the flash kernel gives a row of -inf lse 0
    mass = torch.exp(lse_w - lse).mul_(reads)  # [B, H, N]: μ_i = Σ_j P_ij w_ij
    return (mass * ((grad_out * out_w).sum(-1) - delta)).sum((0, 2))  # [H]


def _rows_reading(weights: Tensor, n: int) -> Tensor:
    """[H, N]: whether query row i reads a positive entry of ``weights`` [H, N + M - 1]
    (row i reads entries N - 1 - i .. N - 1 - i + M - 1): counts by prefix sums."""
    m = weights.shape[1] - n + 1
    counts = F.pad((weights > 0).cumsum(-1), (1, 0))  # [H, N + M]: positives before t
    first = torch.arange(n - 1, -1, -1, device=weights.device)  # [N]
    return counts[:, first + m] > counts[:, first]


def _per_parameter(per_head: Tensor, parameter: Tensor) -> Tensor:
    """A parameter's gradient from its per-head sums [H]: their total for a 0-D scalar,
    the first P heads' for a [P] vector."""
    if parameter.dim() == 0:
        return per_head.sum().to(parameter.dtype)
    return per_head[: parameter.shape[0]].to(parameter.dtype)
