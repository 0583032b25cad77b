"""CoPE's attention over chunks of queries as one autograd node, keys in reversed order.

CoPE (Golovneva, Wang, Weston and Sukhbaatar 2024, Contextual Position Encoding,
arXiv:2405.18719) adds to the content logit s_ij = scale q_i . k_j a term read from a
table e [P, D] at a position counted by gates of the content logits:

    c_ij = min(sum over keys t >= j visible to i of sigmoid(s_it), P - 1)
    u_ij = (1 - f) q_i . e[floor c_ij] + f q_i . e[ceil c_ij],   f = c_ij - floor c_ij
    out_i = sum_j softmax_j(s_ij + u_ij + masks) v_j

(visible: key position at or before the query's, in its document where packed, and read
by the query under the attn_mask: a masked key's gate counts 0, as the paper's code,
which adds the mask's log to the logits before the sigmoid, and x-transformers', called
on the masked logits, give; t >= j: at or after key j in position order, keys at equal
positions in storage order). A row's count reads only its own row's logits, so the
queries run in chunks, each over every key it may read or count. With the keys in
reversed position order (the latest first: reversed, or where explicit positions are
stored otherwise, a ring buffer's, reordered by ``counting_order``) the count is a
prefix sum, made in place (``Tensor.cumsum_``) in buffers the chunks reuse; the softmax
is blind to the key order.
Writing E_p = q_i . e_p, the term is u = base[floor c] + c slope[floor c], with
slope_p = E_(p+1) - E_p (0 at P - 1, where the count is clamped) and
base_p = E_p - p slope_p: two gathers from [B, H, r, P] tables.

Counts only grow along the reversed keys, and the softmax is blind to a constant per
row. So each chunk sums the gates a block of keys at a time from the first key some row
counts (a) until every row's count is P - 1 (b, ``_counts``), and the term, less
E_(P-1), is base_0 - E_(P-1) before a (keys after every query, where not causal), the
gathers between a and b, and 0 from b on: a causal chunk usually gathers one block of
keys, not all of them.

The forward keeps q, the reversed keys and values, e and the output; the backward makes
each chunk's logits, counts and weights again and forms, with dl = w (dO vᵀ - rowsum(dO o))
the logits' gradient: d base and d slope as scatter-adds of dl and dl c at floor c
(with dl's sums before a into d base_0 and from b on into dE_(P-1): hence dE, and from
it dq and de), dc = dl slope[floor c], the gates' gradient as the suffix sum of dc (the
count's adjoint) times sigmoid' (zero where a key is not counted), and ds = dl plus
that, for dq and dk. No [B, H, N, M] tensor and no graph per chunk is kept.

Before, the terms were a dozen dense [B, H, N, M] tensors through autograd. 2-core CPU,
float32, N = 2048, batch 2, 8 heads, against plain SDPA in one loop: forward 44.1x ->
2.37x (causal 13.8x -> 2.44x), training step 24.4x -> 2.29x (16.8x -> 2.46x)
(benchmarks/results/revisions_cpu_float32_counted_positions.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._chunked_flash import Span
from ._first_order import first_order_only
from ._mask_buffer import ChunkBuffer
from ._masks import masked_softmax_
from ._numerics import autocast_off

#: keys per block of ``_counts``' prefix sums, which stop once every row's count is P - 1
COUNT_BLOCK = 128

#: the fewest queries the node serves: it copies the keys and values in reversed order
#: once per call, which a decode step's dense terms do not need. 2-core CPU, float32,
#: 4096 keys, batch 1, 16 heads, head_dim 64, against plain SDPA: 1 query 2.15x dense,
#: 8.46x as the node; 4 queries 2.20x against 6.86x; 8 queries 4.87x against 3.21x
COUNTED_MIN_QUERIES = 6
#: device types where the node serves (measured on the CPU; a CUDA call keeps the dense
#: terms). Tests set the CPU's routes as CUDA has them by emptying it.
COUNTED_POSITION_DEVICES: set[str] = {"cpu"}

#: a span's logits with its masks joined, keys reversed: (span, logits) -> masked logits
ReversedMasks = Callable[[Span, Tensor], Tensor]
#: a span's counted keys, keys reversed: span -> bool broadcastable to
#: [B, H, rows, keys] ([rows, keys], [B, 1, rows, keys], or as an attn_mask broadcasts)
CountedKeys = Callable[[Span], Tensor]


class CountedChunks(NamedTuple):
    """What each chunk of ``counted_position_attention`` needs besides its tensors."""

    spans: list[Span]  # (i0, i1, lo, hi): queries i0 .. i1 - 1, reversed keys lo .. hi - 1
    masked: ReversedMasks
    counted: CountedKeys
    scale: float


class ChunkScratch:
    """The buffers a chunk's logits, counts, their integer parts and one gathered term
    are made in, reused by every chunk of a call (``ChunkBuffer``); the backward adds
    the gates and the weights' gradient."""

    def __init__(self, batch_heads: int, spans: list[Span], backward: bool) -> None:
        largest = max((i1 - i0) * (hi - lo) for i0, i1, lo, hi in spans) * batch_heads
        self.logits, self.counts, self.floors, self.gathered = (
            ChunkBuffer(largest) for _ in range(4)
        )
        self.gates = ChunkBuffer(largest) if backward else None
        self.grads = ChunkBuffer(largest) if backward else None


