"""The ``flex`` backend: FlexAttention with the position terms as a score_mod and the
masks as a block mask, so no [B, H, N, M] tensor is formed.

A bias of j - i alone at default positions goes through posgen's fused Triton kernel
(``_fused_distance``) where ``FUSED_DISTANCE_ROUTES`` lists the device for its form,
relative-table terms where ``FUSED_RELATIVE_DEVICES`` does,
and a trained table clipped at a distance (T5's) can take its gradient from a band and
two triangles (``_trained_bias``) where ``CLIPPED_BIAS_FLEX_DEVICES`` says.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._caches import cache_get, cache_put
from ._flex import flex_mask_mod, flex_positions, flex_relative_terms, flex_score_mod, run_flex
from ._fused_distance import (
    RelativeRows,
    attend_fused,
    distance_attention_forward,
    fused_distance_attention,
    fused_distance_attention_serves,
)
from ._inputs import Rotated, repeat_kv
from ._masks import (
    pair_documents,
    sum_into_new,
)
from ._numerics import autocast_off, compute_dtype
from ._terms import AttentionTerms, RelativePart
from ._trained_bias import (
    attach_clipped_bias_gradient,
    band_gradient_pays,
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
#: device types where the flex backend runs relative terms read from their projections
#: (BERT's, DeBERTa's and Transformer-XL's tables, at default positions) through the
#: fused kernels (``fused_relative_attention``) instead of FlexAttention's score_mod:
#: a forward that needs no gradient where the device is listed here, a training step
#: where it is listed in both. Empty: on an H200 the forward was 1.1-1.4x faster than
#: the score_mod and the training step slower, and its CUDA tests have not all run and
#: passed (DeBERTa's bf16 case failed, most likely on the test's tolerance for a
#: gradient that cancels to zero, since fixed); tests add the CPU, interpreted.
FUSED_RELATIVE_DEVICES: set[str] = set()
FUSED_RELATIVE_TRAINED_DEVICES: set[str] = set()
#: device types where a bias that trains (ALiBi's learned slopes, T5's table, KERPLE's
#: parameters) takes that route with its gradient added up inside the dQ kernel
#: (``fused_distance_attention`` with a bias that needs a gradient); elsewhere a trained
#: bias stays on FlexAttention, but for a clipped one where the band-and-triangle
#: gradient pays. Empty until run and timed on a GPU; tests add the CPU, interpreted.
FUSED_DISTANCE_TRAINED_DEVICES: set[str] = set()


class FlexBackend(AttentionTerms):
    """The ``flex`` backend's methods (see the module docstring)."""

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
        would add. Value-side terms need the weights: ``_attend`` refuses them.
        """
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
            relative_parts = self._relative_parts(q, heads_k, dtype, causal) if default else None
            if relative_parts is not None and not (has_bias or attn_mask is not None):
                fused = self._fused_relative_attention(
                    q, k, v, relative_parts, causal, window, document_ids
                )
                if fused is not None:
                    return fused
            if relative_parts is not None:  # read per score from [B, H, N, K] projections
                relative_fn = flex_relative_terms(relative_parts, n, dtype, q.device)
            elif (clipped := self._clipped_relative_parts(q, heads_k, dtype)) is not None:
                # given positions: the same, over every row, at clip(j - i) of the positions
                assert self.relative_clip is not None  # the parts are clipped at it
                positions = flex_positions(q_positions, k_positions, n, k.shape[2])
                width = self.relative_clip + 1  # the diagonals of K + 1 queries and keys
                relative_fn = flex_relative_terms(clipped, width, dtype, q.device, positions)
            else:  # dense: the [B, H, N, M] terms, captured
                documents = pair_documents(document_ids, n, k.shape[2])
                terms = self._relative_terms(
                    q, heads_k, q_positions, k_positions, dtype, documents, attn_mask
                )
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
        ("vector": T5's clipped [H, 2K + 1], one value per tile past the clip). A bias
        that trains gets its gradient from the kernel where FUSED_DISTANCE_TRAINED_DEVICES
        lists the device; elsewhere a clipped one (T5's table) gets it from
        ``attach_clipped_bias_gradient``, as on flex's ``_flex_with_clipped_gradient``.
        None where it does not serve: other devices, forms or widths, or another bias
        that trains.
        """
        n, m = q.shape[2], k.shape[2]
        clip = self.clipped_distance
        trains = self._trains_terms()
        in_kernel = trains and q.device.type in FUSED_DISTANCE_TRAINED_DEVICES
        trains_clipped = (
            trains
            and not in_kernel
            and clip is not None
            and window is None
            and band_gradient_pays(m, clip)
        )
        kind = "slope" if self.bias_linear_in_distance else "vector"
        if (
            (trains and not (in_kernel or trains_clipped))
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
        bias = bias * inside  # keeps its graph where the bias trains
        if in_kernel:  # the kernel's backward gives the bias its gradient
            out, _ = fused_distance_attention(q, k, v, self.scale, bias, kind, base, causal, window)
            return out
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

    def _fused_relative_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        parts: list[RelativePart],
        causal: bool,
        window: int | None,
        document_ids: Tensor | None,
    ) -> Tensor | None:
        """flex's route for relative terms at default positions (no position bias,
        attn_mask or documents) through the fused kernels, which read each term from its
        projection per score (as ``fused_relative_attention``), where
        FUSED_RELATIVE_DEVICES lists the device (and, for a call that needs gradients,
        FUSED_RELATIVE_TRAINED_DEVICES). At most one query-side term (a trained vector
        per head counts as one, read alike by every query) and one key-side term
        (Transformer-XL's u . k_j, one value per key, counts as one); None otherwise."""
        devices = FUSED_RELATIVE_DEVICES
        if self._trains_step(q, k, v):
            devices = devices & FUSED_RELATIVE_TRAINED_DEVICES
        if (
            q.device.type not in devices
            or document_ids is not None
            or not fused_distance_attention_serves(q, k, v)
        ):
            return None
        batch, heads, n = q.shape[:3]
        slots: dict[str, RelativeRows] = {}
        for side, scores, diagonal in parts:
            slot = "query" if side in ("query", "global") else "key"
            if slot in slots:
                return None
            if side == "global":  # [H, K]: every query alike
                scores = scores[None, :, None, :].expand(batch, heads, n, scores.shape[-1])
            elif side == "content":  # [B, H, M]: one value per key
                scores = scores[..., None]
            if diagonal is None:
                slots[slot] = RelativeRows(scores.float(), None)
            else:
                shape = ("fused_relative_diagonal", slot, n, k.shape[2], causal, str(q.device))
                slots[slot] = RelativeRows(scores.float(), *self._kernel_diagonal(diagonal, shape))
        query_rows, key_rows = slots.get("query"), slots.get("key")
        out, _ = attend_fused(
            q, k, v, None, "none", 0, self.scale, causal, window, query_rows, key_rows
        )
        return out

    def _kernel_diagonal(self, diagonal: Tensor, key: tuple[Any, ...]) -> tuple[Tensor, int, int]:
        """A term's diagonal [N + M - 1] as the fused kernel reads it: int32, with the last
        index up to which it holds its first row and the first from which on it holds its
        last (beyond a clip; tiles past them read one value per query or key). Found with
        host syncs once per ``key`` (the shape) and cached."""
        cached = cache_get(self._cache, key)
        if cached is None:
            rows = diagonal.to(torch.int32)
            left = torch.nonzero(rows != rows[0])  # [changes, 1]
            right = torch.nonzero(rows != rows[-1])
            below = int(left[0, 0]) - 1 if left.numel() else rows.numel() - 1
            above = int(right[-1, 0]) + 1 if right.numel() else 0
            cached = cache_put(self._cache, key, (rows, below, above))
        return cached

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
