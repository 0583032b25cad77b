"""Relative terms of a few queries (a decode step) from their factors, O(M) per query.

At default positions query i of N sits at M - N + i and key j at j, and each term reads
the table row diagonal[j - i + N - 1] (``RelativeFactors``). The dense path projects
every key over every row it might read (k . R^T, [B, H, M, K]) for a key-side term
(BERT's relative_key_query, DeBERTa's position-to-content): against 4096 cached keys
on a 2-core CPU one decode step then took 21-29x SDPA. Here:

- query-side and position-only terms project the few queries (or a vector per head)
  over the K rows, [B, H, N, K] (Transformer-XL's two as one, (q_i + v) . R,
  ``merged_factors``), read once per diagonal and laid over the pairs as a strided
  view (``_diagonal_terms``);
- a key-side term clipped at distance c (every r = j - i <= -c reads one row) reads
  the far row R_far at every key at least c before every query (j <= M - N - c). That
  part, s k_j . R_far, is scale * (R_far s / scale) . k_j: it rides in the queries,
  like Transformer-XL's u . k_j, and no key pays for it. Only the w <= N + c - 1 keys
  after them get a term, s k_j . (R[row] - R_far), each pair reading its own row
  ([N, w, H, D]), or, where that is larger than the projection, the w keys projected
  over the K rows.

What remains is one [B or 1, H, N, M] tensor, the additive mask of a single SDPA call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._inputs import repeat_kv
from ._masks import accumulated
from ._terms import (
    RelativeFactors,
    RelativePart,
    merged_factors,
    project_factors,
    rows_projection,
)

# The most queries a call may have for ``few_query_inputs``; above it the dense
# terms (or, from CLIPPED_RELATIVE_MIN_QUERIES on, the clipped path) serve.
FEW_QUERY_RELATIVE_MAX_QUERIES = 16

# Bytes of temporaries (the gathered rows [N, c, H, D] and their products with the c
# keys of every batch row, [B, H, N, c, D]) that ``_key_side_term`` holds at a time,
# per device, where each pair reads its own row. On a 2-core CPU, one DeBERTa decode
# step against 4096 keys gathered its 512 near keys' rows at once: two 2 MiB
# temporaries that glibc's malloc handed back to the system every call, about 990 page
# faults and 1.8 ms for the term, against 0.29 ms and none in chunks of 1 MiB. None or
# absent: every key at once.
KEY_SIDE_CHUNK_BYTES: dict[str, int | None] = {"cpu": 1 << 20}


def few_queries(n: int) -> bool:
    """Whether N queries are few enough for ``few_query_inputs``
    (``FEW_QUERY_RELATIVE_MAX_QUERIES``)."""
    return n <= FEW_QUERY_RELATIVE_MAX_QUERIES


def few_query_relative_serves(factors: list[RelativeFactors], clip: int | None) -> bool:
    """Whether ``few_query_inputs`` computes these terms (of few queries): any
    key-side term needs a clip."""
    return clip is not None or all(part.side != "key" for part in factors)


def few_query_inputs(
    q: Tensor, factors: list[RelativeFactors], n: int, m: int, clip: int | None, scale: float
) -> tuple[Tensor, Tensor | None]:
    """q and the additive mask that give the relative terms ``factors`` of N queries at
    default positions (the queries are the last N of M keys) inside
    ``scale * q' . k + mask``: q' [B, H, N, D] in q's dtype, mask [B or 1, H, N, M] (a
    new tensor, None where every term went into q').

    A term with one value per key, s u . k_j, is scale * (u s / scale) . k_j: it goes
    into q' as u s / scale. So does a key-side term's far row R_far (every key at least
    ``clip`` before every query reads it), leaving k_j . (R[row] - R_far) on the keys
    after them. clip: ``relative_clip``, needed for key-side terms.
    """
    shift: Tensor | None = None  # [H, D], added to every query
    total: Tensor | None = None
    gathered: list[RelativePart] = []  # query-side and position-only terms, projected
    for part in merged_factors(factors):
        side, x, rows, diagonal, part_scale = part
        ratio = part_scale / scale
        if side == "content":  # u . k_j
            shift = _shifted(shift, rows[0], ratio)
        elif side == "key":
            assert clip is not None and diagonal is not None  # few_query_relative_serves
            far = max(0, m - n - clip + 1)  # keys at least clip before every query
            # [H, D]: the farthest distance's row (a tensor index, so no host read)
            far_row = rows.index_select(0, diagonal[:1]).squeeze(0) if far else None
            if far_row is not None:
                shift = _shifted(shift, far_row, ratio)
            term = _key_side_term(x, rows, diagonal, n, m, far, far_row) * part_scale
            total = accumulated(total, term)
        else:  # the few queries (or a vector per head) over the K rows, read per diagonal
            gathered.append(project_factors(part))
    for projected in gathered:
        total = accumulated(total, _diagonal_terms(projected, n, m))
    if shift is not None:
        q = (q.to(shift.dtype) + shift[None, :, None, :]).to(q.dtype)  # [B, H, N, D]
    return q, total


def _shifted(shift: Tensor | None, row: Tensor, ratio: float) -> Tensor:
    """shift + row * ratio ([H, D]), never in place: row may be a parameter's view, so
    where it is the first term (and the ratio 1) it is taken as it is, unscaled."""
    term = row if ratio == 1.0 else row * ratio
    return term if shift is None else shift + term


def _diagonal_terms(part: RelativePart, n: int, m: int) -> Tensor:
    """A query-side or position-only term of the N queries against the M keys from its
    projection over the table rows: [B or 1, H, N, M], a view of a new tensor.

    The projection is read once per diagonal t = j - i + N - 1 (one gather along its
    rows by ``diagonal``, which every query shares), and query i meets key j in column
    j - i + N - 1 of that, so the N rows of terms are windows of it that step back one
    column per query: row stride W - 1 for W = N + M - 1 diagonals (a slice of the
    flattened rows, no as_strided, so that torch.compile traces it). Against a gather
    per pair through an index grid (``band_terms``), Transformer-XL's, BERT's and
    DeBERTa's query-side term of 8 heads took 6.4 us against 40 us for one query and
    500 keys, 20 against 54 for 4 queries, 23 against 79 for one query and 4096 keys
    (2-core AMD EPYC, float32; the same values)."""
    side, scores, diagonal = part
    assert diagonal is not None  # query-side and position-only terms read rows
    if side == "global":  # [H, K]: every query reads the same rows
        scores = scores[None, :, None, :].expand(1, scores.shape[0], n, scores.shape[1])
    batch, heads = scores.shape[:2]
    width = diagonal.shape[0]  # N + M - 1
    index = diagonal.expand(batch, heads, n, width)  # the same diagonals for every query
    by_diagonal = torch.gather(scores, -1, index)  # [B or 1, H, N, W]: column t, row diagonal[t]
    if n == 1:  # W = M: column j is key j
        return by_diagonal
    # entry N - 1 + i (W - 1) + j of the flat rows is column j - i + N - 1 of row i
    flat = by_diagonal.flatten(-2)[..., n - 1 : n - 1 + n * (width - 1)]
    return flat.unflatten(-1, (n, width - 1))[..., :m]  # [B or 1, H, N, M]


def _key_side_term(
    k: Tensor, rows: Tensor, diagonal: Tensor, n: int, m: int, far: int, far_row: Tensor | None
) -> Tensor:
    """k_j . (rows[diagonal[j - i + N - 1]] - far_row) for the N queries, zero on the
    first ``far`` keys (which read far_row): [B, H, N, M], a new tensor.

    k: [B, H_kv, M, D], H_kv dividing H: each pair's row reads its key-value head in
    place (``_pair_key_terms``); a projection over the rows repeats the near keys for
    the query heads. rows: [K, H, D]; far_row: [H, D], or None (then far is 0).
    """
    batch, _, _, dim = k.shape
    heads = rows.shape[1]
    out = k.new_zeros(batch, heads, n, m) if far else k.new_empty(batch, heads, n, m)
    width = m - far
    # query i reads diagonal[far - i + N - 1 + w] at near key w: windows of diagonal, the
    # later queries' starting earlier
    row = diagonal.unfold(0, width, 1)[far : far + n].flip(0)  # [N, w]
    if n * dim <= batch * rows.shape[0]:  # each pair's own row, some keys at a time
        _pair_key_terms(k[:, :, far:], rows, row, far_row, out[..., far:])
    else:  # the w keys over the K rows, [B, H, w, K], then each pair's entry
        near = repeat_kv(k[:, :, far:], heads // k.shape[1])  # [B, H, w, D]
        if far_row is not None:  # far_row is in the queries already
            rows = rows - far_row
        scores = rows_projection(near, rows, 1.0)  # [B, H, w, K]
        flat = (torch.arange(width, device=k.device) * rows.shape[0] + row).flatten()
        near_terms = torch.gather(scores.flatten(-2), -1, flat.expand(batch, heads, -1))
        out[..., far:] = near_terms.view(batch, heads, n, width)
    return out


def _pair_key_terms(
    keys: Tensor, rows: Tensor, pair_rows: Tensor, far_row: Tensor | None, out: Tensor
) -> None:
    """out[b, h, i, j] = keys[b, h // G, j] . (rows[pair_rows[i, j], h] - far_row[h]):
    each pair's own row, gathered ``KEY_SIDE_CHUNK_BYTES`` at a time, so that a key-side
    term costs O(N W H D) for W keys, not a projection over every row.

    keys: [B, H_kv, W, D], H_kv dividing H (G = H / H_kv query heads per key-value head,
    whose keys are not copied out); rows: [K, H, D]; pair_rows: int64 [N, W]; far_row:
    [H, D] or None (nothing subtracted); out: [B, H, N, W], written.
    """
    batch, heads_kv, width, dim = keys.shape
    n, heads = pair_rows.shape[0], rows.shape[1]
    groups = heads // heads_kv
    budget = KEY_SIDE_CHUNK_BYTES.get(keys.device.type)
    # one key's rows [N, H, D] and their products with the keys [B, H, N, D]
    key_bytes = (1 + batch) * n * heads * dim * rows.dtype.itemsize
    keys_at_once = width if budget is None else max(1, budget // key_bytes)
    for start in range(0, width, keys_at_once):
        stop = min(start + keys_at_once, width)
        picked = rows.index_select(0, pair_rows[:, start:stop].flatten())  # [N * c, H, D]
        if far_row is not None:  # far_row is in the queries already: one pass over k
            picked -= far_row
        # [N, c, H_kv, G, D]: query head h = g + G k reads key-value head k
        picked = picked.view(n, stop - start, heads_kv, groups, dim)
        chunk = keys[:, :, start:stop]  # [B, H_kv, c, D]
        if n == 1 and batch == 1:
            # the products into the gathered rows, summed over the last axis: no
            # temporary of the keys' size, which a vecdot against the rows' transposed
            # view made and malloc handed back at every call
            products = picked[0].mul_(chunk[0].transpose(0, 1).unsqueeze(2))  # [c, H_kv, G, D]
            out[0, :, 0, start:stop] = products.sum(-1).view(stop - start, heads).t()
            continue
        # each batch row's keys times their pairs' rows, summed over the features (a
        # temporary within the chunk's budget): four batch rows, 100 keys, 8 heads of
        # 64, one query: 30 us against 99 us by einsum("bkcd,nckgd->bkgnc"), which
        # copies the keys for a batched matmul (2-core CPU); four queries in chunks
        # of 64 keys, 130 against 180-390 us
        key_rows = picked.permute(2, 3, 0, 1, 4)  # [H_kv, G, N, c, D]
        terms = torch.linalg.vecdot(chunk[:, :, None, None], key_rows)  # [B, H_kv, G, N, c]
        out[..., start:stop] = terms.reshape(batch, heads, n, stop - start)


def few_query_inputs_at_positions(
    q: Tensor, factors: list[RelativeFactors], entries: Tensor, scale: float
) -> tuple[Tensor, Tensor | None]:
    """``few_query_inputs`` at explicit positions (``_relative_factors_at_positions``):
    ``entries`` int64 [N, M] is each pair's entry of every term's diagonal, the same in
    every batch row (1-D positions): clip(j - i, -K, K) + K for terms clipped at a
    distance K, whose diagonals [2K + 1] give the row of each clipped key minus query
    position; j - i - low for Transformer-XL's, over a span of distances from low.

    A query-side or position-only term reads its projection over the rows at each pair's
    row; a key-side term gathers each pair's row (``_pair_key_terms``), O(N M H D), where
    the dense terms projected every key over every row, O(M K H D): a BERT
    relative_key_query decode step against 512 keys two apart took 63x plain SDPA. A
    term of one value per key goes into q' as in ``few_query_inputs``.
    """
    n, m = entries.shape
    shift: Tensor | None = None  # [H, D], added to every query
    total: Tensor | None = None
    for part in merged_factors(factors):
        side, x, rows, diagonal, part_scale = part
        if side == "content":  # u . k_j
            shift = _shifted(shift, rows[0], part_scale / scale)
            continue
        assert diagonal is not None  # the terms read rows
        pair_rows = diagonal.index_select(0, entries.flatten()).view(n, m)  # [N, M]
        if side == "key" and n * x.shape[-1] <= x.shape[0] * rows.shape[0]:
            # each pair's own row, as ``_key_side_term`` chooses at default positions
            term = x.new_empty(x.shape[0], rows.shape[1], n, m)  # [B, H, N, M]
            _pair_key_terms(x, rows, pair_rows, None, term)
            total = accumulated(total, term * part_scale)
            continue
        if side == "key":  # more queries than rows per batch row: the keys over the rows
            keys = repeat_kv(x, rows.shape[1] // x.shape[1])  # [B, H, M, D]
            _, scores, _ = project_factors(part._replace(x=keys))  # [B, H, M, K]
            index = pair_rows.t().expand(*scores.shape[:2], m, n)
            term = torch.gather(scores, -1, index).transpose(-1, -2)  # [B, H, N, M]
            total = accumulated(total, term)
            continue
        _, scores, _ = project_factors(part)  # [B, H, N, K], or [H, K] for "global"
        if side == "global":
            scores = scores[None, :, None, :].expand(1, -1, n, -1)  # [1, H, N, K]
        index = pair_rows.expand(*scores.shape[:2], n, m)
        total = accumulated(total, torch.gather(scores, -1, index))  # [B or 1, H, N, M]
    if shift is not None:
        q = (q.to(shift.dtype) + shift[None, :, None, :]).to(q.dtype)  # [B, H, N, D]
    return q, total