def counted_position_attention(
    q: Tensor, keys: Tensor, values: Tensor, table: Tensor, chunks: CountedChunks
) -> Tensor:
    """CoPE attention (see the module docstring) -> [B, H, N, value_dim] in q's dtype.

    q: [B, H, N, D]; keys, values: [B, H, M, D] and [B, H, M, value_dim], every head,
    the latest key first (the keys in position order, reversed), in q's dtype; table: e,
    [P, D]. The spans partition the queries, each over the reversed keys it may read or
    count (the latest key at or before each query's position, back to the earliest it
    may read)."""
    out: Tensor = _CountedPositionAttention.apply(q, keys, values, table, chunks)
    return out


def counted_position_attention_serves(q: Tensor, m: int, masks_need_no_grad: bool) -> bool:
    """Whether ``counted_position_attention`` runs a call: eager mode on a device of
    COUNTED_POSITION_DEVICES, a batch, at least
    ``COUNTED_MIN_QUERIES`` queries and a key, and an attn_mask (if any) that needs no
    gradient, which this node does not give it."""
    return (
        q.device.type in COUNTED_POSITION_DEVICES
        and q.numel() > 0
        and q.shape[2] >= COUNTED_MIN_QUERIES
        and m > 0
        and masks_need_no_grad
        and not torch.compiler.is_compiling()
    )


def counts_by_position(gates: Tensor, k_positions: Tensor | None) -> Tensor:
    """The count of each key j, sum of the gates [B, H, N, M] over the keys t at or after
    j in position order (of k_positions [M] or [B, M]; None: the defaults 0 .. M - 1,
    storage order): [B, H, N, M], unclamped. A stable sort, so keys at equal positions
    count in storage order; a ring buffer's keys, stored out of position order, count as
    they would in order (storage order is no part of the formula)."""
    if k_positions is None:  # the defaults: storage order is position order
        return gates.flip(-1).cumsum(-1).flip(-1)
    order = k_positions.argsort(dim=-1, stable=True).view(-1, 1, 1, gates.shape[-1])
    order = order.expand_as(gates)  # [B, H, N, M]: key of each place in position order
    in_order = gates.gather(-1, order).flip(-1).cumsum(-1).flip(-1)
    return torch.zeros_like(in_order).scatter(-1, order, in_order)  # back in storage order


def counting_order(k_positions: Tensor, documents: tuple[Tensor, Tensor] | None) -> Tensor | None:
    """The order in which ``counted_position_attention`` takes the keys at explicit
    positions k_positions ([M] or [B, M]): by position (a stable sort: equal positions
    in storage order), each packed document's keys apart (``documents``: the queries'
    and the keys' documents, ``pair_documents``; a count reads only its own document's
    keys): [M], or [B, M] where the positions or documents differ per batch row. None
    where storage order is that already for every document's keys (increasing
    positions, restarting at each document or not): the keys need no reordering. One
    host read."""
    positions = k_positions.reshape(-1, k_positions.shape[-1])  # [B or 1, M]
    order = positions.argsort(dim=-1, stable=True)
    apart = None  # [B or 1, M - 1]: neighbours in ``order`` of different documents
    if documents is not None:
        key_documents = documents[1].reshape(-1, positions.shape[-1])
        positions, key_documents = torch.broadcast_tensors(positions, key_documents)
        order = order.expand_as(positions)
        by_document = key_documents.gather(-1, order).argsort(dim=-1, stable=True)
        order = order.gather(-1, by_document)  # by document, by position within each
        ordered = key_documents.gather(-1, order)
        apart = ordered[..., 1:] != ordered[..., :-1]
    stored = order[..., 1:] > order[..., :-1]
    if apart is not None:
        stored = stored | apart
    if bool(stored.all()):
        return None
    return order[0] if order.shape[0] == 1 else order


