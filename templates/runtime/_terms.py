"""What an encoding adds to attention: ``AttentionTerms``, the base of every backend.

It holds the composition flags a generated encoding sets (decided by posgen's plan),
the hooks it overrides (input-level positions, rotation, the position-only bias, the
content-dependent relative terms, the value-side term, and their per-score forms for
FlexAttention) and the logits term by term (``score_terms``: the decomposition the
eager oracle sums). The backends (``_sdpa_backend``, ``_flex_backend``) read these
hooks; ``_attention`` chooses between them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ._inputs import (
    Rotated,
    check_attention_inputs,
    check_axis_positions,
    check_position_pair,
    check_positions,
    positive_int,
    repeat_kv,
    to_bhnd,
)
from ._numerics import autocast_off, compute_dtype


class RelativePart(NamedTuple):
    """One relative term at default positions, as its projection over the K table rows
    it reads (``AttentionTerms._relative_parts``): no [B, H, N, M] tensor.

    side: what the table row is dotted with. "query": q_i ([B, H, N, K] scores, the
    term of query i and key j being scores[..., i, row]); "key": k_j ([B, H, M, K],
    scores[..., j, row]); "global": a trained vector per head ([H, K], scores[h, row]);
    "content": no row at all (scores [B, H, M], one value per key: Transformer-XL's
    u . k_j). row = diagonal[j - i + N - 1] (query and key indices), diagonal int64
    [N + M - 1] (None for "content"). Each term is scaled as it enters the logits.
    """

    side: str
    scores: Tensor
    diagonal: Tensor | None


class AttentionTerms(nn.Module):
    """The flags, hooks and term-by-term logits of an encoding (see the module
    docstring); ``PositionalAttention`` adds the backends and ``forward``."""

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
    #: every relative term (and the value-side term) reads one table row for all key
    #: minus query positions >= this distance, and one for all <= minus it (Shaw's and
    #: BERT's clip, DeBERTa's log buckets past max_distance); None where it does not
    relative_clip: int | None = None
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
        for name, at_axes, other in (("q", q_axes, q_positions), ("k", k_axes, k_positions)):
            if at_axes is None and other is not None:
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

    def _relative_parts(
        self, q: Tensor, k: Tensor, dtype: torch.dtype, causal: bool = False
    ) -> list[RelativePart] | None:
        """The relative terms at default positions as projections over their table rows
        (``RelativePart``), for backends that read them per score or per band instead
        of as [B, H, N, M] tensors; None where the encoding has no such form (then
        ``_relative_terms``' dense tensors serve). With ``causal`` the diagonals whose
        key comes after the query may read any row (they are masked). k has q's heads."""
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

    def _trains_terms(self) -> bool:
        """Gradients flow into the position terms' parameters (tables, slopes, kernels):
        the module holds nothing else."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())

    def _trains_step(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Gradients flow from this call: into q, k, v or the module's parameters."""
        inputs_train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return inputs_train or self._trains_terms()
