"""The ``sdpa`` backend: F.scaled_dot_product_attention with the position terms as an
additive mask.

A bias of j - i alone at default positions is a strided view of its per-distance
vector (O(N + M) memory; ``_distances``); masked CPU attention goes in query chunks
against only the keys each chunk may see, with relative terms and other biases built
per chunk; a trained bias on the CPU avoids SDPA's math kernel (``_trained_bias``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._chunked_flash import (
    chunked_flash_attention,
    chunked_flash_serves,
    cpu_flash_serves,
    sequence_slices,
    unit_rows,
)
from ._clipped_relative import (
    band_terms,
    chunked_relative_attention,
    clipped_relative_attention,
    clipped_relative_serves,
    terms_at_positions,
)
from ._directional_bias import directional_bias_attention, directional_bias_serves
from ._distances import (
    bias_floor_serves,
    content_spread,
    distance_chunk_view,
    distance_chunk_views,
    floored_bias,
    floored_rows,
    half_precision_bias,
)
from ._few_queries import few_queries, few_query_inputs, few_query_relative_serves
from ._grouped_queries import scaled_dot_product
from ._inputs import (
    Rotated,
    repeat_kv,
)
from ._mask_buffer import AssembledMasks
from ._masks import (
    apply_masks,
    attention_allowed,
    attn_mask_span,
    block_fresh,
    distance_allowed,
    document_chunks_serve,
    documents_joined,
    mask_chunk_rows,
    masked_softmax,
    pair_documents,
    query_chunks,
    reachable_query_chunks,
    sum_into_new,
)
from ._numerics import compute_dtype
from ._recomputed_mask import recomputed_mask_attention, recomputed_mask_serves
from ._skewed_relative import skewed_relative_attention, skewed_relative_serves
from ._terms import (
    AttentionTerms,
    RelativeFactors,
    RelativePart,
    merged_factors,
    projected_parts,
)
from ._trained_bias import (
    clipped_bias_attention,
    clipped_bias_attention_serves,
    trained_mask_attention,
    trained_mask_attention_serves,
)


def bias_row_bytes(
    q: Tensor,
    m: int,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    document_ids: Tensor | None,
    attn_mask: Tensor | None,
) -> int:
    """The bytes of one query's row of the mask that ``_sdpa_bias`` builds for a chunk
    of queries: [B or 1, H, 1, M] in float32 or wider (a bias is made in float32 at
    least), with the batch where batched positions, documents or an attn_mask give each
    batch row its own."""
    per_row = (q_positions, k_positions, document_ids)
    batched = any(t is not None and t.dim() == 2 for t in per_row)
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[0] > 1:
        batched = True
    rows = q.shape[0] if batched else 1
    return rows * q.shape[1] * m * max(q.element_size(), 4)


def relative_parts_serve(factors: list[RelativeFactors], causal: bool) -> bool:
    """Whether ``_sdpa_relative_parts`` runs these relative terms: everywhere but a
    causal training step without a key-side term. That one builds each query chunk's
    terms at its own positions instead: it projects only the chunk's queries, while the
    parts gather every chunk's terms over the widest chunk's keys (2-core CPU, float32,
    batch 2, 8 heads, N = 1024, against plain SDPA: BERT relative_key 3.30x per chunk
    against 4.05x from the parts, Transformer-XL 5.35x against 6.95x; with a key-side
    term, whose projection each chunk would redo, the parts won: BERT
    relative_key_query 6.9x -> 6.3x, DeBERTa 6.2x -> 5.4x)."""
    trains = torch.is_grad_enabled() and any(
        part.x.requires_grad or part.rows.requires_grad for part in factors
    )
    return not (causal and trains and all(part.side != "key" for part in factors))


class SdpaBackend(AttentionTerms):
    """The ``sdpa`` backend's methods (see the module docstring)."""

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
        # the CPU flash kernels called directly read rows as contiguous features: one
        # copy of a transposed view here, rather than one per chunk (SDPA would copy too)
        q, k, v = unit_rows(q), unit_rows(k), unit_rows(v)
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
        default_positions = q_positions is None and k_positions is None
        # a window folds into the per-distance vector (it depends on j - i alone); the
        # documents do not, so they take the materialised bias below
        by_distance = default_positions and attn_mask is None and document_ids is None
        if self.bias_by_distance and by_distance:
            return self._sdpa_by_distance(q, k, v, causal, window)
        # at default positions: chunks that skip masked keys (causal or window masking),
        # and chunks of a bias of (query, key) over every key, so that no [H, N, M] bias
        # (nor, where it trains, the graph that builds it) exists at once
        chunkable = by_distance and (causal or window is not None or has_bias)
        row_bytes = 0  # no bias, or masks built in parts: chunks of SDPA_QUERY_CHUNK
        part_rows = None  # queries per part of a chunk's mask (``AssembledMasks``)
        if has_bias:
            row_bytes = bias_row_bytes(q, m, q_positions, k_positions, document_ids, attn_mask)
            if self._masks_need_no_grad(attn_mask):
                part_rows, row_bytes = mask_chunk_rows(q.device.type, row_bytes), 0
        spans: list[tuple[int, int, int, int]] = []
        if chunkable:
            spans = query_chunks(n, m, q.device.type, causal, window, mask_row_bytes=row_bytes)
        if has_bias and len(spans) > 1:
            # each chunk of queries gets the bias at its own positions, over the keys it
            # may read
            return self._sdpa_bias_in_chunks(
                q, k, v, spans, None, None, causal, window, None, None, part_rows
            )
        if has_bias:
            # explicit positions, an attn_mask or documents: the bias per pair, in chunks
            # of queries, so that no [H, N, M] bias exists at once; each chunk over the
            # keys its documents hold and only those its causal mask or window allow, by
            # index at default positions and by position at explicit ones
            # (``position_spans``)
            spans = reachable_query_chunks(
                n,
                m,
                q.device.type,
                causal,
                window,
                document_ids,
                q_positions,
                k_positions,
                row_bytes,
            )
            if len(spans) > 1:
                return self._sdpa_bias_in_chunks(
                    q,
                    k,
                    v,
                    spans,
                    q_positions,
                    k_positions,
                    causal,
                    window,
                    document_ids,
                    attn_mask,
                    part_rows,
                )
            bias = self._sdpa_bias(
                q_positions,
                k_positions,
                n,
                m,
                q.device,
                q.dtype,
                causal,
                window,
                document_ids,
                attn_mask,
                spread=self._floor_spread(q, k),
            )
            return scaled_dot_product(q, k, v, bias, self.scale)
        only_causal = window is None and document_ids is None and attn_mask is None
        if causal and default_positions and n == m and only_causal:
            # keys 0..M-1 and queries 0..N-1: SDPA's own causal mask, no mask tensor
            gqa: dict[str, Any] = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, **gqa)
        allowed = attention_allowed(
            q_positions, k_positions, n, m, q.device, causal, window, document_ids
        )  # [N, M] or [B, 1, N, M], or None
        narrows = document_ids is not None or not default_positions
        if allowed is not None and attn_mask is None and narrows:
            # packed documents, or causal or window masking at explicit positions: each
            # chunk of queries over its documents' keys and those its positions may reach
            reach = reachable_query_chunks(
                n, m, q.device.type, causal, window, document_ids, q_positions, k_positions
            )
            if document_chunks_serve(reach, n, m):
                grid_of_documents = allowed  # [N, M] or [B, 1, N, M]

                def chunk_documents(i0: int, i1: int, lo: int, hi: int) -> Tensor:
                    return grid_of_documents[..., i0:i1, lo:hi]

                # at default positions each query reads its own key; at others a row
                # may read none
                return self._sdpa_in_chunks(
                    q, k, v, reach, chunk_documents, every_row_reads=default_positions
                )
        if allowed is not None and len(spans) > 1:
            # a window, or causal queries that are the last N of M keys: each chunk of
            # queries against only the keys it may read, its mask a view of the grid
            # (long chunks for a long sequence: ``SDPA_LONG_QUERY_CHUNK``)
            spans = query_chunks(n, m, q.device.type, causal, window, views=True)
            grid = allowed  # [N, M]

            def chunk_allowed(i0: int, i1: int, lo: int, hi: int) -> Tensor:
                return grid[i0:i1, lo:hi]

            return self._sdpa_in_chunks(q, k, v, spans, chunk_allowed)
        mask: Tensor | None = allowed
        if attn_mask is not None:
            if allowed is None:
                mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
            elif attn_mask.dtype == torch.bool:
                mask = allowed & attn_mask
            else:
                mask = apply_masks(attn_mask.to(q.dtype), allowed, None)
        return scaled_dot_product(q, k, v, mask, self.scale)

    def _masks_need_no_grad(self, attn_mask: Tensor | None) -> bool:
        """Whether the masks of a call get no gradient (no parameter of the module and no
        float ``attn_mask`` trains). Then the chunks of a bias built per chunk keep
        ``SDPA_QUERY_CHUNK`` queries, and in eager mode their masks are built
        ``mask_chunk_rows`` queries at a time into one buffer (``AssembledMasks``,
        through ``_sdpa_in_chunks``). Short chunks cost a training step more than their
        masks' faults: its flash backward adds every chunk's dK and dV over all keys
        (2-core CPU, float32, ALiBi at positions 2 apart, N = 2048, batch 2, 16 heads,
        against plain SDPA: 1.59x in chunks of 256, 1.84x in chunks of 64,
        attention_backends_cpu_float32_flash_chunks_train.md). With the masks in parts,
        in one loop against chunks cut to 8 MiB masks (or, training, whole masks of 256
        queries): forward ALiBi 2.02x -> 1.47x, T5 2.21x -> 1.69x, KERPLE 2.34x -> 1.66x,
        FIRE 2.83x -> 2.08x (causal 1.95x -> 1.76x, 2.02x -> 1.95x, 2.12x -> 1.78x,
        2.69x -> 2.53x); ALiBi's training step 1.64x -> 1.42x
        (benchmarks/results/revisions_cpu_float32_assembled_masks.md). Masks that train
        are cut to ``SDPA_MASK_CHUNK_BYTES`` instead (``recomputed_mask_attention``
        builds each again with its graph)."""
        mask_trains = attn_mask is not None and attn_mask.requires_grad
        return not (self._trains_terms() or (torch.is_grad_enabled() and mask_trains))

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
        documents: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """SDPA with the relative terms (they depend on q and k) as the mask.

        documents: the queries' and keys' documents for the terms (``pair_documents``)
        where a chunk's call has the documents' rule in ``attn_mask`` instead of
        ``document_ids``.

        At default positions, with no attn_mask or position bias, in this order: the
        clipped path (``clipped_relative_attention``, CPU); for more than a few queries
        and no value-side term, each query chunk's terms gathered from their projections
        over the table rows (``_sdpa_relative_parts``); a few queries read theirs from
        the factors (``few_query_inputs``). Otherwise the dense terms, with the queries
        in chunks (``reachable_query_chunks``) wherever positions are given, masks apply
        or documents are packed: each chunk at the positions of its queries and of the
        keys it may read (its documents' keys, and those its causal mask or window
        allows: by index at default positions, by position at explicit ones), so its
        terms span only those keys.
        """
        n, m = q.shape[2], k.shape[2]
        default = q_positions is None and k_positions is None and document_ids is None
        clipped = self.relative_clip
        if (
            clipped is not None
            and default
            and attn_mask is None
            and window is None
            and not self.has_position_bias
            and clipped_relative_serves(q, m, clipped, self._trains_step(q, k, v))
        ):
            # terms read one row past the clip: a band of exact terms plus far keys as
            # plain flash attention (``clipped_relative_attention``)
            groups = q.shape[1] // k.shape[1]
            heads_k, heads_v = repeat_kv(k, groups), repeat_kv(v, groups)
            relative_factors = self._relative_factors(q, heads_k, compute_dtype(q), causal)
            if relative_factors:
                assert clipped is not None  # clipped_relative_serves
                value_term = self._value_term if self.has_value_term else None
                out = clipped_relative_attention(
                    q, heads_k, heads_v, relative_factors, clipped, self.scale, causal, value_term
                )
                return out.to(v.dtype)
        by_parts = (
            q_positions is None
            and k_positions is None
            and attn_mask is None
            and not self.has_position_bias
            and not self.has_value_term
            and not few_queries(n)
        )
        if by_parts:
            # the terms of each chunk gathered from the projections over the table rows
            # (``band_terms``: row-major, no transposed key-side term)
            heads_k = repeat_kv(k, q.shape[1] // k.shape[1])  # the terms read every head
            factors = self._relative_factors(q, heads_k, compute_dtype(q), causal)
            if factors:  # once: q + v is a new [B, H, N, D]; merging again is then a no-op
                factors = merged_factors(factors)
            spans = query_chunks(n, m, q.device.type, causal, None)
            plain = window is None and document_ids is None
            if plain and factors and skewed_relative_serves(factors, q, heads_k, v, spans):
                # one query-side term: a strided view of each chunk's own projection
                heads_v = repeat_kv(v, q.shape[1] // v.shape[1])
                out = skewed_relative_attention(
                    q, heads_k, heads_v, factors, spans, self.scale, causal
                )
                return out.to(v.dtype)
            if factors and relative_parts_serve(factors, causal):
                relative_parts = projected_parts(factors)
                return self._sdpa_relative_parts(
                    q, k, heads_k, v, relative_parts, causal, window, document_ids
                )
        given = q_positions is not None or k_positions is not None or attn_mask is not None
        if given or causal or window is not None or document_ids is not None:
            # the dense terms a chunk of queries at a time (each at its queries'
            # positions), so that no [B, H, N, M] terms exist at once: over the keys its
            # documents hold and only those its causal mask or window allow, by index at
            # default positions and by position at explicit ones (``position_spans``)
            spans = reachable_query_chunks(
                n, m, q.device.type, causal, window, document_ids, q_positions, k_positions
            )
            if len(spans) > 1:
                return self._sdpa_relative_in_chunks(
                    q,
                    k,
                    v,
                    spans,
                    q_positions,
                    k_positions,
                    causal,
                    attn_mask,
                    window,
                    document_ids,
                )
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)  # the terms read every head
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        factors = None
        if q_positions is None and k_positions is None and few_queries(n):
            factors = self._relative_factors(q, k, dtype, causal)
        if factors and few_query_relative_serves(factors, clipped):
            # a decode step: no key projected over every row; terms with one value per
            # key ride in q (``_few_queries``)
            q, terms = few_query_inputs(q, factors, n, m, clipped, self.scale)
            parts = [] if terms is None else [terms]
        else:
            if documents is None:
                documents = pair_documents(document_ids, n, m)
            by_name = self._relative_terms(q, k, q_positions, k_positions, dtype, documents)
            parts = list(by_name.values())
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

    def _sdpa_relative_in_chunks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[tuple[int, int, int, int]],
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        window: int | None,
        document_ids: Tensor | None,
    ) -> Tensor:
        """``_sdpa_relative`` one span of queries at a time (``spans``: (i0, i1, lo, hi),
        queries i0 .. i1 - 1 against keys lo .. hi - 1), each at its queries' and keys'
        positions (explicit, or the defaults' rows), with its block of ``attn_mask`` and
        the documents' rule for that block joined into it -> [B, H, N, value_dim]."""
        n, m = q.shape[2], k.shape[2]
        if q_positions is None:  # the default: the queries are the last N keys
            q_positions = torch.arange(m - n, m, device=q.device)
        if k_positions is None:
            k_positions = torch.arange(m, device=q.device)
        clipped = self._clipped_parts_for_chunks(q, k, v, attn_mask)
        clip = self.relative_clip  # the clip those parts are read at
        outs = []
        for i0, i1, lo, hi in spans:
            documents = None  # the chunk's queries' and keys' documents
            if document_ids is not None:
                rows_documents = document_ids[..., m - n + i0 : m - n + i1]
                documents = (rows_documents, document_ids[..., lo:hi])
            mask = documents_joined(attn_mask_span(attn_mask, n, m, i0, i1, lo, hi), documents)
            if clipped is not None and clip is not None:
                rows_at, keys_at = q_positions[..., i0:i1], k_positions[..., lo:hi]
                terms = terms_at_positions(
                    clipped, rows_at, keys_at, (i0, i1, lo, hi), clip
                )  # [B or 1, H, rows, keys], a fresh tensor
                allowed = attention_allowed(
                    rows_at, keys_at, i1 - i0, hi - lo, q.device, causal, window, None
                )
                if allowed is not None:
                    terms = block_fresh(terms, allowed)
                terms = apply_masks(terms, None, mask).to(q.dtype)
                rows, keys, values = q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi]
                outs.append(scaled_dot_product(rows, keys, values, terms, self.scale))
                continue
            out = self._sdpa_relative(
                q[:, :, i0:i1],
                k[:, :, lo:hi],
                v[:, :, lo:hi],
                q_positions[..., i0:i1],
                k_positions[..., lo:hi],
                causal,
                mask,
                window,
                documents=documents,
            )
            outs.append(out)
        return torch.cat(outs, dim=2)

    def _clipped_parts_for_chunks(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None
    ) -> list[RelativePart] | None:
        """The relative terms projected once for every chunk of ``_sdpa_relative_in_chunks``
        at any positions (``_clipped_relative_parts``: each side over the 2K + 1 rows
        of a table clipped at K), where they serve: eager mode with no gradient, terms
        clipped at a distance, no value-side term and no position bias; else None (each
        chunk then projects its own). Each chunk used to project every key it reads
        again. 2-core CPU, float32, N = 2048, batch 2, 8 heads, positions 2 apart,
        against plain SDPA in one loop: DeBERTa 8.66x -> 4.98x (causal 7.72x -> 4.92x),
        BERT relative_key_query 12.6x -> 6.04x (10.3x -> 6.36x), BERT relative_key
        3.75x -> 3.44x (no key side: within noise causal)
        (benchmarks/results/revisions_cpu_float32_relative_at_positions.md)."""
        if self.relative_clip is None or self.has_value_term or self.has_position_bias:
            return None
        trains = self._trains_step(q, k, v) or not self._masks_need_no_grad(attn_mask)
        if trains or torch.compiler.is_compiling():
            return None
        heads_k = repeat_kv(k, q.shape[1] // k.shape[1])  # the terms read every head
        return self._clipped_relative_parts(q, heads_k, compute_dtype(q))

    def _sdpa_relative_parts(
        self,
        q: Tensor,
        k: Tensor,
        heads_k: Tensor,
        v: Tensor,
        parts: list[RelativePart],
        causal: bool,
        window: int | None,
        document_ids: Tensor | None,
    ) -> Tensor:
        """SDPA at default positions with the relative terms ``parts`` gathered per
        query chunk (``query_chunks``) over the keys it may read, as its mask. heads_k:
        k with q's heads (k itself without grouped-query heads)."""
        n, m = q.shape[2], k.shape[2]
        allowed = attention_allowed(None, None, n, m, q.device, False, window, document_ids)
        spans = reachable_query_chunks(
            n, m, q.device.type, causal, window, document_ids, None, None
        )
        if allowed is None and cpu_flash_serves(q, v):
            # flash calls per chunk, the terms' gradient without a full-size one per chunk
            heads_v = repeat_kv(v, q.shape[1] // v.shape[1])
            out = chunked_relative_attention(q, heads_k, heads_v, parts, spans, self.scale, causal)
            return out.to(v.dtype)

        def chunk_terms(i0: int, i1: int, lo: int, hi: int) -> Tensor:
            terms = band_terms(parts, n, m, [(i0, i1, lo, hi)], causal)[..., : hi - lo]
            if allowed is not None:  # a window or documents
                terms = block_fresh(terms, allowed[..., i0:i1, lo:hi])
            return terms.to(q.dtype)

        return self._sdpa_in_chunks(q, k, v, spans, chunk_terms).to(v.dtype)

    def _sdpa_by_distance(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        window: int | None = None,
    ) -> Tensor:
        """SDPA with a bias of j - i alone, never an [H, N, M] tensor: O(N + M) memory.

        The bias per distance [H, N + M - 1] (causal and window masking folded in as -inf
        on the distances they exclude, ``distance_allowed``) is viewed as [1, H, N, M]
        with the queries reversed (``query_reversed_bias``); q goes in reversed and the
        output comes back in order.
        """
        n, m = q.shape[2], k.shape[2]
        out = self._trained_distance_attention(q, k, v, causal, window)
        if out is not None:
            return out
        spread = self._floor_spread(q, k)
        vec = self._masked_distance_bias(n, m, q.device, causal, window, spread)
        vec = half_precision_bias(vec, q.dtype)  # [H, N + M - 1]
        if n == 1:  # one query (a decode step): the vector is its row, in key order
            mask = vec[None, :, None, :]  # [1, H, 1, M]
            return scaled_dot_product(q, k, v, mask, self.scale)
        if not (causal or window is not None or vec.requires_grad):
            spans = [(0, n, 0, m)]  # nothing to skip: one call over every key
        else:  # views of the vector, but a trained one's chunks get scores of their own
            trained = vec.requires_grad
            spans = query_chunks(n, m, q.device.type, causal, window, views=not trained)

        chunk_views = distance_chunk_views(vec, n)  # [1, H, rows, keys] per span
        return self._sdpa_in_chunks(q, k, v, spans, chunk_views, queries_reversed=True)

    def _trained_distance_attention(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None
    ) -> Tensor | None:
        """A CPU training step of a bias of j - i alone that never forms its [B, H, N, M]
        scores or dS (SDPA's math kernel would), or None where neither path serves:

        - trained scalars per head (``distance_bias_parameters``: KERPLE, trained ALiBi
          slopes) get their gradients from one flash forward each
          (``directional_bias_attention``, ``directional_bias_serves``);
        - a bias clipped at K (T5, ``clipped_distance``) gets its gradient from a band of
          K diagonals and two triangles (``clipped_bias_attention``,
          ``clipped_bias_attention_serves``).
        """
        n, m = q.shape[2], k.shape[2]
        groups = q.shape[1] // k.shape[1]
        parameters = tuple(getattr(self, name) for name in self.distance_bias_parameters)
        if directional_bias_serves(q, v, window, causal, parameters):
            spread = self._floor_spread(q, k)  # [H, N, 1] or None

            def vector() -> Tensor:  # [H, N + M - 1]: SDPA's mask in _sdpa_by_distance
                return self._masked_distance_bias(n, m, q.device, causal, None, spread)

            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            return directional_bias_attention(q, k, v, vector, parameters, self.scale, causal)
        clip = self.clipped_distance
        if clip is None or not self._trains_terms():
            return None
        if not clipped_bias_attention_serves(q, v, m, clip, window):
            return None
        clipped = self._clipped_distance_bias(q.device)  # [H, 2 clip + 1]
        if self.position_bias_inside_scale:
            clipped = clipped * self.scale
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        return clipped_bias_attention(q, k, v, clipped.to(q.dtype), self.scale, causal)

    def _masked_distance_bias(
        self,
        n: int,
        m: int,
        device: torch.device,
        causal: bool,
        window: int | None,
        spread: Tensor | None,
    ) -> Tensor:
        """``_floored_distance_bias`` with -inf on the distances that causal or window
        masking excludes (``distance_allowed``): [H, N + M - 1]."""
        vec = self._floored_distance_bias(n, m, device, spread)
        allowed = distance_allowed(n, m, device, causal, window)  # [N + M - 1] or None
        return vec if allowed is None else vec.masked_fill(~allowed, float("-inf"))

    def _floored_distance_bias(
        self, n: int, m: int, device: torch.device, spread: Tensor | None
    ) -> Tensor:
        """The bias per distance for default positions as SDPA adds it, [H, N + M - 1]:
        scaled where it sits inside the scale (SDPA scales q . k only), and floored
        (``floored_bias``) where a ``spread`` [H, N, 1] is given (``_floor_spread``):
        every query reads the key at its own position, distance 0, entry M - 1, and one
        floor per head serves every query, so its spread is the head's largest."""
        vec = self._distance_bias(n, m, device)  # [H, N + M - 1]
        if self.position_bias_inside_scale:
            vec = vec * self.scale
        if n and spread is not None:
            vec = floored_bias(vec, vec[:, m - 1 : m], spread.amax(dim=1))
        return vec

    def _floor_spread(self, q: Tensor, k: Tensor) -> Tensor | None:
        """``content_spread`` of q and k as SDPA reads them ([H, N, 1]) where the bias
        is floored (``bias_floor_serves``), else None."""
        if not bias_floor_serves(q.device, q.dtype):
            return None
        return content_spread(q, k, self.scale)

    def _sdpa_bias_in_chunks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[tuple[int, int, int, int]],
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        window: int | None,
        document_ids: Tensor | None,
        attn_mask: Tensor | None,
        part_rows: int | None = None,
    ) -> Tensor:
        """SDPA with the position bias and the masks a span (i0, i1, lo, hi) of queries
        at a time: each span's mask as ``_sdpa_bias`` builds it at the span's query and
        key positions, with its documents and its part of ``attn_mask``, ``part_rows``
        queries at a time into one buffer where given (``AssembledMasks``). At default
        positions with no attn_mask every query reads a key (the spans of
        ``query_chunks``, narrowed to the documents' keys by ``document_spans``, keep
        each query's own); otherwise a row may read none, so the chunks take no path
        that needs one."""
        n, m = q.shape[2], k.shape[2]
        query_documents = None if document_ids is None else document_ids[..., m - n :]
        default = q_positions is None and k_positions is None
        # a bias of j - i at default positions: rows of its per-distance vector, made per
        # chunk (a mask made again for a gradient must not share a graph with another)
        by_distance = self.bias_by_distance and default
        spread = self._floor_spread(q, k)  # [H, N, 1] or None

        def chunk_mask(i0: int, i1: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
            rows = None if q_positions is None else q_positions[..., i0:i1]
            if rows is None:  # the default: the queries are the last N keys
                rows = torch.arange(m - n + i0, m - n + i1, device=q.device)
            keys = None if k_positions is None else k_positions[..., lo:hi]
            if keys is None:
                keys = torch.arange(lo, hi, device=q.device)
            key_documents = None if document_ids is None else document_ids[..., lo:hi]
            documents = None if query_documents is None else query_documents[..., i0:i1]
            bias = None
            if by_distance:  # [1, H, rows, keys], in query order (a copy)
                vec = self._distance_bias(n, m, q.device)  # [H, N + M - 1]
                bias = distance_chunk_view(vec, n, i0, i1, lo, hi).flip(-2)
            return self._sdpa_bias(
                rows,
                keys,
                i1 - i0,
                hi - lo,
                q.device,
                q.dtype,
                causal,
                window,
                key_documents,
                attn_mask_span(attn_mask, n, m, i0, i1, lo, hi),
                documents,
                bias,
                None if spread is None else spread[:, i0:i1],
                out,
            )

        # what the masks are built from that may train: the module's parameters and a
        # float attn_mask
        inputs: list[Tensor] = [p for p in self.parameters() if p.requires_grad]
        if attn_mask is not None and attn_mask.requires_grad:
            inputs.append(attn_mask)
        every_row_reads = default and attn_mask is None
        return self._sdpa_in_chunks(
            q,
            k,
            v,
            spans,
            chunk_mask,
            mask_inputs=tuple(inputs),
            every_row_reads=every_row_reads,
            mask_parts=part_rows,
        )

    def _sdpa_in_chunks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[tuple[int, int, int, int]],
        mask_of: Any,
        queries_reversed: bool = False,
        mask_inputs: tuple[Tensor, ...] = (),
        every_row_reads: bool = True,
        mask_parts: int | None = None,
    ) -> Tensor:
        """One SDPA call per (i0, i1, lo, hi) of ``query_chunks``: queries i0 .. i1 - 1
        against keys lo .. hi - 1 with the mask ``mask_of(i0, i1, lo, hi)``, whose rows
        run in reverse query order when ``queries_reversed`` (then the chunk's queries
        go in reversed and its output comes back in order) -> [B, H, N, value_dim].
        ``mask_inputs``: where given, every tensor the masks are built from that may
        need a gradient. ``every_row_reads``: whether every query reads a key its mask
        allows (the causal and window chunks at default positions); where not,
        ``trained_mask_attention``, whose softmax of a row of -inf is NaN, is not used
        (the CPU flash kernels give such a row zeros). ``mask_parts``: where given, the
        masks need no gradient, and in eager mode where the call is done with each mask
        before it asks for the next (the chunked flash node, and the loop where no
        gradient flows) each is built that many queries at a time into one buffer
        (``AssembledMasks``, ``mask_of`` taking an ``out`` argument).

        A training step runs as one autograd node where it serves: with masks that
        train (from ``mask_inputs``, rows in query order, from
        ``RECOMPUTED_MASK_MIN_KEYS`` keys), ``recomputed_mask_attention``,
        which makes each chunk's mask again in the backward rather than keep every
        chunk's weights and mask graph; with masks that need no gradient,
        ``chunked_flash_attention``. Sliced per chunk through autograd, q, k and v
        would each get a zero-filled full-size gradient per chunk."""
        if not queries_reversed and recomputed_mask_serves(q, k, v, mask_inputs):
            groups = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            return recomputed_mask_attention(q, k, v, spans, mask_of, self.scale, mask_inputs)
        parts = None if torch.compiler.is_compiling() else mask_parts  # eager mode only
        flash_serves = chunked_flash_serves(q, k, v, spans)
        if flash_serves and (mask_parts is not None or not _needs_grad(mask_of(*spans[0]))):
            groups = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            if parts is not None:
                mask_of = AssembledMasks(mask_of, parts, spans)
            return chunked_flash_attention(q, k, v, spans, mask_of, self.scale, queries_reversed)
        recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if parts is not None and not recorded:
            mask_of = AssembledMasks(mask_of, parts, spans)
        outs = []
        query_rows = sequence_slices(q, [(i0, i1) for i0, i1, _, _ in spans])
        key_rows = [(lo, hi) for _, _, lo, hi in spans]
        keys_and_values = sequence_slices(k, key_rows), sequence_slices(v, key_rows)
        chunks = zip(spans, query_rows, *keys_and_values, strict=True)
        for (i0, i1, lo, hi), rows, keys, values in chunks:
            rows = rows.flip(2) if queries_reversed else rows
            mask = mask_of(i0, i1, lo, hi)
            if every_row_reads and trained_mask_attention_serves(rows, mask):
                out = trained_mask_attention(rows, keys, values, mask, self.scale)
            else:
                out = scaled_dot_product(rows, keys, values, mask, self.scale)
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
        attn_mask: Tensor | None = None,
        query_documents: Tensor | None = None,
        bias: Tensor | None = None,
        spread: Tensor | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """Additive mask for SDPA: the (scaled) position bias with -inf where masked, plus
        the caller's ``attn_mask`` (``query_documents``: see ``attention_allowed``;
        ``bias``: the position bias at these positions where the caller has it), floored
        (``floored_bias``) where a ``spread`` [H, N, 1] is given (``_floor_spread``);
        written into ``out`` [1 or B, H, N, M] where given (no gradient then).

        Every mask joins before the floor, whose row maximum must be of the entries the
        row reads: with ``attn_mask`` added after it, a row whose largest entries the
        mask removed had every entry it reads lifted to the same floor (ALiBi with only
        keys 100 or more away: outputs off by 2.5)."""
        if bias is None:
            bias = self._position_bias(q_positions, k_positions, n, m, device)
        assert bias is not None  # has_position_bias
        # float64 inputs: the masks join a float64 bias (as they join eager's logits),
        # not one rounded to the parameters' float32
        bias = bias.to(torch.promote_types(bias.dtype, dtype))
        if self.position_bias_inside_scale:
            bias = bias * self.scale  # SDPA scales q.k only; this bias sits inside the scale
        allowed = attention_allowed(
            q_positions, k_positions, n, m, device, causal, window, document_ids, query_documents
        )
        mask = apply_masks(bias, allowed, attn_mask)
        into = None if out is None else out.view(mask.shape)  # [H, N, M] or [B, H, N, M]
        # the floor writes into ``out`` only where no cast follows: half precision takes
        # the bias shifted before its cast (``half_precision_bias``)
        floor_into = into if into is not None and into.dtype == mask.dtype else None
        if m and spread is not None:
            mask = floored_rows(mask, spread, floor_into)  # under each query row's largest
        mask = half_precision_bias(mask, dtype)
        if into is not None and mask is not into:
            mask = into.copy_(mask)
        # SDPA's CPU kernels take a 4-D mask directly; a 3-D one is ~3x slower (measured)
        return mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1 or B, H, N, M]


def _needs_grad(mask: Tensor | None) -> bool:
    """Whether a chunk's mask carries a gradient (a bias that trains)."""
    return mask is not None and mask.requires_grad