def keys_reordered(t: Tensor, order: Tensor, dim: int) -> Tensor:
    """t with its keys, along ``dim``, read at ``order`` ([M], or [B, M] per batch row:
    t's first dim, B or 1, is then its batch): positions and documents [B or 1, M]
    (dim 1), an attn_mask [B or 1, H or 1, N or 1, M] (dim 3), keys and values
    [B, H, M, D] (dim 2)."""
    if order.dim() == 1:
        return t.index_select(dim, order)
    shape = (order.shape[0], *t.shape[1:])
    index = order.view(order.shape[0], *([1] * (dim - 1)), -1, *([1] * (t.dim() - dim - 1)))
    return t.expand(shape).gather(dim, index.expand(shape))


def _position_tables(queries: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """(base, slope), each [G, r, P], of a chunk's queries [G, r, D] and the table e
    [P, D]: with E = q eᵀ, slope_p = E_(p+1) - E_p (0 at P - 1) and base_p = E_p - p
    slope_p - E_(P-1), so that the term at count c, less the row's constant E_(P-1)
    (the softmax is blind to it), is base[floor c] + c slope[floor c]: 0 once the count
    reaches P - 1."""
    projected = torch.matmul(queries, table.t())  # [G, r, P]
    slope = torch.zeros_like(projected)
    slope[..., :-1] = projected[..., 1:] - projected[..., :-1]
    steps = torch.arange(table.shape[0], device=table.device, dtype=table.dtype)  # [P]
    return projected - steps * slope - projected[..., -1:], slope


class _ChunkLogits(NamedTuple):
    weights: Tensor  # [G, r, w]: softmax over the reversed keys (in the logits buffer)
    counts: Tensor  # [G, r, w]: c, clamped
    floors: Tensor  # int64 [G, r, b - a]: floor c over keys a .. b - 1 (``near``)
    near: tuple[int, int]  # (a, b): before a every row's count is 0, from b on P - 1
    gates: Tensor | None  # [G, r, w]: sigmoid(s) where counted, else 0 (backward only)
    slope: Tensor  # [G, r, P]


def _chunk_logits(
    queries: Tensor,
    keys: Tensor,
    table: Tensor,
    span: Span,
    chunks: CountedChunks,
    scratch: ChunkScratch,
    batch: int,
) -> _ChunkLogits:
    """A chunk's weights with CoPE's term, and what the backward reads: queries
    [G, r, D], keys [G, w, D] (reversed), G = batch x heads."""
    groups, rows, width = queries.shape[0], queries.shape[1], keys.shape[1]
    shape, dtype, device = (groups, rows, width), queries.dtype, queries.device
    logits = scratch.logits.view(shape, dtype, device)
    logits.baddbmm_(queries, keys.transpose(1, 2), beta=0.0, alpha=chunks.scale)  # s
    counts = scratch.counts.view(shape, dtype, device)
    gates = None if scratch.gates is None else scratch.gates.view(shape, dtype, device)
    last = table.shape[0] - 1
    # the term is base_0 before key a (no row counts a key there: keys after every
    # query of the chunk, where not causal), and 0 from key b on (every row's count
    # has reached P - 1 by then)
    a, b = _counts(logits, counts, gates, chunks.counted(span), batch, last)
    base, slope = _position_tables(queries, table)
    if a:
        logits[..., :a].add_(base[..., :1])
    floors = scratch.floors.view((groups, rows, b - a), torch.int64, device)
    floors.copy_(counts[..., a:b])  # counts >= 0: truncation is the floor
    gathered = scratch.gathered.view((groups, rows, b - a), dtype, device)
    near = logits[..., a:b]
    near.add_(torch.gather(base, -1, floors, out=gathered))
    near.addcmul_(torch.gather(slope, -1, floors, out=gathered), counts[..., a:b])
    masked = chunks.masked(span, logits.view(batch, -1, rows, width))
    weights = masked_softmax_(masked).view(shape)  # in place where masked was
    return _ChunkLogits(weights, counts, floors, (a, b), gates, slope)


def _counts(
    logits: Tensor,
    counts: Tensor,
    gates: Tensor | None,
    counted: Tensor,
    batch: int,
    last: int,
) -> tuple[int, int]:
    """The counts c = min(prefix sum of the counted gates sigmoid(s), last) of a chunk's
    logits s [G, r, w] (reversed keys) into ``counts``, and the gates into ``gates``
    where given; counted: bool broadcastable to [B, H, r, w] (G = B x H). Returns
    (a, b): before column a no row counts a key (every count is 0; left unwritten), from
    b on every count is ``last`` (unwritten too). The gates are summed ``COUNT_BLOCK``
    keys at a time from a on, until every row's count is ``last``: a causal chunk of 64
    queries usually needs one block of its keys (a count reaches P - 1 = 15 some 30 keys
    back where gates are near 1/2). A host sync per block."""
    rows, width = logits.shape[1], logits.shape[2]
    counted_by_some = counted.reshape(-1, width).any(0)  # [w]
    first, some = torch.stack([counted_by_some.byte().argmax(), counted_by_some.any()]).tolist()
    a = first if some else width
    b = a
    for start in range(a, width, COUNT_BLOCK):
        b = min(start + COUNT_BLOCK, width)
        block = counts[..., start:b]
        summed = block if gates is None else gates[..., start:b]
        torch.sigmoid(logits[..., start:b], out=summed)
        uncounted = ~counted[..., start:b]
        summed.view(batch, -1, rows, b - start).masked_fill_(uncounted, 0.0)
        if gates is not None:
            block.copy_(summed)
        block.cumsum_(-1)  # the latest key first: c over keys from j on
        if start > a:
            block.add_(counts[..., start - 1 : start])
        block.clamp_(max=last).nan_to_num_(nan=last)  # a NaN logit (NaN in q) counts to the end
        if bool(block[..., -1].min() >= last):
            break
    return a, b


def _span_inputs(
    q: Tensor, keys: Tensor, values: Tensor, span: Span
) -> tuple[Tensor, Tensor, Tensor]:
    """The span's queries [G, r, D], reversed keys [G, w, D] and values [G, w, Dv]."""
    i0, i1, lo, hi = span
    groups = q.shape[0] * q.shape[1]
    queries = q[:, :, i0:i1].reshape(groups, i1 - i0, -1)
    return (
        queries,
        keys[:, :, lo:hi].reshape(groups, hi - lo, -1),
        values[:, :, lo:hi].reshape(groups, hi - lo, -1),
    )


class _CountedPositionAttention(torch.autograd.Function):
    """``counted_position_attention`` as one node (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, keys: Tensor, values: Tensor, table: Tensor, chunks: CountedChunks
    ) -> Tensor:
        with autocast_off(q.device.type):  # its buffers are in q's dtype, as are its inputs
            out = _counted_forward(q, keys, values, table, chunks)
        ctx.save_for_backward(q, keys, values, table, out)
        ctx.chunks = chunks
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, keys, values, table, out = ctx.saved_tensors
        with autocast_off(q.device.type):  # a backward called under autocast
            return _counted_backward(q, keys, values, table, out, ctx.chunks, grad_out)


def _counted_forward(
    q: Tensor, keys: Tensor, values: Tensor, table: Tensor, chunks: CountedChunks
) -> Tensor:
    """``_CountedPositionAttention``'s forward, autocast off -> [B, H, N, value_dim]."""
    batch, heads = q.shape[0], q.shape[1]
    out = q.new_empty(batch, heads, q.shape[2], values.shape[-1])
    scratch = ChunkScratch(batch * heads, chunks.spans, backward=False)
    for span in chunks.spans:
        i0, i1 = span[0], span[1]
        queries, span_keys, span_values = _span_inputs(q, keys, values, span)
        chunk = _chunk_logits(queries, span_keys, table, span, chunks, scratch, batch)
        out[:, :, i0:i1] = torch.bmm(chunk.weights, span_values).view(batch, heads, i1 - i0, -1)
    return out


def _counted_backward(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    table: Tensor,
    out: Tensor,
    chunks: CountedChunks,
    grad_out: Tensor,
) -> tuple[Tensor | None, ...]:
    """``_CountedPositionAttention``'s backward, autocast off: the gradients of q, the
    keys, the values and the table (and None for ``chunks``)."""
    batch, heads = q.shape[0], q.shape[1]
    groups = batch * heads
    dq, dkeys, dvalues = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
    dtable = torch.zeros_like(table)
    scratch = ChunkScratch(groups, chunks.spans, backward=True)
    assert scratch.grads is not None
    for span in chunks.spans:
        i0, i1, lo, hi = span
        rows, width = i1 - i0, hi - lo
        queries, span_keys, span_values = _span_inputs(q, keys, values, span)
        chunk = _chunk_logits(queries, span_keys, table, span, chunks, scratch, batch)
        grad_rows = grad_out[:, :, i0:i1].reshape(groups, rows, -1)  # [G, r, Dv]
        out_rows = out[:, :, i0:i1].reshape(groups, rows, -1)
        # dl = w (dO vᵀ - rowsum(dO o)): the logits' gradient, [G, r, w]
        dlogits = scratch.grads.view((groups, rows, width), q.dtype, q.device)
        torch.bmm(grad_rows, span_values.transpose(1, 2), out=dlogits)
        dlogits.sub_((grad_rows * out_rows).sum(-1, keepdim=True)).mul_(chunk.weights)
        dvalues[:, :, lo:hi] += torch.bmm(chunk.weights.transpose(1, 2), grad_rows).view(
            batch, heads, width, -1
        )
        gathered = scratch.gathered.view(chunk.floors.shape, q.dtype, q.device)
        dprojected = _term_backward(chunk, dlogits, gathered)  # [G, r, P]: dE; dl -> ds
        dq_rows = torch.bmm(dprojected, table.expand(groups, -1, -1))  # [G, r, D]
        dtable += dprojected.reshape(-1, table.shape[0]).t() @ queries.reshape(-1, q.shape[-1])
        dq_rows.baddbmm_(dlogits, span_keys, alpha=chunks.scale)
        dq[:, :, i0:i1] = dq_rows.view(batch, heads, rows, -1)
        dkeys[:, :, lo:hi] += (
            torch.bmm(dlogits.transpose(1, 2), queries)
            .mul_(chunks.scale)
            .view(batch, heads, width, -1)
        )
    return dq, dkeys, dvalues, dtable, None


def _term_backward(chunk: _ChunkLogits, dlogits: Tensor, gathered: Tensor) -> Tensor:
    """From a chunk's logits' gradient dl [G, r, w]: the gradient of its table
    projections E = q eᵀ, dE [G, r, P]; and the gates' gradient through the counts added
    into dl in place, which is then the content logits' gradient ds. gathered: scratch
    of the floors' shape."""
    assert chunk.gates is not None  # the backward's scratch keeps them
    a, b = chunk.near
    # the term: base_0 before key a, base[floor c] + c slope[floor c] to key b, and
    # E_(P-1) from b on (the forward left out that constant of the row; its gradient,
    # minus the others' sum in exact arithmetic, is not)
    dnear = dlogits[..., a:b]
    dbase = torch.zeros_like(chunk.slope).scatter_add_(-1, chunk.floors, dnear)
    dbase[..., 0] += dlogits[..., :a].sum(-1)
    scaled = torch.mul(dnear, chunk.counts[..., a:b], out=gathered)
    dslope = torch.zeros_like(chunk.slope).scatter_add_(-1, chunk.floors, scaled)
    steps = torch.arange(chunk.slope.shape[-1], device=dlogits.device, dtype=dlogits.dtype)
    dslope -= steps * dbase  # base_p = E_p - p slope_p
    dslope[..., -1] = 0.0  # slope at P - 1 is the constant 0
    dprojected = dbase.clone()  # [G, r, P]
    dprojected[..., -1] += dlogits[..., b:].sum(-1)
    dprojected[..., 1:] += dslope[..., :-1]  # slope_p = E_(p+1) - E_p
    dprojected[..., :-1] -= dslope[..., :-1]
    # the count's adjoint: dc = dl slope[floor c] (0 once saturated); the gates'
    # gradient is its sum over keys from j back to the latest (a suffix sum in reversed
    # order); sigmoid' = g (1 - g), zero where the key is not counted (g = 0 there)
    dcounts = torch.gather(chunk.slope, -1, chunk.floors, out=gathered).mul_(dnear)
    dgates = dcounts.flip(-1).cumsum_(-1).flip(-1)  # [G, r, b - a]
    near_gates = chunk.gates[..., a:b]  # before a: every gate 0
    near_gates.addcmul_(near_gates, near_gates, value=-1.0)
    dnear.addcmul_(dgates, near_gates)
    return dprojected
