"""The ``sdpa`` backend: F.scaled_dot_product_attention with the position terms as an
additive mask.

A bias of j - i alone at default positions is a strided view of its per-distance
vector (O(N + M) memory; ``_distances``); other biases are built per chunk of queries
(``_sdpa_chunks``), relative terms take ``_sdpa_relative``'s routes, and a trained bias
on the CPU avoids SDPA's math kernel (``_trained_bias``, ``_directional_bias``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._bounded import bounded_read_tensors
from ._chunked_flash import unit_rows
from ._clipped_relative import clipped_relative_serves
from ._directional_bias import directional_bias_attention, directional_bias_serves
from ._distances import (
    bias_floor_serves,
    content_spread,
    distance_chunk_view,
    distance_chunk_views,
    expand_distance_bias,
    floor_moves_nothing,
    floored_bias,
    floored_rows,
    half_precision_bias,
    kept_row_is_shallow,
    rows_clear_floor,
)
from ._grouped_queries import (
    few_query_matmuls_serve,
    grouped_query_attention,
    scaled_dot_product,
)
from ._inputs import (
    Rotated,
    repeat_kv,
)
from ._masks import (
    apply_masks,
    attention_allowed,
    attn_mask_span,
    bias_with_attn_mask,
    distance_allowed,
    document_chunks_serve,
    key_span,
    mask_chunk_rows,
    query_chunks,
    reachable_query_chunks,
)
from ._numerics import autocast_dtype, autocast_off, compute_dtype
from ._position_band import clipped_attention_at_positions, clipped_bias_factors
from ._sdpa_relative import SdpaRelative
from ._trained_bias import (
    clipped_bias_attention,
    clipped_bias_attention_serves,
)

#: device types where a position-only term that is a product of position rows (TUPE-A's
#: untied term) folds into extra features of q and k unless the module's ``fold_bias``
#: says otherwise: CUDA, where SDPA then takes its flash kernel with no bias; on a
#: 2-core CPU TUPE-A at N = 512 ran 5.9x no-bias SDPA folded, 4.4x with a mask
FOLDED_BIAS_DEVICES: set[str] = {"cuda"}


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


def flush_instead_of_floor(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a few queries with a position bias run as ``grouped_query_attention``'s
    matmuls, which flush denormal weights, in place of SDPA with the bias floored: where
    the matmuls can run (``few_query_matmuls_serve``) and the device floors a bias at
    all (``bias_floor_serves``). Elsewhere SDPA takes the bias as it is, one call where
    the matmuls make about a dozen (one query of 8 heads against 64 keys on a 2-core
    AMD EPYC, whose denormal arithmetic runs at full speed: 12 us against 31 us)."""
    return bias_floor_serves(q.device, q.dtype) and few_query_matmuls_serve(q, k, v)


