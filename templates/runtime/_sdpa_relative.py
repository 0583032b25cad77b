"""The ``sdpa`` backend's relative terms: position terms that depend on q and k (Shaw et
al. 2018; BERT's relative_key and relative_key_query, Huang et al. 2020; DeBERTa's c2p and
p2c, He et al. 2021; Transformer-XL, Dai et al. 2019; CoPE, Golovneva et al. 2024) as
SDPA's mask, never an [B, H, N, M] tensor at once.

``SdpaRelative._sdpa_relative`` picks the route: CoPE's counted terms, in eager mode on
the CPU, as one node over query chunks (``_counted_positions``); terms clipped at a
distance on a band of keys with the far keys as plain flash attention
(``_clipped_relative``); a lone query-side term as a strided view of each chunk's own
projection (``_skewed_relative``); each chunk's terms gathered from projections over the
table rows; a decode step's terms from their factors (``_few_queries``); or the terms
per chunk of queries at their positions (explicit positions, masks, documents): without
autograd gathered from factors made once per call (``clipped_span_terms``,
``_ranged_relative``), in a CPU training step as one node over the chunks
(``_relative_at_positions``, ``_ranged_relative``), else dense.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._chunked_flash import Span, cpu_flash_serves
from ._clipped_relative import (
    TermsAtPositions,
    band_mask,
    band_terms,
    chunked_relative_attention,
    clipped_relative_attention,
    clipped_relative_serves,
    clipped_span_terms,
    projected_for_gathers,
    terms_train,
)
from ._counted_positions import (
    CountedChunks,
    counted_position_attention,
    counted_position_attention_serves,
    counting_order,
    keys_reordered,
)
from ._distances import half_precision_bias
from ._few_queries import (
    few_queries,
    few_query_inputs,
    few_query_inputs_at_positions,
    few_query_relative_serves,
)
from ._grouped_queries import (
    scaled_dot_product,
    scores_per_query_head,
    values_per_query_head,
)
from ._inputs import positions_or_default, repeat_kv
from ._masks import (
    apply_masks,
    attention_allowed,
    attn_mask_reads,
    attn_mask_span,
    block_fresh,
    causal_allowed,
    documents_joined,
    masked_softmax_,
    masked_softmax_in_place,
    pair_documents,
    query_chunks,
    reachable_query_chunks,
    relative_positions,
    same_document,
    sum_into_new,
)
from ._numerics import compute_dtype
from ._position_band import clipped_attention_at_positions
from ._ranged_relative import (
    ranged_attention_at_positions,
    ranged_diagonals,
    ranged_span_terms,
    span_distance_bounds,
)
from ._relative_at_positions import (
    SpanMasks,
    relative_attention_at_positions,
    relative_attention_at_positions_serves,
)
from ._sdpa_chunks import SdpaChunks
from ._skewed_relative import skewed_relative_attention, skewed_relative_serves
from ._terms import (
    RelativeFactors,
    lone_query_term,
    merged_factors,
    project_factors,
)

#: device types where relative terms under a window or documents are projected per
#: chunk of queries (each chunk its own diagonals) rather than over all N + M - 1
#: diagonals at once (``_sdpa_relative_parts``); measured on the CPU only
RELATIVE_CHUNK_DEVICES: set[str] = {"cpu"}


def relative_parts_serve(factors: list[RelativeFactors], causal: bool) -> bool:
    """Whether ``_sdpa_relative_parts`` runs these relative terms: everywhere but a
    causal training step without a key-side term. That one builds each query chunk's
    terms at its own positions instead: it projects only the chunk's queries, while the
    parts gather every chunk's terms over the widest chunk's keys (2-core CPU, float32,
    batch 2, 8 heads, N = 1024, against plain SDPA: BERT relative_key 3.30x per chunk
    against 4.05x from the parts, Transformer-XL 5.35x against 6.95x; with a key-side
    term, whose projection each chunk would redo, the parts won: BERT
    relative_key_query 6.9x -> 6.3x, DeBERTa 6.2x -> 5.4x)."""
    trains = terms_train(factors)
    return not (causal and trains and all(part.side != "key" for part in factors))


def counting_query_chunks(
    n: int,
    m: int,
    device_type: str,
    causal: bool,
    window: int | None,
    document_ids: Tensor | None,
    q_positions: Tensor | None,
    k_positions: Tensor | None,
    mask_row_bytes: int = 0,
) -> list[Span]:
    """``reachable_query_chunks`` for terms that count keys (CoPE: every key at or before
    a query's position in its document that its attn_mask lets it read, inside its
    window or not): each span reaches to the last key its queries count as well. A
    window, causal or not, can leave out of a span, at explicit positions, a key that
    its queries count (a later key at an earlier position, before the window); their
    counts then missed its gate."""
    spans = reachable_query_chunks(
        n, m, device_type, causal, window, document_ids, q_positions, k_positions, mask_row_bytes
    )
    if window is None:
        return spans  # the count reads no key the masks leave out of a span
    counted_spans = reachable_query_chunks(
        n, m, device_type, True, None, document_ids, q_positions, k_positions, mask_row_bytes
    )
    return [
        (i0, i1, lo, max(hi, counted[3]))
        for (i0, i1, lo, hi), counted in zip(spans, counted_spans, strict=True)
    ]


def span_masks(
    q_positions: Tensor,
    k_positions: Tensor,
    causal: bool,
    attn_mask: Tensor | None,
    window: int | None,
    documents: tuple[Tensor, Tensor] | None,
) -> SpanMasks:
    """(span, its terms) -> the terms with the span's masks joined (in place where the
    terms have the full shape): -inf where the causal mask or window forbids a pair by
    position, where packed documents differ or a bool ``attn_mask`` is False, plus a float
    one. Span (i0, i1, lo, hi): queries i0 .. i1 - 1 against keys lo .. hi - 1, in the
    order the keys' tensors hold them (``_sdpa_counted``'s: reversed); q_positions: [N]
    or [B, N]; k_positions: [M] or [B, M]; documents: the queries' and the keys'
    documents (``pair_documents``), or None."""
    n, m = q_positions.shape[-1], k_positions.shape[-1]

    def masked(span: Span, terms: Tensor) -> Tensor:
        i0, i1, lo, hi = span
        rows_at, keys_at = q_positions[..., i0:i1], k_positions[..., lo:hi]
        allowed = attention_allowed(
            rows_at, keys_at, i1 - i0, hi - lo, terms.device, causal, window, None
        )
        if allowed is not None:
            terms = block_fresh(terms, allowed)
        span_documents = None  # the span's queries' and keys' documents
        if documents is not None:
            span_documents = (documents[0][..., i0:i1], documents[1][..., lo:hi])
        mask = documents_joined(attn_mask_span(attn_mask, n, m, i0, i1, lo, hi), span_documents)
        return apply_masks(terms, None, mask)

    return masked


class SdpaRelative(SdpaChunks):
    """The ``sdpa`` backend's relative terms (see the module docstring)."""

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

        CoPE (``_counted_position_table``) as the only position term
        (``counted_terms_alone``: the node adds no bias, untied or global term), in
        eager mode on the CPU, past a decode step's queries and with no attn_mask that
        trains (``counted_position_attention_serves``): one node over chunks of queries
        (``_sdpa_counted``). Clipped terms at sorted explicit positions with no
        attn_mask, window, documents or position bias: the clipped path with its band
        found by position (``_clipped_at_positions``, CPU). Else at
        default positions, with no attn_mask or position bias, in this order: the
        clipped path (``clipped_relative_attention``, CPU); for more than a few queries
        and no value-side term, a lone query-side term as a strided view of each
        chunk's projection (``skewed_relative_attention``), else each query chunk's
        terms gathered from their projections over the table rows
        (``_sdpa_relative_parts``), but for terms read by distance with no clip under a
        window or documents, which go per chunk on the CPU (Transformer-XL, float32,
        N = 2048, batch 2, 8 heads, against plain SDPA: a window of 256, forward 4.96x
        -> 1.79x, training step 10.9x -> 1.29x; 4 documents, 4.32x -> 1.35x and 12.0x
        -> 1.12x; benchmarks/results/revisions_cpu_float32_unclipped_chunks_*.md), and
        for a training step under a window or documents, whose chunks then run as one
        node (``_trained_terms_at_positions``; BERT relative_key_query 5.57x -> 2.72x
        with a window of 256, 5.21x -> 2.33x with 4 documents, DeBERTa 3.48x -> 2.10x
        and 2.84x -> 1.63x; causal 4.58x -> 3.70x and 4.32x -> 3.34x, 3.09x -> 2.68x
        and 2.97x -> 2.65x; ``…_clipped_chunks_*.md``); a few
        queries read theirs from the factors
        (``few_query_inputs``), and so do a few queries at explicit positions of one
        row, where the terms are clipped or their distances span a short run
        (``_relative_factors_at_positions``, ``few_query_inputs_at_positions``).
        Otherwise the dense terms, with the queries in chunks
        (``reachable_query_chunks``) wherever positions are given, masks apply or
        documents are packed: each chunk at the positions of its queries and of the
        keys it may read (its documents' keys, and those its causal mask or window
        allows: by index at default positions, by position at explicit ones; for CoPE
        those its queries count too, ``counting_query_chunks``), so its terms span only
        those keys.
        """
        n, m = q.shape[2], k.shape[2]
        table = self._counted_position_table()
        mask_trains = attn_mask is not None and attn_mask.requires_grad
        mask_needs_no_grad = not (torch.is_grad_enabled() and mask_trains)
        if (
            table is not None
            and self.counted_terms_alone  # the node forms no other position term
            and documents is None  # a chunk's call of _sdpa_relative_in_chunks
            and counted_position_attention_serves(q, m, mask_needs_no_grad)
        ):
            return self._sdpa_counted(
                q, k, v, table, q_positions, k_positions, causal, attn_mask, window, document_ids
            )
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
        if (
            clipped is not None
            and not default
            and document_ids is None
            and attn_mask is None
            and window is None
            and not self.has_position_bias
            and clipped_relative_serves(q, m, clipped, self._trains_step(q, k, v))
        ):
            # sorted positions: the band and far keys found by position
            by_position = self._clipped_at_positions(q, k, v, q_positions, k_positions, causal)
            if by_position is not None:
                return by_position
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
            # under a window or documents: terms read by distance with no clip would be
            # projected over all N + M - 1 diagonals, where each chunk projects only its
            # own; a training step runs its chunks as one node (where the CPU flash
            # kernels take q: ``_trained_terms_at_positions``). RELATIVE_CHUNK_DEVICES.
            one_node = self._trains_step(q, k, v) and cpu_flash_serves(q, v)
            per_chunk = (
                not plain
                and q.device.type in RELATIVE_CHUNK_DEVICES
                and not torch.compiler.is_compiling()
                and (clipped is None or one_node)
            )
            if factors and relative_parts_serve(factors, causal) and not per_chunk:
                return self._sdpa_relative_parts(
                    q, k, heads_k, v, factors, causal, window, document_ids
                )
        given = q_positions is not None or k_positions is not None or attn_mask is not None
        if given or causal or window is not None or document_ids is not None:
            # the dense terms a chunk of queries at a time (each at its queries'
            # positions), so that no [B, H, N, M] terms exist at once: over the keys its
            # documents hold and only those its causal mask or window allow, by index at
            # default positions and by position at explicit ones (``position_spans``)
            chunks_of = reachable_query_chunks if table is None else counting_query_chunks
            spans = chunks_of(
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
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        factors, fresh, pairs = None, None, None
        if q_positions is None and k_positions is None and few_queries(n):
            # k with its own heads: a key-side term reads the keys of each query head's
            # key-value head, copying none out (``few_query_inputs``)
            factors = self._relative_factors(q, k, dtype, causal)
        elif few_queries(n) and _one_row(q_positions, k_positions):
            # at explicit positions: each pair's row, where the rows are few enough
            relative = relative_positions(q_positions, k_positions, n, m, q.device)  # [N, M]
            at_positions = self._relative_factors_at_positions(q, k, dtype, relative)
            if at_positions is not None:
                factors, pairs = at_positions
        if factors and few_query_relative_serves(factors, clipped):
            # a decode step: no key projected over every row; terms with one value per
            # key ride in q (``_few_queries``)
            if pairs is None:
                q, terms = few_query_inputs(q, factors, n, m, clipped, self.scale)
            else:
                q, terms = few_query_inputs_at_positions(q, factors, pairs, self.scale)
            parts = [] if terms is None else [terms]
            fresh = terms  # a new tensor (``few_query_inputs``): no copy of it is needed
        else:
            if documents is None:
                documents = pair_documents(document_ids, n, m)
            # k with its own heads: each term repeats the keys it reads per query head
            by_name = self._relative_terms(
                q, k, q_positions, k_positions, dtype, documents, attn_mask
            )
            parts = list(by_name.values())
        if self.has_position_bias:
            bias = self._position_bias(q_positions, k_positions, n, m, q.device)
            assert bias is not None  # has_position_bias
            bias = bias.to(dtype)
            if self.position_bias_inside_scale:
                bias = bias * self.scale
            parts.append(bias)
        if len(parts) == 1 and parts[0] is fresh:
            mask = parts[0]
        elif parts:
            mask = sum_into_new(parts)  # [B, H, N, M], a fresh tensor
        else:
            mask = torch.zeros((n, m), dtype=dtype, device=q.device)
        allowed = attention_allowed(
            q_positions, k_positions, n, m, q.device, causal, window, document_ids
        )
        if allowed is not None:
            mask = block_fresh(mask, allowed)
        mask = apply_masks(mask, None, attn_mask)
        default_positions = q_positions is None and k_positions is None
        packed = document_ids is not None or documents is not None
        reads = self._every_row_reads(default_positions, causal, window, packed, attn_mask)
        if self.has_value_term:
            # the value term needs the weights, which SDPA does not return: form them
            # once and apply them to v here as well (an SDPA call on top would double
            # the work: Shaw at N = 512 on the CPU ran 10.6x plain SDPA, eager 6.7x)
            # the scale on q [B, H, N, D], not on the [B, H, N, M] product (a full-size
            # pass forward and another backward)
            content = scores_per_query_head(q.to(dtype) * self.scale, k.to(dtype))
            if reads:  # no row with every key masked: the plain softmax
                weights = torch.softmax(content.add_(mask), dim=-1)  # [B, H, N, M]
            else:
                weights = masked_softmax_in_place(content + mask)  # [B, H, N, M]
            out = values_per_query_head(weights, v.to(dtype))
            return (out + self._value_term(weights, q_positions, k_positions)).to(v.dtype)
        # half precision takes the mask shifted by its row's largest (``half_precision_bias``):
        # cast as it is, Transformer-XL's terms near 75 lost 0.25 to bfloat16's rounding
        mask = half_precision_bias(mask, q.dtype)
        # grouped-query heads as they are: a decode step's few queries take the batched
        # matmuls (``scaled_dot_product``), where before every cached key and value was
        # copied out per query head (one query, 4033-4096 keys, 8 heads on 2 key-value
        # heads, 2-core CPU: Transformer-XL 3.79x -> 2.51x plain SDPA, BERT relative_key
        # 5.12x -> 2.83x; revisions_cpu_float32_decode_grouped_relative.md)
        out = scaled_dot_product(q, k, v, mask, self.scale, every_row_reads=reads)
        return out.to(v.dtype)

    def _clipped_at_positions(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
    ) -> Tensor | None:
        """``clipped_relative_attention`` at explicit positions, its band and far keys
        found by position (``position_layout``), where the positions are sorted; else
        None. Before, each chunk of queries had its terms gathered per pair over every
        key it may read."""
        groups = q.shape[1] // k.shape[1]
        heads_k, heads_v = repeat_kv(k, groups), repeat_kv(v, groups)
        factors = self._clipped_relative_factors(q, heads_k, compute_dtype(q))
        clip = self.relative_clip
        if not factors or clip is None:
            return None
        value_term = self._value_term if self.has_value_term else None
        return clipped_attention_at_positions(
            q,
            heads_k,
            heads_v,
            factors,
            q_positions,
            k_positions,
            clip,
            self.scale,
            causal,
            value_term,
        )

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
        # the defaults: the queries are the last N of the keys 0 .. M - 1
        q_positions = positions_or_default(q_positions, m - n, n, q.device)
        k_positions = positions_or_default(k_positions, 0, m, q.device)
        masked = span_masks(
            q_positions, k_positions, causal, attn_mask, window, pair_documents(document_ids, n, m)
        )
        # no autograd here: each chunk's terms are gathered into buffers the chunks reuse
        at_positions = self._terms_at_positions(q, k, v, attn_mask, spans, q_positions, k_positions)
        if at_positions is None:
            trained = self._trained_terms_at_positions(
                q, k, v, spans, q_positions, k_positions, causal, attn_mask, masked
            )
            if trained is not None:
                return trained
        outs = []
        for i0, i1, lo, hi in spans:
            if at_positions is not None:
                rows_at, keys_at = q_positions[..., i0:i1], k_positions[..., lo:hi]
                # [B or 1, H, rows, keys], valid until the next chunk's
                terms = at_positions((i0, i1, lo, hi), rows_at, keys_at)
                terms = half_precision_bias(masked((i0, i1, lo, hi), terms), q.dtype)
                if self.has_value_term:
                    # the value term reads the weights, which SDPA does not return
                    weights = self._chunk_weights(q, k, (i0, i1, lo, hi), terms)
                    values = repeat_kv(v[:, :, lo:hi], q.shape[1] // v.shape[1])
                    out = torch.matmul(weights, values.to(weights.dtype))  # [B, H, r, value_dim]
                    out += self._value_term(weights, rows_at, keys_at)
                    outs.append(out.to(v.dtype))
                    continue
                rows, keys, values = q[:, :, i0:i1], k[:, :, lo:hi], v[:, :, lo:hi]
                outs.append(scaled_dot_product(rows, keys, values, terms, self.scale))
                continue
            documents = None  # the chunk's queries' and keys' documents
            if document_ids is not None:
                rows_documents = document_ids[..., m - n + i0 : m - n + i1]
                documents = (rows_documents, document_ids[..., lo:hi])
            mask = documents_joined(attn_mask_span(attn_mask, n, m, i0, i1, lo, hi), documents)
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

    def _sdpa_counted(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        table: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
        attn_mask: Tensor | None,
        window: int | None,
        document_ids: Tensor | None,
    ) -> Tensor:
        """CoPE's attention as one node over chunks of queries, keys in reversed order
        (``counted_position_attention``): each chunk over the keys it may read or count
        (a key is counted where it is at or before the query's position, in its
        document, and ``attn_mask`` lets the query read it), so that its counts are
        exact -> [B, H, N, value_dim].

        The count takes the keys in position order (``counting_order``): at explicit
        positions stored otherwise within a document (a ring buffer's cache), the keys,
        values, their positions, documents and attn_mask columns are reordered by
        position first, reversed in the same copy (the softmax is blind to the key
        order), and the chunks are then not narrowed to their documents' keys."""
        n, m = q.shape[2], k.shape[2]
        dtype = compute_dtype(q)
        heads = q.shape[1]
        documents = pair_documents(document_ids, n, m)
        order = None if k_positions is None else counting_order(k_positions, documents)
        if order is not None:  # the positions in order, for the spans
            assert k_positions is not None
            k_positions = keys_reordered(k_positions.reshape(-1, m), order, 1)
            document_ids = None  # the spans keep every key; the masks hold the documents
        row_bytes = q.shape[0] * heads * m * dtype.itemsize  # one query's row of a buffer
        spans = counting_query_chunks(
            n, m, "cpu", causal, window, document_ids, q_positions, k_positions, row_bytes
        )
        q_positions = positions_or_default(q_positions, m - n, n, q.device)
        # the keys reversed (the latest first), in the count's order: their positions,
        # documents and attn_mask columns too
        reversed_order = None if order is None else order.flip(-1)  # of the keys as given

        def reversed_keys(t: Tensor, dim: int) -> Tensor:
            """t as given, its keys along ``dim`` reversed in the count's order."""
            if reversed_order is None:
                return t.flip(dim)
            return keys_reordered(t, reversed_order, dim)

        # (the positions, put in order above, reversed alone)
        reversed_positions = positions_or_default(k_positions, 0, m, q.device).flip(-1)
        if documents is not None:
            documents = (documents[0], reversed_keys(documents[1].reshape(-1, m), 1))
        if attn_mask is not None and attn_mask.shape[-1] == m:
            four_dims = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
            attn_mask = reversed_keys(four_dims, 3)
        masked = span_masks(q_positions, reversed_positions, causal, attn_mask, window, documents)

        def counted(span: Span) -> Tensor:
            i0, i1, lo, hi = span
            rows_at, keys_at = q_positions[..., i0:i1], reversed_positions[..., lo:hi]
            allowed = causal_allowed(rows_at, keys_at, i1 - i0, hi - lo, q.device)
            if documents is not None:
                span_documents = (documents[0][..., i0:i1], documents[1][..., lo:hi])
                allowed = allowed & same_document(span_documents)
            span_mask = attn_mask_span(attn_mask, n, m, *span)
            if span_mask is not None:  # a key the mask hides from the query counts 0
                allowed = allowed & attn_mask_reads(span_mask)
            return allowed  # [r, w], [B, 1, r, w], or as the mask broadcasts: [B, H, r, w]

        # the spans over the reversed keys: keys lo .. hi - 1 are m - hi .. m - lo - 1 there
        reversed_spans = [(i0, i1, m - hi, m - lo) for i0, i1, lo, hi in spans]
        chunks = CountedChunks(reversed_spans, masked, counted, self.scale)
        groups = heads // k.shape[1]
        keys = reversed_keys(repeat_kv(k.to(dtype), groups), 2)  # [B, H, M, D], the latest first
        values = reversed_keys(repeat_kv(v.to(dtype), groups), 2)
        out = counted_position_attention(q.to(dtype), keys, values, table.to(dtype), chunks)
        return out.to(v.dtype)

    def _chunk_weights(self, q: Tensor, k: Tensor, span: Span, terms: Tensor) -> Tensor:
        """softmax(scale q kᵀ + terms) of the span's (i0, i1, lo, hi) queries and keys
        without autograd, formed in place in ``terms`` ([B or 1, H, r, w], masked; in a
        copy where it is not a whole tensor of the compute dtype): [B, H, r, w]. Before,
        a chunk's logits, their masking and its softmax were each a fresh tensor (Shaw at
        explicit positions: 9x plain SDPA, 2-core CPU, 8 heads, N = 2048)."""
        i0, i1, lo, hi = span
        dtype = compute_dtype(q)
        batch, heads, rows, width = q.shape[0], q.shape[1], i1 - i0, hi - lo
        logits = terms.to(dtype)
        if logits.shape != (batch, heads, rows, width) or not logits.is_contiguous():
            logits = logits.expand(batch, heads, rows, width).contiguous()
        queries = q[:, :, i0:i1].to(dtype).reshape(batch * heads, rows, -1)  # [B * H, r, D]
        keys = repeat_kv(k[:, :, lo:hi], heads // k.shape[1]).to(dtype)  # [B, H, w, D]
        keys = keys.reshape(batch * heads, width, -1).transpose(1, 2)  # [B * H, D, w]
        logits.view(batch * heads, rows, width).baddbmm_(queries, keys, alpha=self.scale)
        return masked_softmax_(logits)

    def _terms_at_positions(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        spans: list[Span],
        q_positions: Tensor,
        k_positions: Tensor,
    ) -> TermsAtPositions | None:
        """The relative terms of each span of ``_sdpa_relative_in_chunks`` at its
        positions, from factors made once per call, where they serve: eager mode with no
        gradient and no position bias; else None (each chunk then builds its terms at
        its positions). Each chunk used to project every key it reads again. None too
        where there are no factors (a relative value-side term with no relative logit
        term).

        Terms clipped at K = ``relative_clip`` (``clipped_span_terms``) read the 2K + 1
        rows of their table at every position (``_clipped_relative_factors``). 2-core
        CPU, float32, N = 2048, batch 2, 8 heads, positions 2 apart, against plain SDPA
        in one loop: DeBERTa 8.66x -> 4.98x (causal 7.72x -> 4.92x), BERT
        relative_key_query 12.6x -> 6.04x (10.3x -> 6.36x), BERT relative_key 3.75x ->
        3.44x (no key side: within noise causal)
        (benchmarks/results/revisions_cpu_float32_relative_at_positions.md).

        Terms read by distance with no clip (``ranged_span_terms``) have factors made
        over every distance the spans reach (``ranged_diagonals``), where those are few
        enough; each span projects only the rows it reads."""
        if self.has_position_bias:
            return None
        trains = self._trains_step(q, k, v) or not self._masks_need_no_grad(attn_mask)
        if trains or torch.compiler.is_compiling():
            return None
        heads_k = repeat_kv(k, q.shape[1] // k.shape[1])  # the terms read every head
        dtype = compute_dtype(q)
        clip = self.relative_clip
        if clip is not None:
            clipped = self._clipped_relative_factors(q, heads_k, dtype)
            # none (a value-side term alone): nothing to gather, the chunks' own path
            # serves (``clipped_span_terms`` of no factors has no batch or heads)
            return clipped_span_terms(clipped, clip, spans) if clipped else None
        bounds = span_distance_bounds(spans, q_positions, k_positions)
        diagonals = ranged_diagonals(bounds, q.shape[2], k.shape[2])
        if diagonals is None:
            return None
        factors = self._relative_factors(q, heads_k, dtype, diagonals=diagonals)
        if not factors:
            return None
        return ranged_span_terms(merged_factors(factors), diagonals, bounds, spans)

    def _trained_terms_at_positions(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        spans: list[Span],
        q_positions: Tensor,
        k_positions: Tensor,
        causal: bool,
        attn_mask: Tensor | None,
        masked: SpanMasks,
    ) -> Tensor | None:
        """A training step of ``_sdpa_relative_in_chunks`` with terms clipped at a
        distance as one autograd node over the spans (``relative_attention_at_positions``)
        where it serves: the CPU flash kernels (``cpu_flash_serves``), query- and
        key-side terms only, no value-side term or position bias, an ``attn_mask`` that
        needs no gradient, and not causal without a key-side term
        (``relative_parts_serve``: there each chunk's own terms project only its
        queries, over the few keys it reads); else None. ``masked``: a span's terms with
        its masks joined (``span_masks``) -> [B, H, N, value_dim]."""
        if self.has_value_term or self.has_position_bias or not self._trains_step(q, k, v):
            return None  # without autograd ``_terms_at_positions`` had its say
        if not cpu_flash_serves(q, v) or (attn_mask is not None and attn_mask.requires_grad):
            return None
        groups = q.shape[1] // k.shape[1]
        heads_k, heads_v = repeat_kv(k, groups), repeat_kv(v, groups)  # every head reads
        clip = self.relative_clip
        if clip is None:
            return self._trained_ranged_terms(
                q, heads_k, heads_v, spans, q_positions, k_positions, masked
            )
        factors = self._clipped_relative_factors(q, heads_k, compute_dtype(q))
        if factors is None or not relative_parts_serve(factors, causal):
            return None
        if not relative_attention_at_positions_serves(factors):
            return None
        parts = [projected_for_gathers(factor) for factor in factors]
        out = relative_attention_at_positions(
            q, heads_k, heads_v, parts, clip, spans, q_positions, k_positions, masked, self.scale
        )
        return out.to(v.dtype)

    def _trained_ranged_terms(
        self,
        q: Tensor,
        heads_k: Tensor,
        heads_v: Tensor,
        spans: list[Span],
        q_positions: Tensor,
        k_positions: Tensor,
        masked: SpanMasks,
    ) -> Tensor | None:
        """``_trained_terms_at_positions`` for terms read by distance with no clip: one
        node over the spans, each projecting its queries over the rows its pairs read
        (``ranged_attention_at_positions``), where the spans reach few enough distances
        (``ranged_diagonals``) and the terms are one query-side term and terms of one
        value per key (``lone_query_term``); else None. heads_k, heads_v: k and
        v with q's heads. Before, each span built its terms at its positions through
        autograd: Transformer-XL's training step at positions 2 apart ran 7.8x plain
        SDPA's (2-core CPU, float32, N = 2048, batch 2, 8 heads)."""
        bounds = span_distance_bounds(spans, q_positions, k_positions)
        diagonals = ranged_diagonals(bounds, q.shape[2], heads_k.shape[2])
        if diagonals is None:
            return None
        factors = self._relative_factors(q, heads_k, compute_dtype(q), diagonals=diagonals)
        if not factors:
            return None
        factors = merged_factors(factors)
        if not lone_query_term(factors):
            return None
        out = ranged_attention_at_positions(
            q,
            heads_k,
            heads_v,
            factors,
            diagonals,
            bounds,
            spans,
            q_positions,
            k_positions,
            masked,
            self.scale,
        )
        return out.to(heads_v.dtype)

    def _sdpa_relative_parts(
        self,
        q: Tensor,
        k: Tensor,
        heads_k: Tensor,
        v: Tensor,
        factors: list[RelativeFactors],
        causal: bool,
        window: int | None,
        document_ids: Tensor | None,
    ) -> Tensor:
        """SDPA at default positions with the relative terms of ``factors`` (merged)
        gathered per query chunk (``query_chunks``) over the keys it may read from their
        projections, as its mask. heads_k: k with q's heads (k itself without
        grouped-query heads)."""
        n, m = q.shape[2], k.shape[2]
        allowed = attention_allowed(None, None, n, m, q.device, False, window, document_ids)
        spans = reachable_query_chunks(
            n, m, q.device.type, causal, window, document_ids, None, None
        )
        if allowed is None and cpu_flash_serves(q, v):
            # flash calls per chunk, the terms' gradient without a full-size one per chunk
            heads_v = repeat_kv(v, q.shape[1] // v.shape[1])
            out = chunked_relative_attention(
                q, heads_k, heads_v, factors, spans, self.scale, causal
            )
            return out.to(v.dtype)
        span_of: Callable[[Span], Tensor]
        recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if recorded or terms_train(factors):
            # each chunk's terms from projections of every query, fresh tensors (a
            # chunk's SDPA call through autograd keeps its mask for the backward)
            parts = [project_factors(factor) for factor in factors]

            def span_of(span: Span) -> Tensor:
                return band_terms(parts, n, m, [span], causal)[..., : span[3] - span[2]]

        else:
            span_of = band_mask(factors, n, m, spans, causal)[0]  # views or gathers

        def chunk_terms(i0: int, i1: int, lo: int, hi: int) -> Tensor:
            terms = span_of((i0, i1, lo, hi))
            if allowed is not None:  # a window or documents
                terms = block_fresh(terms, allowed[..., i0:i1, lo:hi])
            return half_precision_bias(terms, q.dtype)

        return self._sdpa_in_chunks(q, k, v, spans, chunk_terms).to(v.dtype)


def _one_row(q_positions: Tensor | None, k_positions: Tensor | None) -> bool:
    """Whether the positions given are one row for every batch row (1-D), or left out."""
    return all(t is None or t.dim() == 1 for t in (q_positions, k_positions))
