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
one). This module holds ``forward`` and the choice of backend: ``eager`` (here: the
oracle, the terms summed in float32), ``sdpa`` (``_sdpa_backend``), ``flex``
(``_flex_backend``) or ``auto``. The terms and hooks are ``AttentionTerms``
(``_terms``); the other runtime modules hold the checks, masks, per-distance biases,
rotation and kernels the backends use.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._flex_backend import FlexBackend
from ._inputs import (
    BACKENDS,
    Rotated,
    check_attention_inputs,
    check_flag,
    repeat_kv,
    to_bhnd,
    under_function_transform,
)
from ._masks import (
    apply_masks,
    attention_allowed,
    attention_without_keys,
    check_attn_mask,
    check_document_ids,
    check_window,
    masked_softmax,
    pair_documents,
)
from ._numerics import autocast_off, in_autocast_dtype
from ._position_defaults import position_verdict
from ._sdpa_backend import SdpaBackend

# "auto" runs sdpa for calls of at most this many queries (decode steps, a few
# speculative tokens) whatever the device: FlexAttention compiles one kernel per shape
# (``run_flex``, dynamic=False), and a decoding loop has a new key count every step, so
# each step would compile (FLEX_RECOMPILE_LIMIT kernels, then the unfused reference).
# A step of few queries reads each key once on sdpa too, with its bias [B, H, N, M]
# small (``few_query_inputs`` for relative terms).
AUTO_SDPA_MAX_QUERIES = 16


class PositionalAttention(SdpaBackend, FlexBackend):
    """Attention whose logits are the sum of an encoding's terms; subclassed per encoding.

    A generated encoding sets the composition flags of ``AttentionTerms`` (decided by
    posgen's plan) and overrides the hooks it needs: ``embed`` (input-level positions), ``_rotate``
    (rotary part), ``_position_bias`` and ``score_bias`` (position-only bias),
    ``_relative_terms`` (content-dependent relative terms) and ``_value_term``.

    Args:
        heads: number of attention heads.
        head_dim: features per head.
        scale_factor: the logits are scaled by 1 / sqrt(scale_factor * head_dim); None
            leaves them unscaled.
    """

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
            k_positions: int64 [M] or [batch, M]; default 0, ..., M - 1. In eager mode,
                positions equal to the defaults (or, where ``shift_invariant`` is set, the
                defaults plus one constant per batch row, or per document with
                ``document_ids``) take the defaults' fast paths.
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
            [batch, heads, N, value_dim] in the dtype of v; under autocast, on every
            backend but "eager" (the oracle, exact in float32), in the dtype
            F.scaled_dot_product_attention returns there. A query row whose every key
            is masked (by ``causal``, ``window``, ``document_ids`` or ``attn_mask``) is
            all zeros on every backend, as F.scaled_dot_product_attention gives; so is
            every row when M = 0.
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
        if backend != "eager":  # under autocast, the dtype SDPA returns there
            out = in_autocast_dtype(out)
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
        check_flag(causal, "causal")
        check_flag(keys_rotated, "keys_rotated")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "flex" and self.has_value_term:  # refused for every shape, empty too
            raise ValueError(
                'backend="flex" cannot add a value-side term (it needs the attention '
                'weights): use backend="eager" or "auto"'
            )
        window = check_window(window)
        # the positions' values are checked below, in the read that tells the defaults
        q, k, q_positions, k_positions, rotated = self._positions_and_axes(
            q, k, q_positions, k_positions, "keys" if keys_rotated else "none", False
        )
        n, m = q.shape[2], k.shape[2]
        document_ids = check_document_ids(document_ids, n, m, q.shape[0], q.device)
        attn_mask = check_attn_mask(attn_mask, q, m)
        if not causal:
            self._check_keys_ahead(q_positions, k_positions, n, m, q.dtype)  # xPos: growing factors
        queries_last = False  # every query at or after every key, by the positions given
        if q_positions is None and k_positions is None:
            sampled = self._sampled_positions(m, q.device)  # randomized encodings, training
            if sampled is not None:
                k_positions, q_positions = sampled, sampled[m - n :]
        else:
            verdict = position_verdict(
                q_positions,
                k_positions,
                n,
                m,
                self.shift_invariant,
                document_ids,
                True,
                # keys the mask leaves unread may sit anywhere (a left-padded batch),
                # except where their positions set the rotation's frequencies, and for
                # CoPE's counted positions, kept as given (a key the mask hides counts
                # 0 there, so this forgoes only the defaults' paths)
                None
                if self._counted_position_table() is not None or self.length_sets_frequencies
                else attn_mask,
            )
            if verdict.default:
                # the defaults, given (or, where only differences count, shifted per row
                # or per document): the paths for default positions (per-distance views,
                # query chunks that skip masked keys, cached tables) serve them
                q_positions = k_positions = None
            queries_last = verdict.queries_last
        if window is not None and window >= m and q_positions is None and k_positions is None:
            window = None  # default positions: every |query - key| < M (N <= M)
        q = self._scaled_queries(q, q_positions, m)  # (a query scale's)
        self._check_value_width(v)
        if n == 0 or m == 0:
            return attention_without_keys(q, k, v)
        if backend == "auto":
            backend = self._auto_backend(q)
        default_positions = q_positions is None and k_positions is None
        if causal and (n == 1 and default_positions or queries_last) and backend != "eager":
            # one query at the default position M - 1 (a decode step), or queries given
            # positions at or after every key's (one at explicit positions): no key is
            # after a query, so causal masks nothing, and a mask of [1, M] would cost
            # about 30 us a step on a 2-core CPU (the eager oracle keeps the mask, so
            # tests compare)
            causal = False
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
          against 12x; not causal within 15% of eager), and past 2 clip distances of
          keys reads them from a band and the far keys' totals
          (``clipped_relative_attention``: 2.1-2.7x forward, 2.2-2.6x training);
        - on CUDA, a position bias or relative terms that stay in the logits: "flex"
          (H200, attention_backends_cuda_bfloat16_fused.md: ALiBi forward 1.6-2.9x
          against sdpa's 3.3-6.5x and training 1.6-2.3x against 2.2-3.8x, T5 forward
          2.6-4.0x against 3.4-6.8x and training 3.8-6.6x against 5.4-18x, N = 2048 and
          8192 alike; H100, attention_backends_cuda_bfloat16_family.md: the relative
          family 11-16x against 15-32x at N = 2048);
        - otherwise (no position term in the logits, a bias folded into q and k, the
          CPU, where FlexAttention is not fused, or at most ``AUTO_SDPA_MAX_QUERIES``
          queries, a decode step): "sdpa" (FlashAttention where it can);
        - under a torch.func transform (``grad``, ``jacrev``, ``vmap``): "eager", whose
          plain ops every transform takes (the other backends' autograd Functions and
          flash kernels with a trained mask do not).
        """
        if under_function_transform():
            return "eager"  # torch.func's grad, jacrev, vmap: plain ops only
        if self.has_value_term:
            return "eager" if q.is_cuda else "sdpa"
        if q.shape[2] <= AUTO_SDPA_MAX_QUERIES:
            return "sdpa"
        folded = self.folds_position_bias and self.fold_bias is not False
        in_logits = self.has_relative_terms or (self.has_position_bias and not folded)
        flex_width = q.shape[-1] >= 16 and q.shape[-1] & (q.shape[-1] - 1) == 0
        return "flex" if in_logits and q.is_cuda and flex_width else "sdpa"

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
            documents = pair_documents(document_ids, n, m)
            terms = self._score_terms_exact(
                q, k, q_positions, k_positions, rotated, documents, attn_mask
            )
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