class SdpaBackend(SdpaRelative):
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
        masked = causal or window is not None or attn_mask is not None or document_ids is not None
        if not (masked or self.has_relative_terms or self.has_position_bias):
            # nothing but content in the logits (rotated already, or positions at the
            # input) and no mask: plain attention, past the branches below (about 10 us
            # of a decode step's Python on a 2-core CPU)
            return scaled_dot_product(q, k, v, None, self.scale)
        if self.has_relative_terms:
            # with autocast off, as flex and eager run them: the terms are logits, and
            # their paths' own products in bfloat16 moved Shaw's outputs by 1.5e-2 (2.6x
            # the error of bfloat16 inputs); the caller casts to autocast's dtype
            with autocast_off(q.device.type):
                return self._sdpa_relative(
                    q, k, v, q_positions, k_positions, causal, attn_mask, window, document_ids
                )
        default_positions = q_positions is None and k_positions is None
        if window is not None and q.shape[2] == 1 and default_positions and document_ids is None:
            k, v, attn_mask, window = self._window_keys_of_one_query(k, v, attn_mask, window)
        n, m = q.shape[2], k.shape[2]
        has_bias = self.has_position_bias
        if self.folds_position_bias and self._folds_here(q):
            v = repeat_kv(v, q.shape[1] // v.shape[1])
            q, k = self._fold_position_bias(q, k, q_positions, k_positions)
            has_bias = False  # now inside q' . k'
        # a window folds into the per-distance vector (it depends on j - i alone); the
        # documents do not, so they take the materialised bias below, and nor does an
        # attn_mask, but for one query (its row of the vector)
        by_distance = default_positions and document_ids is None
        if self.bias_by_distance and by_distance and (attn_mask is None or n == 1):
            return self._sdpa_by_distance(q, k, v, causal, window, attn_mask)
        by_distance = by_distance and attn_mask is None
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
        plain = window is None and document_ids is None and attn_mask is None
        if has_bias and not default_positions and plain:
            # a bias clipped at a distance at sorted positions: the far keys as flash
            # attention, the bias read per pair only on the band between them
            by_position = self._clipped_bias_at_positions(q, k, v, q_positions, k_positions, causal)
            if by_position is not None:
                return by_position
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
            # a few queries on the CPU: matmuls that flush denormal weights, so no floor
            matmuls = flush_instead_of_floor(q, k, v)
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
                spread=None if matmuls else self._floor_spread(q, k),
            )
            packed = document_ids is not None
            reads = self._every_row_reads(default_positions, causal, window, packed, attn_mask)
            if matmuls:
                return grouped_query_attention(q, k, v, bias, self.scale, every_row_reads=reads)
            return scaled_dot_product(q, k, v, bias, self.scale, every_row_reads=reads)
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

    def _clipped_bias_at_positions(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        causal: bool,
    ) -> Tensor | None:
        """A bias clipped at a distance (``clipped_distance``: T5's buckets) at explicit,
        sorted positions as the clipped path's one relative term
        (``clipped_bias_factors``, ``position_layout``): each chunk's keys at least the
        clip before or after its queries run as plain flash attention, with the bias's
        end entry added to their log-sum-exp, and only the band between them reads the
        bias per pair. None where it does not serve (``clipped_relative_serves``, or
        ``position_layout``'s rule); before, every chunk read the bias per pair over
        every key it may read."""
        clip = self.clipped_distance
        if clip is None or not clipped_relative_serves(
            q, k.shape[2], clip, self._trains_step(q, k, v)
        ):
            return None
        clipped = self._clipped_distance_bias(q.device).to(compute_dtype(q))  # [H, 2K + 1]
        if self.position_bias_inside_scale:
            clipped = clipped * self.scale
        factors = clipped_bias_factors(clipped)
        groups = q.shape[1] // k.shape[1]
        heads_k, heads_v = repeat_kv(k, groups), repeat_kv(v, groups)
        return clipped_attention_at_positions(
            q, heads_k, heads_v, factors, q_positions, k_positions, clip, self.scale, causal
        )

    def _folds_here(self, q: Tensor) -> bool:
        """Whether a position-only term folds into q and k on this call: ``fold_bias``
        where set, else where FOLDED_BIAS_DEVICES lists q's device."""
        return (
            self.fold_bias if self.fold_bias is not None else q.device.type in FOLDED_BIAS_DEVICES
        )

    def _window_keys_of_one_query(
        self, k: Tensor, v: Tensor, attn_mask: Tensor | None, window: int
    ) -> tuple[Tensor, Tensor, Tensor | None, int | None]:
        """k, v and attn_mask narrowed to the keys that one query at the default position
        M - 1 reads through ``window`` (a decode step's sliding window: the last
        ``window`` keys, with or without ``causal``), and the window then left (None),
        where the narrowed keys can stand at default positions themselves: every
        position term in the logits depends on j - i alone (a bias by distance, or
        none; q and k are rotated already). Elsewhere all four as given.

        Without it a window of 256 of 512 cached keys cost a mask over every key: about
        35 us more than plain SDPA over all of them on a 2-core CPU, where the narrowed
        call reads half the keys."""
        if self.has_position_bias and not self.bias_by_distance:
            return k, v, attn_mask, window
        m = k.shape[2]
        lo, hi = key_span(0, 1, 1, m, False, window)  # [M - window, M): M - 1 - j < window
        attn_mask = attn_mask_span(attn_mask, 1, m, 0, 1, lo, hi)
        return k[:, :, lo:hi], v[:, :, lo:hi], attn_mask, None

    def _sdpa_by_distance(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        window: int | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """SDPA with a bias of j - i alone, never an [H, N, M] tensor: O(N + M) memory.

        The bias per distance [H, N + M - 1] (causal and window masking folded in as -inf
        on the distances they exclude, ``distance_allowed``) is viewed as [1, H, N, M]
        with the queries reversed (``query_reversed_bias``); q goes in reversed and the
        output comes back in order. ``attn_mask`` (one query only, as
        ``check_attn_mask`` returns it) joins the query's row of the vector.
        """
        n, m = q.shape[2], k.shape[2]
        if attn_mask is None:
            out = self._trained_distance_attention(q, k, v, causal, window)
            if out is not None:
                return out
        vec = self._scaled_distance_bias(n, m, q.device)  # [H, N + M - 1]
        spread, flushed = self._distance_floor_or_flush(q, k, v, vec)
        if attn_mask is not None:  # it may hide distance 0, the entry the floor sits under
            spread = None
        full = _distances_masked(_floored_distances(vec, m, spread), n, m, causal, window)
        if self.distance_bias_at_most_zero:  # the shift would be 0: every row reads r = 0
            vec = full if full.dtype == q.dtype else full.to(q.dtype)  # [H, N + M - 1]
        else:
            vec = half_precision_bias(full, q.dtype)  # [H, N + M - 1]
        # no mask removes distance 0, so with a finite entry there every row reads a key
        # (an expression's -inf needs the fully-masked-row care)
        reads = self._every_row_reads(True, causal, window, False, attn_mask)
        if flushed or n == 1:  # a few queries, a decode step: their rows as one mask
            rows = full if attn_mask is not None else vec  # [H, N + M - 1]
            mask = rows[None, :, None, :] if n == 1 else expand_distance_bias(rows, n, m)[None]
            if attn_mask is not None:  # shifted by the largest entry each row reads
                mask = half_precision_bias(bias_with_attn_mask(mask, attn_mask), q.dtype)
            if flushed:  # [B or 1, H, N, M], in query order
                return grouped_query_attention(q, k, v, mask, self.scale, every_row_reads=reads)
            return scaled_dot_product(q, k, v, mask, self.scale, every_row_reads=reads)
        if not (causal or window is not None or vec.requires_grad):
            spans = [(0, n, 0, m)]  # nothing to skip: one call over every key
        else:  # views of the vector, but a trained one's chunks get scores of their own
            trained = vec.requires_grad
            spans = query_chunks(n, m, q.device.type, causal, window, views=not trained)

        chunk_views = distance_chunk_views(vec, n)  # [1, H, rows, keys] per span
        return self._sdpa_in_chunks(
            q, k, v, spans, chunk_views, queries_reversed=True, every_row_reads=reads
        )

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
        if not torch.is_grad_enabled():  # both routes are training steps
            return None
        n, m = q.shape[2], k.shape[2]
        groups = q.shape[1] // k.shape[1]
        parameters = tuple(getattr(self, name) for name in self.distance_bias_parameters)
        if directional_bias_serves(q, v, window, causal, parameters):
            with torch.no_grad():  # the floor's spread is detached
                spread = self._distance_floor_spread(
                    q, k, self._scaled_distance_bias(n, m, q.device)
                )

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
        """The bias per distance for default positions as SDPA adds it, [H, N + M - 1]:
        scaled (``_scaled_distance_bias``), floored where a ``spread`` [H, 1] is given
        (``_distance_floor_spread``) and -inf on the distances that causal or window
        masking excludes (``distance_allowed``)."""
        vec = _floored_distances(self._scaled_distance_bias(n, m, device), m, spread)
        return _distances_masked(vec, n, m, causal, window)

    def _scaled_distance_bias(self, n: int, m: int, device: torch.device) -> Tensor:
        """The bias per distance for default positions, scaled where it sits inside the
        scale (SDPA scales q . k only): [H, N + M - 1]."""
        vec = self._distance_bias(n, m, device)  # [H, N + M - 1]
        return vec * self.scale if self.position_bias_inside_scale else vec

    def _distance_floor_or_flush(
        self, q: Tensor, k: Tensor, v: Tensor, vec: Tensor
    ) -> tuple[Tensor | None, bool]:
        """(spread, flushed) for the per-distance vector ``vec`` [H, N + M - 1]: a few
        queries run as ``grouped_query_attention``'s matmuls (flushed) where they can
        (``few_query_matmuls_serve``, the CPU), which flush denormal weights themselves,
        so the vector takes no floor: one query unless its row is a slice of a kept
        vector known to lie within the floor (``kept_row_is_shallow``: T5's or KERPLE's
        inside a ``parameters_frozen`` block, ALiBi's over its first 80 keys), which
        SDPA takes as it is, more queries where SDPA would need the floor
        (``_distance_floor_due``). Otherwise the floor's spread, or None, and SDPA.

        With SDPA the floor reads every cached key once more for its bound
        (``content_spread``) and takes about 30 small operations: ALiBi's decode step on
        a 2-core x86 CPU (batch 1, 8 heads, 500 cached keys, float32) took about 5x
        plain SDPA with it. A shallow bias (T5's) skips the bound, but a read back
        decides that (``floor_moves_nothing``, about 20 us), where the matmuls of one
        query take 1.1-1.3x SDPA's time at 500 keys and 0.95x at 4096. Four queries'
        matmuls took 1.04-1.07x SDPA's time with T5's vector at 4096 keys, so from two
        queries on a shallow vector keeps SDPA. Where no floor is ever due (the device
        is not in ``BIAS_FLOOR_DEVICES``), SDPA takes the vector as it is."""
        matmuls = flush_instead_of_floor(q, k, v)
        if matmuls and q.shape[2] == 1:
            # a kept vector known to lie within the floor needs no flushing either
            return None, not kept_row_is_shallow(vec, k.shape[2])
        if not self._distance_floor_due(q, k, vec):
            return None, False
        if matmuls:
            return None, True
        return self._spread_per_head(q, k), False

    def _distance_floor_due(self, q: Tensor, k: Tensor, vec: Tensor) -> bool:
        """Whether SDPA needs the per-distance vector ``vec`` [H, N + M - 1] floored: on
        ``BIAS_FLOOR_DEVICES``, where the floor would move an entry
        (``floor_moves_nothing``: every entry within ``BIAS_FLOOR`` of the entry at
        distance 0, the floor's top, so that shallow biases (T5's, KERPLE's) skip the
        bound's pass over the keys, which in a decode step reads the whole cache once
        more). One query's row of a kept vector is told without a read
        (``kept_row_is_shallow``)."""
        m = k.shape[2]
        if not bias_floor_serves(q.device, q.dtype) or q.shape[2] == 0:
            return False
        if q.shape[2] == 1 and kept_row_is_shallow(vec, m):  # known without a read
            return False
        return not floor_moves_nothing(vec, vec[:, m - 1 : m])

    def _distance_floor_spread(self, q: Tensor, k: Tensor, vec: Tensor) -> Tensor | None:
        """The spread [H, 1] the per-distance vector ``vec`` [H, N + M - 1] (as SDPA adds
        it) is floored with (``_floored_distances``), or None where no floor is due
        (``_distance_floor_due``)."""
        if not self._distance_floor_due(q, k, vec):
            return None
        return self._spread_per_head(q, k)

    def _spread_per_head(self, q: Tensor, k: Tensor) -> Tensor:
        """The floor's spread for the per-distance vector, [H, 1]: every query reads
        distance 0 and one floor per head serves them all, so the spread is the head's
        largest over its queries (``content_spread``)."""
        return content_spread(q, k, self.scale).amax(dim=1)

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

        # values read through clamp_toward_range, made once in the call's graph for every
        # chunk's mask (BoundedReads); eager mode, with a gradient
        reads: dict[Any, Any] = {}
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            reads = self._bounded_reads(q.device)

        def chunk_mask(i0: int, i1: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
            # (no reads, no state set on the module: nothing for torch.compile to trace)
            with self.sharing_bounded_reads(reads) if reads else contextlib.nullcontext():
                return chunk_mask_of_reads(i0, i1, lo, hi, out)

        def chunk_mask_of_reads(
            i0: int, i1: int, lo: int, hi: int, out: Tensor | None = None
        ) -> Tensor:
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

        # what the masks are built from that may train: the module's parameters (those
        # under the shared reads through the reads) and a float attn_mask
        under_reads = {id(p) for p in self._bounded_parameters()} if reads else set()
        inputs: list[Tensor] = [
            p for p in self.parameters() if p.requires_grad and id(p) not in under_reads
        ]
        inputs += bounded_read_tensors(reads)
        if attn_mask is not None and attn_mask.requires_grad:
            inputs.append(attn_mask)
        every_row_reads = default and attn_mask is None and self.position_bias_finite
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
        keys 100 or more away: outputs off by 2.5). A bias whose rows clear their floor
        before masks that only remove entries (``rows_clear_floor``) is not floored."""
        if bias is None:
            # with autocast off, as ``score_terms`` builds the eager terms: a bias that a
            # network makes (FIRE's MLP, TUPE's projections) in float32, not in bfloat16
            with autocast_off(device.type):
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
        joins_infinities = allowed is not None or attn_mask is not None
        removes_only = attn_mask is None or attn_mask.dtype == torch.bool
        needs_own_check = joins_infinities or (torch.is_grad_enabled() and bias.requires_grad)
        if m and spread is not None and removes_only and needs_own_check:
            # floored_rows reads only the masked bias's rows, and a grad-mode floor no rows
            spread = None if rows_clear_floor(bias, spread) else spread
        if _masked_in_one_pass(bias, allowed, attn_mask, spread, out, dtype):
            assert out is not None and allowed is not None
            # one select into ``out``, where a fill and a copy were two passes
            masked = bias.new_full((), float("-inf"))  # where's out= form takes no scalar
            mask = torch.where(allowed, bias, masked, out=out.view(bias.shape))
            return mask.unsqueeze(0) if mask.dim() == 3 else mask  # [1 or B, H, N, M]
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


def _masked_in_one_pass(
    bias: Tensor,
    allowed: Tensor | None,
    attn_mask: Tensor | None,
    spread: Tensor | None,
    out: Tensor | None,
    dtype: torch.dtype,
) -> bool:
    """Whether ``_sdpa_bias`` writes the bias with -inf where ``allowed`` is False into
    ``out`` as one select: a mask by position to join and nothing else (no attn_mask,
    no floor, no cast, no shift for autocast's half precision), and an ``out`` of bias's
    dtype and shape."""
    if out is None or allowed is None or attn_mask is not None or spread is not None:
        return False
    if not (bias.dtype == out.dtype == dtype == autocast_dtype(dtype, out.device.type)):
        return False
    if out.numel() != bias.numel():
        return False
    return torch.broadcast_shapes(bias.shape, allowed.shape) == bias.shape


def _distances_masked(vec: Tensor, n: int, m: int, causal: bool, window: int | None) -> Tensor:
    """vec [H, N + M - 1] with -inf on the distances that causal or window masking
    excludes (``distance_allowed``)."""
    allowed = distance_allowed(n, m, vec.device, causal, window)  # [N + M - 1] or None
    return vec if allowed is None else vec.masked_fill(~allowed, float("-inf"))


def _floored_distances(vec: Tensor, m: int, spread: Tensor | None) -> Tensor:
    """vec [H, N + M - 1] floored (``floored_bias``) under its entry at distance 0 (entry
    M - 1) with ``spread`` [H, 1], or as it is where spread is None."""
    return vec if spread is None else floored_bias(vec, vec[:, m - 1 : m], spread)
