"""The module contract: ``PositionalAttention``, which every generated encoding subclasses.

``posgen generate`` copies each module of templates/runtime/, byte for byte after its
header, into generated/ (this one as ``generated/_attention.py``); each generated
encoding subclasses ``PositionalAttention`` and adds only what is its own (parameters,
position terms, rotation). ``posgen generate --standalone`` inlines the whole runtime
into a single file.

The logits of query i and key j are the sum of the terms an encoding keeps:

    a_ij = scale * (R_i q_i) . (R_j k_j)          content (rotated where the encoding rotates)
         + b_h(i, j)                              position-only bias (scaled when inside)
         + relative terms x . P(R)[index(i, j)]   content-dependent relative terms

and the output is softmax(a + masks) @ v (plus a value-side term where the encoding has
one). This module picks the backend (``eager``, the oracle; ``sdpa``; ``flex``; ``auto``)
and the route within it; the other runtime modules hold the checks, masks, per-distance
biases, rotation and kernels it routes to.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._distance_kernel import (
    distance_attention_forward,
    fused_distance_attention,
    fused_distance_attention_serves,
)
from ._distances import distance_chunk_view, half_precision_bias
from ._flex import flex_mask_mod, flex_score_mod, run_flex
from ._inputs import (
    BACKENDS,
    Rotated,
    cache_get,
    cache_put,
    check_attention_inputs,
    check_axis_positions,
    check_position_pair,
    check_positions,
    positive_int,
    repeat_kv,
    to_bhnd,
)
from ._masks import (
    apply_masks,
    attention_allowed,
    block_fresh,
    check_attn_mask,
    check_document_ids,
    check_window,
    distance_allowed,
    masked_softmax,
    query_chunks,
    sum_into_new,
)
from ._numerics import autocast_off, compute_dtype
from ._trained_bias import (
    attach_clipped_bias_gradient,
    band_gradient_pays,
    clipped_bias_attention,
    clipped_bias_attention_serves,
    trained_mask_attention,
    trained_mask_attention_serves,
)

#: device types whose flex backend trains a clipped bias from a constant per-score read
#: plus ``attach_clipped_bias_gradient`` (else: the [H, N + M - 1] vector, whose
#: backward adds each score's gradient into it). Empty until timed on a GPU; the CPU's
#: flex runs unfused, where it only serves the tests.
CLIPPED_BIAS_FLEX_DEVICES: set[str] = set()
#: per bias form, the device types where the flex backend runs a bias of the key minus
#: query position alone (default positions) through ``fused_distance_attention``
#: instead of FlexAttention. Timed on an H200 (bf16, batch 2, 16 heads, head_dim 64,
#: benchmarks/results/attention_backends_cuda_bfloat16_fused.md): ALiBi's slope, computed
#: per score, beat flex's score_mod at N = 8192 (forward 1.64-1.70x FlashAttention
#: against 1.79-2.02x, training 1.63-1.70x against 2.08-2.14x) and at N = 2048 (forward
#: 2.50-2.94x against 3.03-3.22x); a vector read per score (T5, KERPLE) lost to flex
#: when causal (T5 forward 3.34-4.21x against 2.74-3.69x) and when T5's table trains at
#: N = 2048, so it stays on flex.
FUSED_DISTANCE_ROUTES: dict[str, set[str]] = {"slope": {"cuda"}, "vector": set()}


class PositionalAttention(nn.Module):
    """Attention whose logits are the sum of an encoding's terms; subclassed per encoding.

    A generated encoding sets the composition flags below (decided by posgen's plan) and
    overrides the hooks it needs: ``embed`` (input-level positions), ``_rotate``
    (rotary part), ``_position_bias`` and ``score_bias`` (position-only bias),
    ``_relative_terms`` (content-dependent relative terms) and ``_value_term``.

    Args:
        heads: number of attention heads.
        head_dim: features per head.
        scale_factor: the logits are scaled by 1 / sqrt(scale_factor * head_dim); None
            leaves them unscaled.
    """

    #: the position terms are per head, so q must have ``heads`` heads
    checks_heads: bool = False
    #: a position-only bias [heads, N, M] enters the logits
    has_position_bias: bool = False
    #: that bias is added inside the scale: (q . k + b) * scale, so it is scaled too
    position_bias_inside_scale: bool = False
    #: that bias depends only on the key minus query position, via ``_distance_bias``
    bias_by_distance: bool = False
    #: and is c_h |j - i| (ALiBi's slopes): ``_distance_slopes`` gives c_h
    bias_linear_in_distance: bool = False
    #: and is constant past this distance on each side (T5's buckets past max_distance):
    #: ``_clipped_distance_bias`` gives it over -clip .. clip; None where it is not
    clipped_distance: int | None = None
    #: the position bias is a product of position rows: ``_fold_position_bias`` appends
    #: them to q and k, so sdpa runs with no bias tensor
    folds_position_bias: bool = False
    #: sdpa uses that fold (None: on CUDA only, where it lets SDPA pick its flash kernel;
    #: on a 2-core CPU, TUPE-A at N = 512 ran 5.9x no-bias SDPA folded, 4.4x with a mask)
    fold_bias: bool | None = None
    #: the rotary part changes q and k
    has_rotation: bool = False
    #: content-dependent relative terms enter the logits
    has_relative_terms: bool = False
    #: a value-side term is added to the output (needs the attention weights)
    has_value_term: bool = False
    #: position axes of the rotation (M-RoPE: 3); explicit positions [axes, batch, seq]
    position_axes: int = 1
    #: backend "flex" runs torch.compile'd FlexAttention (None: on CUDA only; elsewhere
    #: the unfused reference, which is exact but materialises the scores)
    flex_compile: bool | None = None

    def __init__(self, heads: int, head_dim: int, scale_factor: float | None) -> None:
        super().__init__()
        self.heads = positive_int(heads, "heads")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.scale = 1.0 if scale_factor is None else 1.0 / math.sqrt(scale_factor * self.head_dim)
        self._cache: dict[tuple[Any, ...], Any] = {}  # see cache_put

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, scale={self.scale:.6g}"

    # ------------------------------------------------------------------ encoding hooks

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Input-level positions: none for this encoding (identity)."""
        return x

    def rotate(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        *,
        layout: str = "bhnd",
    ) -> tuple[Tensor, Tensor]:
        """Rotate q [batch, heads, N, head_dim] and k [batch, kv_heads, M, head_dim].

        Positions default to 0, ..., M - 1 for k and to the last N key positions for q
        (N > M needs explicit q_positions). The outputs keep the input dtype and layout
        (``"bnhd"``: [batch, seq, heads, head_dim] in and out); without a rotary part
        they are q and k themselves.
        """
        q, k = to_bhnd(layout, q, k)
        check_attention_inputs(q, k, None, None, self.head_dim)
        q, k, q_positions, k_positions, rotated = self._positions_and_axes(
            q, k, q_positions, k_positions, "none"
        )
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        return to_bhnd(layout, q, k)  # type: ignore[return-value]

    def rotate_keys(
        self, k: Tensor, positions: Tensor | None = None, *, layout: str = "bhnd"
    ) -> Tensor:
        """Rotate keys once, at their positions, for a cache of rotated keys (decode).

        k: [batch, kv_heads, M, head_dim] (or [batch, M, kv_heads, head_dim] with layout
        "bnhd"); positions: int64 [M] or [batch, M], default 0, ..., M - 1. Append the
        result to the cache and call ``forward(q, cache, v, keys_rotated=True, ...)``:
        each decode step then rotates only its new keys and its queries. Without a
        rotary part this returns k itself.
        """
        (k,) = to_bhnd(layout, k)
        check_attention_inputs(k, k, None, None, self.head_dim)
        batch, m = k.shape[0], k.shape[2]
        axes = check_axis_positions(positions, self.position_axes, m, batch, "positions", k.device)
        if axes is None:
            positions = check_positions(positions, m, batch, "positions", k.device)
        if not self.has_rotation:
            return to_bhnd(layout, k)[0]
        rotated = self._rotate_keys(k, axes if axes is not None else positions)
        (rotated,) = to_bhnd(layout, rotated)
        return rotated

    def _rotate(
        self, q: Tensor, k: Tensor, q_positions: Tensor | None, k_positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        return q, k

    def _positions_and_axes(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Rotated]:
        """Validate positions; rotate here at M-RoPE axis positions [axes, batch, seq].

        Returns q, k, the token positions that masks and biases read (None, token order,
        where axis positions were given) and what is rotated already.
        """
        n, m, batch = q.shape[2], k.shape[2], q.shape[0]
        axes, device = self.position_axes, q.device
        q_axes = check_axis_positions(q_positions, axes, n, batch, "q_positions", device)
        k_axes = check_axis_positions(k_positions, axes, m, batch, "k_positions", device)
        if q_axes is None and k_axes is None:
            q_positions, k_positions = check_position_pair(
                q_positions, k_positions, n, m, batch, q.device
            )
            return q, k, q_positions, k_positions, rotated
        for name, axes, other in (("q", q_axes, q_positions), ("k", k_axes, k_positions)):
            if axes is None and other is not None:
                raise ValueError(
                    f"{name}_positions must also be [axes, batch, seq] when the other "
                    "positions are (or leave it out for the default)"
                )
        if k_axes is None:
            default = torch.arange(m, device=q.device)
            k_axes = default.expand(self.position_axes, 1, m)  # [axes, 1, M]
        if q_axes is None:
            if n > m:
                raise ValueError(f"{n} queries but {m} keys: N > M needs explicit q_positions")
            q_axes = k_axes[..., m - n :]  # the queries are the newest keys
        if rotated == "keys":
            q = self._rotate_queries(q, q_axes, m)
        else:
            q, k = self._rotate(q, k, q_axes, k_axes)
        return q, k, None, None, "both"

    def _sampled_positions(self, length: int, device: torch.device) -> Tensor | None:
        """Positions to use where none are given ([length]), or None for 0 .. length - 1.

        Randomized encodings draw them in training; every other encoding uses the range.
        """
        return None

    def _rotate_queries(self, q: Tensor, q_positions: Tensor | None, m: int) -> Tensor:
        return q

    def _rotate_keys(self, k: Tensor, k_positions: Tensor | None) -> Tensor:
        return k

    def _rotate_for_attention(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated,
    ) -> tuple[Tensor, Tensor]:
        """q and k as the logits read them: rotated here, or q alone when k already is
        (``"keys"``), or both as given (``"both"``: rotated at M-RoPE axis positions)."""
        if not self.has_rotation or rotated == "both":
            return q, k
        if rotated == "keys":
            return self._rotate_queries(q, q_positions, k.shape[2]), k
        return self._rotate(q, k, q_positions, k_positions)

    def score_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Position-only score bias: none for this encoding."""
        return None

    def _position_bias(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        device: torch.device,
    ) -> Tensor | None:
        return None

    def _fold_position_bias(
        self, q: Tensor, k: Tensor, q_positions: Tensor | None, k_positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """q' and k' whose scaled product includes the position bias (see the flag)."""
        return q, k

    def _flex_bias(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Any:
        """A bias per (batch, head, query, key) index for the flex score_mod, or None to
        read the per-distance vector (``bias_by_distance``, default positions) or capture
        ``_position_bias``'s tensor instead. Blocks render one where the bias is cheap
        arithmetic of the indices (ALiBi's slopes, T5's clipped distances, expressions):
        a gather per score from an [H, N + M - 1] vector cost 3-6x the bias-free kernel
        on an H100."""
        return None

    def _flex_relative(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        dtype: torch.dtype,
    ) -> Any:
        """Relative terms per (batch, head, query, key) index for the flex score_mod, or
        None to capture ``_relative_terms``' dense tensors instead."""
        return None

    def _distance_bias(self, n: int, m: int, device: torch.device) -> Tensor:
        """The position-only bias per distance for default positions: [heads, N + M - 1].

        Entry t is the bias at key minus query position t - (M - 1) (see
        ``default_distances``). Encodings with ``bias_by_distance`` override it.
        """
        raise NotImplementedError("this encoding's bias is not a function of j - i alone")

    def _distance_slopes(self, device: torch.device) -> Tensor:
        """c_h of a bias c_h |j - i|, ``bias_linear_in_distance``: [heads] (ALiBi: minus
        the slopes). Encodings with ``bias_linear_in_distance`` override it."""
        raise NotImplementedError("this encoding's bias is not linear in |j - i|")

    def _clipped_distance_bias(self, device: torch.device) -> Tensor:
        """The position-only bias at key minus query position -clip .. clip, clip being
        ``clipped_distance``: [heads, 2 clip + 1]; every distance past +-clip has the
        bias at +-clip. Encodings with ``clipped_distance`` override it."""
        raise NotImplementedError("this encoding's bias is not clipped at a distance")

    def _relative_terms(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        dtype: torch.dtype,
    ) -> dict[str, Tensor]:
        return {}

    def _value_term(
        self, weights: Tensor, q_positions: Tensor | None, k_positions: Tensor | None
    ) -> Tensor:
        raise NotImplementedError("this encoding has no value-side term")

    def _check_value_width(self, v: Tensor) -> None:
        """Encodings with a value-side table check v's last dim here."""

    # ------------------------------------------------------------------ logits

    def score_terms(
        self,
        q: Tensor,
        k: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        layout: str = "bhnd",
    ) -> dict[str, Tensor]:
        """The non-zero terms of the logits, each as it enters the sum.

        q: [batch, heads, N, head_dim], k: [batch, kv_heads, M, head_dim] (or
        [batch, seq, heads, head_dim] with layout "bnhd"). Content terms are
        [batch, heads, N, M]; position-only terms are [heads, N, M] (or
        [batch, heads, N, M] for batched positions) and broadcast over the batch. All
        are float32, or float64 for float64 inputs.
        """
        q, k = to_bhnd(layout, q, k)
        check_attention_inputs(q, k, None, self._expected_heads(), self.head_dim)
        # the oracle: float32 (float64 for float64 inputs) even under autocast
        with autocast_off(q.device.type):
            q, k, q_positions, k_positions, rotated = self._positions_and_axes(
                q, k, q_positions, k_positions, "none"
            )
            return self._score_terms_exact(q, k, q_positions, k_positions, rotated)

    def _expected_heads(self) -> int | None:
        return self.heads if self.checks_heads else None

    def _score_terms_exact(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated = "none",
    ) -> dict[str, Tensor]:
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        k = repeat_kv(k, q.shape[1] // k.shape[1])  # [B, H, M, D]
        dtype = compute_dtype(q)
        content = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1))  # [B, H, N, M]
        terms = {"content_content": content * self.scale}
        if self.has_position_bias:
            bias = self._position_bias(q_positions, k_positions, q.shape[2], k.shape[2], q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype)
            if self.position_bias_inside_scale:
                bias = bias * self.scale
            terms["position_position"] = bias
        if self.has_relative_terms:
            terms.update(self._relative_terms(q, k, q_positions, k_positions, dtype))
        return terms

    def scores(
        self,
        q: Tensor,
        k: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        layout: str = "bhnd",
    ) -> Tensor:
        """Pre-softmax logits, the sum of ``score_terms``: [batch, heads, N, M].

        Computed in float32 (float64 for float64 inputs).
        """
        terms = self.score_terms(
            q, k, q_positions=q_positions, k_positions=k_positions, layout=layout
        )
        logits = terms.pop("content_content")
        for term in terms.values():
            logits = logits + term
        return logits

    # ------------------------------------------------------------------ attention

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        causal: bool = False,
        attn_mask: Tensor | None = None,
        backend: str = "auto",
        layout: str = "bhnd",
        keys_rotated: bool = False,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Attention with this encoding: softmax(logits + masks) @ v.

        Args:
            q: [batch, heads, N, head_dim] queries.
            k: [batch, kv_heads, M, head_dim] keys; kv_heads divides heads (grouped-query
                attention: query head h reads key/value head h // (heads / kv_heads)).
            v: [batch, kv_heads, M, value_dim] values.
            q_positions: int64 [N] or [batch, N]; default the last N key positions
                (k_positions[..., M - N:], or M - N, ..., M - 1), as with a KV cache.
                N > M needs them explicitly.
            k_positions: int64 [M] or [batch, M]; default 0, ..., M - 1.
            causal: mask keys whose position is greater than the query's.
            attn_mask: bool (True = attend) or additive float mask, broadcastable to
                [batch, heads, N, M].
            backend: "eager" (term by term, the reference), "sdpa"
                (F.scaled_dot_product_attention with a materialised bias), "flex"
                (FlexAttention: the position terms as a score_mod, masks as a block
                mask; compiled on CUDA, or where ``flex_compile`` is True) or "auto"
                (the fastest measured: flex on CUDA for most biases and relative
                terms, eager for a value-side term, else sdpa; see ``_auto_backend``).
            layout: "bhnd" (the shapes above) or "bnhd" ([batch, seq, heads, dim], as
                Hugging Face projections produce before their transpose); the output
                has the same layout.
            keys_rotated: k was rotated already by ``rotate_keys`` at k_positions (a
                cache of rotated keys): only q is rotated here. No effect without a
                rotary part.
            window: sliding-window attention by position, a positive int: query i
                attends key j only where |q_pos_i - k_pos_j| < window (a symmetric band,
                Longformer-style local attention); with ``causal`` that is
                q_pos_i - window < k_pos_j <= q_pos_i (Mistral's sliding window: window
                1 keeps only the key at the query's own position).
            document_ids: packed sequences, integer [M] or [batch, M]: each key's
                document. The queries are the last N keys (as with a KV cache; N > M
                raises ValueError), so query i's document is document_ids[..., M - N + i]
                and it attends only keys of that document. Positions are not changed:
                pass k_positions restarting at each document where the encoding should
                see them restart.

            causal, window, document_ids and attn_mask combine (a key must pass all of
            them). On "flex" the first three become one block mask, so FlexAttention
            skips the blocks outside the window or the document.

        Returns:
            [batch, heads, N, value_dim] in the dtype of v. A query row whose every key
            is masked (by ``causal``, ``window``, ``document_ids`` or ``attn_mask``) is
            all zeros on every backend, as F.scaled_dot_product_attention gives.
        """
        q, k, v = to_bhnd(layout, q, k, v)
        out = self._attend(
            q,
            k,
            v,
            q_positions,
            k_positions,
            causal,
            attn_mask,
            backend,
            keys_rotated,
            window=window,
            document_ids=document_ids,
        )
        return out.transpose(1, 2) if layout == "bnhd" else out

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        backend: str,
        keys_rotated: bool,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        check_attention_inputs(q, k, v, self._expected_heads(), self.head_dim)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        window = check_window(window)
        q, k, q_positions, k_positions, rotated = self._positions_and_axes(
            q, k, q_positions, k_positions, "keys" if keys_rotated else "none"
        )
        n, m = q.shape[2], k.shape[2]
        if q_positions is None and k_positions is None:
            sampled = self._sampled_positions(m, q.device)  # randomized encodings, training
            if sampled is not None:
                k_positions, q_positions = sampled, sampled[m - n :]
        attn_mask = check_attn_mask(attn_mask, q, m)
        document_ids = check_document_ids(document_ids, n, m, q.shape[0], q.device)
        if window is not None and window >= m and q_positions is None and k_positions is None:
            window = None  # default positions: every |query - key| < M (N <= M)
        self._check_value_width(v)
        if backend == "auto":
            backend = self._auto_backend(q)
        args = (q, k, v, q_positions, k_positions, causal, attn_mask, rotated)
        if backend == "flex":
            return self._flex_attention(*args, window=window, document_ids=document_ids)
        if backend == "eager":
            return self._eager_attention(*args, window=window, document_ids=document_ids)
        return self._sdpa_attention(*args, window=window, document_ids=document_ids)

    def _auto_backend(self, q: Tensor) -> str:
        """The backend "auto" runs, from benchmarks/results (bf16, batch 2, 16 heads,
        head_dim 64, N = 2048 and 8192; ratios to FlashAttention):

        - a value-side term needs the attention weights, which SDPA and FlexAttention do
          not return: "eager" on CUDA; on the CPU "sdpa", whose value-term path forms
          the weights once and chunks causal queries (Shaw, 2 threads, float32, N =
          2048, causal: 8.9x plain SDPA forward against eager's 27x, training 4.6x
          against 12x; not causal within 15% of eager);
        - on CUDA, a position bias or relative terms that stay in the logits: "flex"
          (H200, attention_backends_cuda_bfloat16_fused.md: ALiBi forward 1.6-2.9x
          against sdpa's 3.3-6.5x and training 1.6-2.3x against 2.2-3.8x, T5 forward
          2.6-4.0x against 3.4-6.8x and training 3.8-6.6x against 5.4-18x, N = 2048 and
          8192 alike; H100, attention_backends_cuda_bfloat16_family.md: the relative
          family 11-16x against 15-32x at N = 2048);
        - otherwise (no position term in the logits, a bias folded into q and k, or the
          CPU, where FlexAttention is not fused): "sdpa" (FlashAttention where it can).
        """
        if self.has_value_term:
            return "eager" if q.is_cuda else "sdpa"
        folded = self.folds_position_bias and self.fold_bias is not False
        in_logits = self.has_relative_terms or (self.has_position_bias and not folded)
        flex_width = q.shape[-1] >= 16 and q.shape[-1] & (q.shape[-1] - 1) == 0
        return "flex" if in_logits and q.is_cuda and flex_width else "sdpa"

    def _trains_terms(self) -> bool:
        """Gradients flow into the position terms' parameters (tables, slopes, kernels):
        the module holds nothing else."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def _eager_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        rotated: Rotated = "none",
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """The literal decomposition in float32 (float64 for float64 inputs): the oracle."""
        n, m = q.shape[2], k.shape[2]
        with autocast_off(q.device.type):
            terms = self._score_terms_exact(q, k, q_positions, k_positions, rotated)
            logits = terms.pop("content_content")
            for term in terms.values():
                logits = logits + term  # [B, H, N, M]
            allowed = attention_allowed(
                q_positions, k_positions, n, m, q.device, causal, window, document_ids
            )  # [N, M] or [B, 1, N, M], or None
            weights = masked_softmax(apply_masks(logits, allowed, attn_mask))
            v = repeat_kv(v, q.shape[1] // v.shape[1])  # [B, H, M, value_dim]
            out = torch.matmul(weights, v.to(weights.dtype))  # [B, H, N, value_dim]
            if self.has_value_term:
                out = out + self._value_term(weights, q_positions, k_positions)
        return out.to(v.dtype)

    def _sdpa_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        rotated: Rotated = "none",
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """F.scaled_dot_product_attention with the position terms as an additive mask."""
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        if self.has_relative_terms:
            return self._sdpa_relative(
                q, k, v, q_positions, k_positions, causal, attn_mask, window, document_ids
            )
        n, m = q.shape[2], k.shape[2]
        has_bias = self.has_position_bias
        fold = self.fold_bias if self.fold_bias is not None else q.device.type == "cuda"
        if self.folds_position_bias and fold:
            v = repeat_kv(v, q.shape[1] // v.shape[1])
            q, k = self._fold_position_bias(q, k, q_positions, k_positions)
            has_bias = False  # now inside q' . k'
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        default_positions = q_positions is None and k_positions is None
        # a window folds into the per-distance vector (it depends on j - i alone); the
        # documents do not, so they take the materialised bias below
        by_distance = default_positions and attn_mask is None and document_ids is None
        if self.bias_by_distance and by_distance:
            return self._sdpa_by_distance(q, k, v, causal, gqa, window)
        # causal or window masking at default positions: chunks that skip masked keys
        chunkable = by_distance and (causal or window is not None)
        spans = query_chunks(n, m, q.device.type, causal, window) if chunkable else []
        if has_bias and len(spans) > 1:
            # each chunk of queries gets the bias at its own positions, over the keys it
            # may read
            def chunk_bias(i0: int, i1: int, lo: int, hi: int) -> Tensor:
                q_chunk = torch.arange(m - n + i0, m - n + i1, device=q.device)
                k_chunk = torch.arange(lo, hi, device=q.device)
                return self._sdpa_bias(
                    q_chunk, k_chunk, i1 - i0, hi - lo, q.device, q.dtype, causal, window
                )

            return self._sdpa_in_chunks(q, k, v, spans, chunk_bias, gqa)
        if has_bias:
            mask = self._sdpa_bias(
                q_positions, k_positions, n, m, q.device, q.dtype, causal, window, document_ids
            )
            if attn_mask is not None:
                mask = apply_masks(mask, None, attn_mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)
        only_causal = window is None and document_ids is None and attn_mask is None
        if causal and default_positions and n == m and only_causal:
            # keys 0..M-1 and queries 0..N-1: SDPA's own causal mask, no mask tensor
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, **gqa)
        allowed = attention_allowed(
            q_positions, k_positions, n, m, q.device, causal, window, document_ids
        )  # [N, M] or [B, 1, N, M], or None
        if allowed is not None and len(spans) > 1:
            # a window, or causal queries that are the last N of M keys: each chunk of
            # queries against only the keys it may read
            grid = allowed  # [N, M]

            def chunk_allowed(i0: int, i1: int, lo: int, hi: int) -> Tensor:
                return grid[i0:i1, lo:hi]

            return self._sdpa_in_chunks(q, k, v, spans, chunk_allowed, gqa)
        mask: Tensor | None = allowed
        if attn_mask is not None:
            if allowed is None:
                mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
            elif attn_mask.dtype == torch.bool:
                mask = allowed & attn_mask
            else:
                mask = apply_masks(attn_mask.to(q.dtype), allowed, None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)

    def _flex_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        rotated: Rotated = "none",
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """FlexAttention: position terms as a score_mod; causal, window and document
        masking as one block mask (``_flex_block_mask``).

        A bias of j - i alone at default positions without attn_mask or documents first
        tries the fused Triton kernel (``_fused_distance_attention``, where
        FUSED_DISTANCE_ROUTES lists the device for its form); otherwise it is computed
        per score (``_flex_bias``) or read from its [H, N + M - 1] vector (O(N + M)
        memory); other position terms are captured as the tensor the sdpa backend
        would add. Value-side terms need the weights and are refused.
        """
        if self.has_value_term:
            raise ValueError(
                'backend="flex" cannot add a value-side term (it needs the attention '
                'weights): use backend="eager" or "auto"'
            )
        q, k = self._rotate_for_attention(q, k, q_positions, k_positions, rotated)
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        has_bias = self.has_position_bias
        if self.folds_position_bias:  # the bias rides in extra features of q and k
            v = repeat_kv(v, q.shape[1] // v.shape[1])
            q, k = self._fold_position_bias(q, k, q_positions, k_positions)
            has_bias = False
        gqa = k.shape[1] != q.shape[1]
        default = q_positions is None and k_positions is None
        by_distance = has_bias and self.bias_by_distance and not self.has_relative_terms
        if by_distance and default and attn_mask is None and document_ids is None:
            fused = self._fused_distance_attention(q, k, v, causal, window)
            if fused is not None:
                return fused
        vec: Tensor | None = None
        added: Tensor | None = None  # [B or 1, H or 1, N, M], added to the scaled scores
        bias_fn: Any = None  # a bias per (b, h, q, kv) index, computed in the score_mod
        relative_fn: Any = None  # relative terms per (b, h, q, kv) index
        if self.has_relative_terms:
            heads_k = repeat_kv(k, q.shape[1] // k.shape[1])
            relative_fn = self._flex_relative(q, heads_k, q_positions, k_positions, dtype)
            if relative_fn is None:  # dense: the [B, H, N, M] terms, captured
                terms = self._relative_terms(q, heads_k, q_positions, k_positions, dtype)
                parts = list(terms.values())
                added = sum_into_new(parts) if parts else None
        trains_terms = self._trains_terms()
        clipped_gradient = (
            trains_terms
            and has_bias
            and default
            and added is None
            and attn_mask is None
            and window is None
            and document_ids is None
            and self._flex_trains_clipped(q, m)
        )
        if clipped_gradient:
            # the bias as a constant per score (no gradient through the kernel), its
            # gradient attached below from a band and two triangles
            with torch.no_grad():
                bias_fn = self._flex_bias(q_positions, k_positions, n, m, q.device, dtype)
        elif has_bias and not trains_terms:
            # computed per score where the block can (no gather per score). Not when
            # training it: the backward would add every score's gradient atomically
            # into a few values (T5's [H, 257], KERPLE's [H]): a T5 training step at
            # N = 8192 took 1.5 s (H100, bf16); the distance vector or the captured
            # tensor spreads those adds over N + M - 1 or N * M entries
            bias_fn = self._flex_bias(q_positions, k_positions, n, m, q.device, dtype)
        if bias_fn is None and self.bias_by_distance and default and added is None:
            vec = self._distance_bias(n, m, q.device).to(dtype)  # [H, N + M - 1]
            if self.position_bias_inside_scale:
                vec = vec * self.scale
        elif bias_fn is None and has_bias:
            bias = self._position_bias(q_positions, k_positions, n, m, q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype) * (self.scale if self.position_bias_inside_scale else 1.0)
            added = bias if added is None else added + bias
        if attn_mask is not None:
            mask = attn_mask.to(dtype) if attn_mask.dtype != torch.bool else None
            if mask is None:
                zero = torch.zeros((), dtype=dtype, device=q.device)
                mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
            added = mask if added is None else added + mask
        inside = self.scale if self.position_bias_inside_scale else 1.0
        score_mod = flex_score_mod(vec, added, n, bias_fn, inside, relative_fn)
        block_mask = self._flex_block_mask(
            q_positions, k_positions, q.shape[0], n, m, q.device, causal, window, document_ids
        )
        compile_flex = self.flex_compile
        if compile_flex is None:
            compile_flex = q.device.type == "cuda"
        io_dtype = dtype  # the position terms above stay in float32 (or float64)
        if compile_flex and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            # the fused kernel reads half-precision q, k, v and computes the scores and
            # the score_mod in float32 (an up-cast here cost the tensor cores)
            io_dtype = q.dtype
        with autocast_off(q.device.type):
            inputs = (q.to(io_dtype), k.to(io_dtype), v.to(io_dtype))
            if clipped_gradient:
                out = self._flex_with_clipped_gradient(
                    *inputs, score_mod, block_mask, gqa, compile_flex, causal, inside
                )
            else:
                out = run_flex(
                    *inputs, score_mod, block_mask, self.scale, gqa, compile_flex, trains_terms
                )
        return out.to(v.dtype)

    def _flex_trains_clipped(self, q: Tensor, m: int) -> bool:
        """flex trains this encoding's clipped bias through ``_flex_with_clipped_gradient``
        (given default positions and no other mask or term): the bias is clipped, the
        device is in ``CLIPPED_BIAS_FLEX_DEVICES`` and there are at least
        ``CLIPPED_BIAS_MIN_KEYS_PER_CLIP`` keys per unit of the clip distance."""
        clip = self.clipped_distance
        return (
            clip is not None
            and q.device.type in CLIPPED_BIAS_FLEX_DEVICES
            and band_gradient_pays(m, clip)
        )

    def _fused_distance_attention(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None
    ) -> Tensor | None:
        """flex's route for a bias of j - i alone at default positions (no attn_mask or
        documents) through ``fused_distance_attention`` where FUSED_DISTANCE_ROUTES
        lists the device for the bias's form: the kernel computes ALiBi's c_h |j - i|
        per score ("slope") and reads other biases from their per-distance vector
        ("vector": T5's clipped [H, 2K + 1], one value per tile past the clip). None
        where it does not serve: other devices, forms or widths, or a bias that
        trains, except a clipped one (T5's table), whose gradient comes from
        ``attach_clipped_bias_gradient`` as on flex's ``_flex_with_clipped_gradient``.
        """
        n, m = q.shape[2], k.shape[2]
        clip = self.clipped_distance
        trains = self._trains_terms()
        trains_clipped = (
            trains and clip is not None and window is None and band_gradient_pays(m, clip)
        )
        kind = "slope" if self.bias_linear_in_distance else "vector"
        if (
            (trains and not trains_clipped)
            or q.device.type not in FUSED_DISTANCE_ROUTES.get(kind, ())
            or not fused_distance_attention_serves(q, k, v)
        ):
            return None
        inside = self.scale if self.position_bias_inside_scale else 1.0
        if self.bias_linear_in_distance:
            bias, base = self._distance_slopes(q.device), 0  # [H]
        elif clip is not None:  # [H, 2 clip + 1] at r = -clip .. clip
            bias, base = self._clipped_distance_bias(q.device), clip
        else:  # [H, N + M - 1] at r = -(M - 1) .. N - 1
            bias, base = self._distance_bias(n, m, q.device), m - 1
        bias = bias * inside  # keeps its graph where the clipped table trains
        constant = bias.detach().float()  # what the kernel reads
        out, lse = fused_distance_attention(
            q, k, v, self.scale, constant, kind, base, causal, window
        )
        if not trains_clipped:
            return out

        def triangle(qr: Tensor, kr: Tensor, vr: Tensor, scale: float) -> tuple[Tensor, Tensor]:
            # in the backward: the kernel that served the forward, whatever the settings now
            return distance_attention_forward(qr, kr, vr, None, "none", 0, scale, True, None)

        clipped = bias  # [H, 2 clip + 1], trained
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return attach_clipped_bias_gradient(
            out, clipped, q, k, v, lse, self.scale, causal, triangle
        )

    def _flex_with_clipped_gradient(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        score_mod: Any,
        block_mask: Any,
        gqa: bool,
        compile_flex: bool,
        causal: bool,
        inside: float,
    ) -> Tensor:
        """flex_attention whose score_mod reads the clipped bias as a constant, with the
        bias's gradient attached from a band and two triangles
        (``attach_clipped_bias_gradient``); ``inside`` scales the bias (the logit scale
        where the bias sits inside it, else 1)."""
        n = q.shape[2]
        out, lse = run_flex(
            q, k, v, score_mod, block_mask, self.scale, gqa, compile_flex, return_lse=True
        )
        clipped = self._clipped_distance_bias(q.device) * inside  # [H, 2 clip + 1]
        # the backward's triangle: top-left causal over the n - clip queries that have keys
        # at least clip after them (its block mask made here: a backward fills no cache)
        rows = n - (clipped.shape[1] - 1) // 2
        triangle_mask = None
        if not causal and rows > 0:
            triangle_mask = self._flex_block_mask(
                None, None, q.shape[0], rows, rows, q.device, True
            )

        def triangle(qr: Tensor, kr: Tensor, vr: Tensor, scale: float) -> tuple[Tensor, Tensor]:
            return run_flex(
                qr, kr, vr, None, triangle_mask, scale, False, compile_flex, return_lse=True
            )

        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return attach_clipped_bias_gradient(
            out, clipped, q, k, v, lse, self.scale, causal, triangle
        )

    def _flex_block_mask(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        batch: int,
        n: int,
        m: int,
        device: torch.device,
        causal: bool,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Any:
        """The block mask of ``attention_allowed`` (mask_mod: ``flex_mask_mod``), or None
        when nothing masks.

        FlexAttention skips the blocks the mask_mod rules out entirely, so a window or
        documents cost only the blocks they keep. At default positions without documents
        the mask is cached per (N, M, causal, window, device); with explicit positions or
        documents it is built per call, per batch row where those are batched.
        """
        if not causal and window is None and document_ids is None:
            return None
        from torch.nn.attention.flex_attention import create_block_mask

        if q_positions is None and k_positions is None and document_ids is None:
            key = ("flex_mask", n, m, causal, window, str(device))
            cached = cache_get(self._cache, key)
            if cached is None:
                mask_mod = flex_mask_mod(None, None, n, m, causal, window, None)
                cached = create_block_mask(mask_mod, None, None, n, m, device=device)
                cached = cache_put(self._cache, key, cached)
            return cached
        per_batch = any(
            t is not None and t.dim() == 2 and t.shape[0] > 1
            for t in (q_positions, k_positions, document_ids)
        )
        mask_mod = flex_mask_mod(q_positions, k_positions, n, m, causal, window, document_ids)
        mask_batch = batch if per_batch else None
        return create_block_mask(mask_mod, mask_batch, None, n, m, device=device)

    def _sdpa_relative(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """SDPA with the relative terms (they depend on q and k) materialised as the mask.

        With causal or window masking at default positions, the queries go in chunks
        (``query_chunks``), each with the explicit positions of its queries and of the
        keys it may read: its terms span only those keys.
        """
        n, m = q.shape[2], k.shape[2]
        default = q_positions is None and k_positions is None and document_ids is None
        if default and attn_mask is None and (causal or window is not None):
            spans = query_chunks(n, m, q.device.type, causal, window)
            if len(spans) > 1:
                outs = [
                    self._sdpa_relative(
                        q[:, :, i0:i1],
                        k[:, :, lo:hi],
                        v[:, :, lo:hi],
                        torch.arange(m - n + i0, m - n + i1, device=q.device),
                        torch.arange(lo, hi, device=q.device),
                        causal,
                        None,
                        window,
                    )
                    for i0, i1, lo, hi in spans
                ]
                return torch.cat(outs, dim=2)
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # the terms read every head
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        parts = list(self._relative_terms(q, k, q_positions, k_positions, dtype).values())
        if self.has_position_bias:
            bias = self._position_bias(q_positions, k_positions, n, m, q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype)
            if self.position_bias_inside_scale:
                bias = bias * self.scale
            parts.append(bias)
        if parts:
            mask = sum_into_new(parts)  # [B, H, N, M], a fresh tensor
        else:
            mask = torch.zeros((n, m), dtype=dtype, device=q.device)
        allowed = attention_allowed(
            q_positions, k_positions, n, m, q.device, causal, window, document_ids
        )
        if allowed is not None:
            mask = block_fresh(mask, allowed)
        mask = apply_masks(mask, None, attn_mask)
        if self.has_value_term:
            # the value term needs the weights, which SDPA does not return: form them
            # once and apply them to v here as well (an SDPA call on top would double
            # the work: Shaw at N = 512 on the CPU ran 10.6x plain SDPA, eager 6.7x)
            content = torch.matmul(q.to(dtype), k.to(dtype).transpose(-2, -1)) * self.scale
            weights = masked_softmax(content + mask)  # [B, H, N, M]
            out = torch.matmul(weights, v.to(dtype))
            return (out + self._value_term(weights, q_positions, k_positions)).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=self.scale)
        return out.to(v.dtype)

    def _sdpa_by_distance(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        gqa: dict[str, bool],
        window: int | None = None,
    ) -> Tensor:
        """SDPA with a bias of j - i alone, never an [H, N, M] tensor: O(N + M) memory.

        The bias per distance [H, N + M - 1] (causal and window masking folded in as -inf
        on the distances they exclude, ``distance_allowed``) is viewed as [1, H, N, M]
        with the queries reversed (``query_reversed_bias``); q goes in reversed and the
        output comes back in order.
        """
        n, m = q.shape[2], k.shape[2]
        clip = self.clipped_distance
        if (
            clip is not None
            and self._trains_terms()
            and clipped_bias_attention_serves(q, m, clip, window)
        ):
            # a training step without SDPA's math kernel: the bias's gradient from a band
            # of clip diagonals and two triangles (``_ClippedBiasAttention``)
            clipped = self._clipped_distance_bias(q.device)  # [H, 2 clip + 1]
            if self.position_bias_inside_scale:
                clipped = clipped * self.scale
            groups = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            return clipped_bias_attention(q, k, v, clipped.to(q.dtype), self.scale, causal)
        vec = self._distance_bias(n, m, q.device)  # [H, N + M - 1]
        if self.position_bias_inside_scale:
            vec = vec * self.scale  # SDPA scales q.k only; this bias sits inside the scale
        allowed = distance_allowed(n, m, q.device, causal, window)  # [N + M - 1] or None
        if allowed is not None:
            vec = vec.masked_fill(~allowed, float("-inf"))
        vec = half_precision_bias(vec, q.dtype)  # [H, N + M - 1]
        if n == 1:  # one query (a decode step): the vector is its row, in key order
            mask = vec[None, :, None, :]  # [1, H, 1, M]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **gqa)
        if allowed is None and not vec.requires_grad:
            spans = [(0, n, 0, m)]  # nothing to skip: one call over every key
        else:
            spans = query_chunks(n, m, q.device.type, causal, window)

        def chunk_view(i0: int, i1: int, lo: int, hi: int) -> Tensor:
            return distance_chunk_view(vec, n, i0, i1, lo, hi)  # [1, H, rows, keys]

        return self._sdpa_in_chunks(q, k, v, spans, chunk_view, gqa, queries_reversed=True)

    def _sdpa_in_chunks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[tuple[int, int, int, int]],
        mask_of: Any,
        gqa: dict[str, bool],
        queries_reversed: bool = False,
    ) -> Tensor:
        """One SDPA call per (i0, i1, lo, hi) of ``query_chunks``: queries i0 .. i1 - 1
        against keys lo .. hi - 1 with the mask ``mask_of(i0, i1, lo, hi)``, whose rows
        run in reverse query order when ``queries_reversed`` (then the chunk's queries
        go in reversed and its output comes back in order) -> [B, H, N, value_dim]."""
        outs = []
        for i0, i1, lo, hi in spans:
            rows = q[:, :, i0:i1].flip(2) if queries_reversed else q[:, :, i0:i1]
            keys, values, mask = k[:, :, lo:hi], v[:, :, lo:hi], mask_of(i0, i1, lo, hi)
            if trained_mask_attention_serves(rows, mask):
                out = trained_mask_attention(rows, keys, values, mask, self.scale)
            else:
                out = F.scaled_dot_product_attention(
                    rows, keys, values, attn_mask=mask, scale=self.scale, **gqa
                )
            outs.append(out.flip(2) if queries_reversed else out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _sdpa_bias(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        device: torch.device,
        dtype: torch.dtype,
        causal: bool,
        window: int | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Additive mask for SDPA: the (scaled) position bias with -inf where masked."""
        bias = self._position_bias(q_positions, k_positions, n, m, device)
        assert bias is not None  # has_position_bias
        if self.position_bias_inside_scale:
            bias = bias * self.scale  # SDPA scales q.k only; this bias sits inside the scale
        allowed = attention_allowed(
            q_positions, k_positions, n, m, device, causal, window, document_ids
        )
        mask = half_precision_bias(apply_masks(bias, allowed, None), dtype)
        # SDPA's CPU kernels take a 4-D mask directly; a 3-D one is ~3x slower (measured)
        return mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1 or B, H, N, M]
