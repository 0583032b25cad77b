"""The ``sdpa`` backend's chunk loop: attention a span of queries at a time, each span
against only the keys it may read, with its own mask.

``SdpaChunks._sdpa_in_chunks`` serves every chunked call of the backend (a bias built
per chunk, relative terms per chunk, causal, window and document masks) and picks how
the spans run: a training step as one autograd node where one serves on the CPU
(``recomputed_mask_attention`` where the masks train, ``chunked_flash_attention`` where
they do not), else one SDPA call per span (``trained_mask_attention`` for a chunk whose
mask trains); masks that need no gradient built a few rows at a time into one buffer
(``AssembledMasks``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._chunked_flash import (
    chunked_flash_attention,
    chunked_flash_serves,
    sequence_slices,
)
from ._grouped_queries import scaled_dot_product
from ._inputs import repeat_kv
from ._mask_buffer import AssembledMasks
from ._recomputed_mask import recomputed_mask_attention, recomputed_mask_serves
from ._terms import AttentionTerms
from ._trained_bias import (
    trained_mask_attention,
    trained_mask_attention_serves,
)


class SdpaChunks(AttentionTerms):
    """The ``sdpa`` backend's chunk loop (see the module docstring)."""

    def _every_row_reads(
        self,
        default_positions: bool,
        causal: bool,
        window: int | None,
        packed: bool,
        attn_mask: Tensor | None,
    ) -> bool:
        """Whether every query of a call surely reads a key (``every_row_reads``: its
        softmax then needs no care for fully masked rows): no ``attn_mask``, a finite
        position bias or none (relative terms are finite), and either default positions,
        where each query reads its own key, which no causal mask, window or document
        (``packed``) removes, or no mask at all (a decode step at explicit positions
        once ``_attend`` has dropped its causal mask, its query after every key)."""
        if attn_mask is not None or (self.has_position_bias and not self.position_bias_finite):
            return False
        return default_positions or not (causal or window is not None or packed)

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
        allows (the causal and window chunks at default positions, with a finite bias);
        where not, ``trained_mask_attention``, whose softmax of a row of -inf is NaN, is
        not used (the CPU flash kernels give such a row zeros), and a few queries'
        matmuls (``scaled_dot_product``) take the softmax that gives it zeros.
        ``mask_parts``: where given, the masks need no gradient, and in eager mode where
        the call is done with each mask before it asks for the next (the chunked flash
        node, and the loop where no gradient flows) each is built that many queries at a
        time into one buffer (``AssembledMasks``, ``mask_of`` taking an ``out``
        argument).

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
                out = scaled_dot_product(rows, keys, values, mask, self.scale, every_row_reads)
            outs.append(out.flip(2) if queries_reversed else out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _needs_grad(mask: Tensor | None) -> bool:
    """Whether a chunk's mask carries a gradient (a bias that trains)."""
    return mask is not None and mask.requires_grad
