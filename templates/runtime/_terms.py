"""What an encoding adds to attention: ``AttentionTerms``, the base of every backend.

It holds the composition flags a generated encoding sets (decided by posgen's plan),
the hooks it overrides (input-level positions, rotation, the position-only bias, the
content-dependent relative terms, the value-side term, and their per-score forms for
FlexAttention) and the logits term by term (``score_terms``: the decomposition the
eager oracle sums). The backends (``_sdpa_backend``, ``_flex_backend``) read these
hooks; ``_attention`` chooses between them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ._bounded import BoundedReads
from ._caches import cache_get, cache_put, kept_over_reach
from ._devices import check_argument_devices
from ._distances import distance_span_vector, distance_span_with_zero
from ._inputs import (
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_WIDTH,
    Rotated,
    check_attention_inputs,
    check_axis_positions,
    check_embed_input,
    check_one_input,
    check_position_pair,
    check_positions,
    positive_int,
    repeat_kv,
    score_bias_positions,
    to_bhnd,
    under_function_transform,
)
from ._numerics import autocast_off, compute_dtype
from ._parameter_snapshots import (
    count_optimizer_steps,
    frozen_block,
    parameter_snapshot,
    parameter_states,
    parameters_unchanged,
)
from ._query_scale import scaled_queries

# Whether ``_reused_relative_rows`` keeps projected relative rows across calls without
# gradients (Transformer-XL's block of distances grows with the keys: [M, H, D] per
# projection, as much as one layer's key cache). False: every call projects its rows.
KEEP_RELATIVE_ROWS = True

# Device types on which values cheap to make (``_kept_without_sync``: a bias per
# distance, FIRE's pieces) are kept outside a ``parameters_frozen`` block too, compared
# with the parameters at every call: there ``torch.equal`` reads no device. Elsewhere (a
# GPU, where the comparison is a sync) they are kept inside a block only.
KEPT_WITHOUT_SYNC_DEVICES: set[str] = {"cpu"}


# The most rows of x per batch row (queries, or keys) for which ``rows_projection`` of
# a batch of more than one takes an einsum rather than a matmul. On a 2-core x86 CPU, 8
# heads of 64, a batch of two against 1023 table rows: 16 queries 0.32 ms against 1.5,
# 64 queries 0.95 against 2.1, 256 queries 3.5 against 5.2, 1024 queries 35 against 33;
# against 4095 kept distances 64 queries 3.7 against 6.5 ms, but 256 queries 34 against
# 23 ms.
ROWS_PROJECTION_EINSUM_MAX_ROWS = 64


class RelativeFactors(NamedTuple):
    """One relative term at default positions as its two factors
    (``AttentionTerms._relative_factors``): the table rows it reads and what they are
    dotted with, multiplied by no one yet.

    side: what the rows are dotted with. "query": x = q [B, H, N, D], the term of query
    i and key j being scale * x_i . rows[row]; "key": x = k [B, H, M, D] (or
    [B, H_kv, M, D], H_kv dividing H, for the few queries' paths, ``_few_queries``),
    scale * x_j . rows[row]; "global": x a trained vector per head [H, D],
    scale * x . rows[row]; "content": x = k against the one row [1, H, D] of a trained
    vector per head (Transformer-XL's u . k_j: one value per key, diagonal None). rows:
    [K, H, D]; row = diagonal[j - i + N - 1] (query and key indices), diagonal int64
    [N + M - 1]; scale: the logits' scale where the term sits inside it, else 1.
    """

    side: str
    x: Tensor
    rows: Tensor
    diagonal: Tensor | None
    scale: float


class RelativePart(NamedTuple):
    """One relative term at default positions, as its projection over the K table rows
    it reads (``AttentionTerms._relative_parts``): no [B, H, N, M] tensor.

    side: as ``RelativeFactors``; scores: "query" [B, H, N, K] (the term of query i and
    key j being scores[..., i, row]), "key" [B, H, M, K] (scores[..., j, row]), "global"
    [H, K] (scores[h, row]), "content" [B, H, M] (one value per key). row =
    diagonal[j - i + N - 1], diagonal int64 [N + M - 1] (None for "content").
    """

    side: str
    scores: Tensor
    diagonal: Tensor | None


def rows_projection(x: Tensor, rows: Tensor, scale: float) -> Tensor:
    """scale * x . rows^T per head: x [B, H, L, D], rows [K, H, D] -> [B, H, L, K], the
    scale on the smaller factor (``scaled_factors``: the rows where they are a table,
    x where it is a decode step's few queries against Transformer-XL's kept distances).

    [B, H, L, D] @ [H, D, K]: a contiguous [B, H, L, K], one matmul per batch row and
    head (an einsum over "bhnd,khd" ran one per head over the batch and laid its result
    out [H, B, N, K]: forward and backward of x [2, 8, 2048, 64] on 512 rows took 57 ms
    against 41, 2-core x86). But for a batch of more than one with at most
    ``ROWS_PROJECTION_EINSUM_MAX_ROWS`` rows of x each (a few queries), the einsum: the
    matmul broadcast the rows over the batch by a slow copy (8 heads of 64, one query:
    Transformer-XL's 8193 kept distances 18.7 ms for a batch of two, 35 ms for four,
    against 0.36 and 0.46 ms; a table of 1023 rows 2.4 ms against 0.08 ms for four;
    0.2 and 0.04 ms both for a batch of one). While compiling, the scale goes on the
    rows and the matmul serves: the rows' count may be data-dependent (the distinct
    distances at explicit positions), and a choice by it cannot be traced."""
    if torch.compiler.is_compiling():
        return torch.matmul(x, (rows if scale == 1.0 else rows * scale).permute(1, 2, 0))
    x, rows = scaled_factors(x, rows, scale)
    if x.shape[0] > 1 and x.shape[2] <= ROWS_PROJECTION_EINSUM_MAX_ROWS:
        return torch.einsum("bhnd,khd->bhnk", x, rows)
    return torch.matmul(x, rows.permute(1, 2, 0))


def global_rows_projection(x: Tensor, rows: Tensor) -> Tensor:
    """x . rows^T per head: x [H, D] (a trained vector per head), rows [K, H, D] ->
    [H, K], reading rows in place where they are a view of a heads-first block: [H, 1,
    D] @ [H, D, K]. (The other way round, [H, K, D] @ [H, D, 1], took 1.77 ms against
    0.21 ms for 8 heads of 64 and 8189 rows on a 2-core CPU.)"""
    return torch.matmul(x.unsqueeze(1), rows.permute(1, 2, 0)).squeeze(1)


def content_projection(x: Tensor, vector: Tensor) -> Tensor:
    """vector_h . x_j for every key: x [B, H, M, D], vector [H, D] (Transformer-XL's u)
    -> [B, H, M], as [1, H, 1, D] @ [B, H, D, M]. An einsum over "hd,bhmd" took 3.6 ms
    against 0.21 ms for x [2, 8, 4096, 64] on a 2-core CPU (the same for a batch of
    one), and so did the matmul the other way round, [B, H, M, D] @ [1, H, D, 1]."""
    return torch.matmul(vector[None, :, None, :], x.transpose(-1, -2)).squeeze(-2)


def project_factors(factors: RelativeFactors) -> RelativePart:
    """The term's projection over its rows (scale * x . rows^T): ``RelativePart``'s
    scores."""
    side, x, rows, diagonal, scale = factors
    if side in ("query", "key"):
        scores = rows_projection(x, rows, scale)  # [B, H, N or M, K]
    elif side == "global":
        x, rows = scaled_factors(x, rows, scale)
        scores = global_rows_projection(x, rows)  # [H, K]
    else:  # "content": u . k_j
        x, rows = scaled_factors(x, rows, scale)
        scores = content_projection(x, rows[0])  # [B, H, M]
    return RelativePart(side, scores, diagonal)


def projected_parts(factors: list[RelativeFactors]) -> list[RelativePart]:
    """The terms ``factors`` (merged where they share rows, ``merged_factors``) projected
    over their rows."""
    return [project_factors(part) for part in merged_factors(factors)]


def _rows_of_block(
    block: Tensor,
    start: int,
    low: int,
    high: int,
    rows: Tensor,
    in_order: bool,
    heads_first: bool,
) -> Tensor:
    """Rows low .. high (``in_order``), else ``rows``, of a kept block of projected rows
    ([K, H, D], or [H, K, D] where ``heads_first``) whose first is row ``start``, as
    [len, H, D] (a view in order)."""
    if not heads_first:
        return block[low - start : high + 1 - start] if in_order else block[rows - start]
    if in_order:
        return block[:, low - start : high + 1 - start].permute(1, 0, 2)
    return block[:, rows - start].permute(1, 0, 2)


def scaled_factors(x: Tensor, rows: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """x and rows with the scale on the smaller of them (none where it is 1)."""
    if scale == 1.0:
        return x, rows
    if x.numel() <= rows.numel():
        return x * scale, rows
    return x, rows * scale


def merged_factors(factors: list[RelativeFactors]) -> list[RelativeFactors]:
    """factors with each position-only term that reads the same rows, diagonals and
    scale as an earlier query-side term folded into it: (q_i + v) . R, Transformer-XL's
    content-position and position-position terms as one (Dai et al. 2019, eq. 2)."""
    merged: list[RelativeFactors] = []
    for part in factors:
        twin = next(
            (
                i
                for i, other in enumerate(merged)
                if part.side == "global"
                and other.side == "query"
                and other.rows is part.rows
                and other.diagonal is part.diagonal
                and other.scale == part.scale
            ),
            None,
        )
        if twin is None:
            merged.append(part)
        else:
            query = merged[twin]
            shifted = query.x + part.x[None, :, None, :].to(query.x.dtype)  # [B, H, N, D]
            merged[twin] = query._replace(x=shifted)
    return merged


def lone_query_term(factors: list[RelativeFactors]) -> bool:
    """Whether merged ``factors`` are one query-side term (Transformer-XL's (q_i + v) .
    W_R R_(i-j)) and terms of one value per key (its u . k_j), which can join q."""
    sides = [factor.side for factor in factors]
    return sides.count("query") == 1 and all(side in ("query", "content") for side in sides)


def joined_query_term(
    q: Tensor, factors: list[RelativeFactors], scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For ``lone_query_term`` factors: q with each term of one value per key joined
    into it (s q . k + s' u . k = s (q + u s' / s) . k), and the query-side term's x
    [B, H, N, D] and rows [K, H, D] with its scale on one of them (``scaled_factors``)
    and its diagonals' rows [T]: (q, x, rows, diagonal)."""
    (query_term,) = [factor for factor in factors if factor.side == "query"]
    assert query_term.diagonal is not None  # a query-side term reads rows by diagonal
    for content in (factor for factor in factors if factor.side == "content"):
        q = q + (content.scale / scale) * content.rows[0][:, None, :]  # [H, 1, D] per head
    x, rows = scaled_factors(query_term.x, query_term.rows, query_term.scale)
    return q, x, rows, query_term.diagonal


def _one_position(positions: Tensor) -> Tensor:
    """Positions [..., 0] (or [..., L]) as one position 0 per row: [..., 1]."""
    return positions.new_zeros(*positions.shape[:-1], 1)


class AttentionTerms(BoundedReads):
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
    #: the trained parameters ``_distance_bias`` is a function of, by attribute name, each
    #: 0-D or 1-D with entry h reaching only row h of the vector (KERPLE's r1 and r2,
    #: trained slopes): a CPU training step gets their gradients from one flash forward
    #: each (``directional_bias_attention``); () where there are none or no such contract
    distance_bias_parameters: tuple[str, ...] = ()
    #: and its every entry is at most 0, the entry at distance 0 being 0, whatever the
    #: parameters (ALiBi's fixed slopes, KERPLE's clamped kernels): every row of default
    #: positions reads distance 0, so the row's largest entry is 0 and half precision
    #: needs no shift (``half_precision_bias``)
    distance_bias_at_most_zero: bool = False
    #: and is constant past this distance on each side (T5's buckets past max_distance):
    #: ``_clipped_distance_bias`` gives it over -clip .. clip; None where it is not
    clipped_distance: int | None = None
    #: the position bias is finite while the parameters are (every built-in kind; an
    #: expression may give -inf): a row that reads a key the masks leave is never all
    #: -inf, so the few-query matmuls skip the fully-masked-row care (``every_row_reads``)
    position_bias_finite: bool = False
    #: the position bias is a product of position rows: ``_fold_position_bias`` appends
    #: them to q and k, so sdpa runs with no bias tensor
    folds_position_bias: bool = False
    #: sdpa uses that fold (None: on the devices of FOLDED_BIAS_DEVICES, CUDA)
    fold_bias: bool | None = None
    #: the rotary part changes q and k
    has_rotation: bool = False
    #: the rotation's frequencies follow the call's largest position + 1 (dynamic NTK,
    #: LongRoPE): a key that an attn_mask hides counts too, so such a mask does not let
    #: explicit positions pass as the defaults (``position_verdict``)
    length_sets_frequencies: bool = False
    #: content-dependent relative terms enter the logits
    has_relative_terms: bool = False
    #: CoPE's content_position is the only position term (no position bias, untied or
    #: global content term beside it): the sdpa backend's counted node
    #: (``_sdpa_counted``), which forms the content logits and CoPE's term alone, serves
    counted_terms_alone: bool = False
    #: a value-side term is added to the output (needs the attention weights)
    has_value_term: bool = False
    #: every relative term (and the value-side term) reads one table row for all key
    #: minus query positions >= this distance, and one for all <= minus it (Shaw's and
    #: BERT's clip, DeBERTa's log buckets past max_distance); None where it does not
    relative_clip: int | None = None
    #: positions reach the logits, values and masks only as key minus query position, so
    #: adding one constant to every position of a batch row changes nothing: positions
    #: that are the defaults plus such a constant take the paths for default positions
    #: (``position_verdict``). False where a rotation, an absolute or contextual term
    #: or a bias of the query position itself (FIRE) reads positions
    shift_invariant: bool = False
    #: position axes of the rotation (M-RoPE: 3); explicit positions [axes, batch, seq]
    position_axes: int = 1
    #: each query is multiplied by a factor of its own position (``_query_scales``:
    #: Llama 4's temperature tuning, log-length scaling) before any term reads it
    has_query_scale: bool = False
    #: backend "flex" runs torch.compile'd FlexAttention (None: on CUDA only; elsewhere
    #: the unfused reference, which is exact but materialises the scores)
    flex_compile: bool | None = None
    #: the ``parameters_frozen`` block this module is in (a token per block), or None
    _frozen_block: object | None = None

    def __init_subclass__(cls, **keywords: Any) -> None:
        super().__init_subclass__(**keywords)
        check_argument_devices(cls)  # a device mix-up is a ValueError naming the argument

    def __init__(self, heads: int, head_dim: int, scale_factor: float | None) -> None:
        super().__init__()
        self.heads = positive_int(heads, "heads", MAX_HEADS)
        self.head_dim = positive_int(head_dim, "head_dim", MAX_HEAD_DIM)
        if heads * head_dim > MAX_WIDTH:
            raise ValueError(
                f"heads * head_dim must be at most {MAX_WIDTH:,}, got {heads} * {head_dim} = "
                f"{heads * head_dim:,}"
            )
        self.scale = 1.0 if scale_factor is None else 1.0 / math.sqrt(scale_factor * self.head_dim)
        self._cache: dict[tuple[Any, ...], Any] = {}  # see cache_put

    def extra_repr(self) -> str:
        given = getattr(self, "_arguments", {}).items()
        more = "".join(
            f", {name}={value}"
            for name, value in given
            if name not in ("heads", "head_dim") and value is not None
        )
        return f"heads={self.heads}, head_dim={self.head_dim}{more}, scale={self.scale:.6g}"

    def reset_parameters(self) -> None:
        """Every parameter and buffer initialised afresh as the constructor does (the
        spec's initialisation, drawn from torch's default generator as a new module's
        are), copied into this module's tensors on the device and in the dtype they have.

        For a module built on the meta device: ``with torch.device("meta"): pe = Cls()``,
        then ``pe.to_empty(device=...)`` and ``pe.reset_parameters()``. A submodule's own
        ``reset_parameters`` (an ``nn.Embedding``'s) gives PyTorch's defaults, not the
        spec's; ``model.apply`` calls this one after them.
        """
        with torch.device("cpu"):  # not a meta device the caller's block may have set
            fresh = type(self)(**getattr(self, "_arguments", {}))
        mine, theirs = (
            {
                **dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False)),
            }
            for module in (self, fresh)
        )
        if mine.keys() != theirs.keys():
            raise ValueError(
                f"reset_parameters: this module's tensors {sorted(mine)} are not those a new "
                f"{type(self).__name__} has, {sorted(theirs)}"
            )
        with torch.no_grad():
            for name, tensor in mine.items():
                tensor.copy_(theirs[name])
        self._cache.clear()

    def __getstate__(self) -> dict[str, Any]:
        """What a copy carries (``copy.deepcopy``, pickle, ``torch.save`` of the module):
        all but the values kept across calls (``_cache``: its parameter snapshots would
        double the file; a rotation's tables, ``_fresh_rotary_tables``) and the
        ``parameters_frozen`` block, which ends with its ``with``: a copy made inside one
        (an EMA copy) compares its parameters as any module outside a block does."""
        state = self.__dict__.copy()
        state["_cache"] = {}
        state.update(self._fresh_rotary_tables())
        state.pop("_frozen_block", None)  # the class's None
        return state

    def _fresh_rotary_tables(self) -> dict[str, object]:
        """The tables a rotation keeps across calls, as a new module has them (the
        rotation block's); none without a rotation."""
        return {}

    # ------------------------------------------------------------------ encoding hooks

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Input-level positions: none for this encoding (identity), so x [batch, seq,
        features] comes back as it is; x and positions are checked as an encoding with
        an input-level part checks them, so that a model can switch encodings."""
        check_embed_input(x, None)
        check_positions(positions, x.shape[1], x.shape[0], "positions", x.device)
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

    def scale_queries(
        self, q: Tensor, positions: Tensor | None = None, *, layout: str = "bhnd"
    ) -> Tensor:
        """Multiply each query by its position's factor tau(i) (the spec's query_scale);
        q itself where the encoding has none.

        q: [batch, heads, N, head_dim] (or [batch, N, heads, head_dim] with layout
        "bnhd"); positions: the queries' positions, int64 [N] or [batch, N], default
        0, ..., N - 1 (a prompt from position 0: in a decode step pass them, since
        ``rotate`` and ``forward`` place N queries at the last N of M key positions). The
        product is formed in float32 (float64 for float64 q) and rounded once to q's
        dtype. ``forward``, ``scores`` and ``score_terms`` scale the queries themselves;
        call this beside ``rotate``, with the same query positions, where your own
        attention takes the rotated q and k (the factor commutes with the rotation).
        """
        (q,) = to_bhnd(layout, q)
        per_head = self.has_query_scale and self._query_scale_heads() is not None
        check_one_input(q, self.head_dim, "q", self.heads if per_head else None)
        positions = check_positions(positions, q.shape[2], q.shape[0], "positions", q.device)
        q = self._scaled_queries(q, positions, q.shape[2])  # None: the queries at 0 .. N - 1
        return to_bhnd(layout, q)[0]

    def _query_scales(self, positions: Tensor) -> Tensor:
        """The factor tau(i) of each query position i, float64 of positions' shape.
        Encodings with a query scale override it."""
        raise NotImplementedError("this encoding has no query scale")

    def _query_scale_heads(self) -> Tensor | None:
        """A query scale's trained factor per head [H], which multiplies each position's
        (Scalable-Softmax's s), or None where the factor is the position's alone."""
        return None

    def _scaled_queries(self, q: Tensor, q_positions: Tensor | None, m: int) -> Tensor:
        """q [B, H, N, D] times its positions' factors (and its head's, where the scale
        has one) where the encoding has a query scale, else q: the queries sit at
        q_positions as ``_positions_and_axes`` resolves them (None only at the
        defaults, where they are M - N, ..., M - 1)."""
        if not self.has_query_scale:
            return q
        per_head = self._query_scale_heads()  # [H] or None
        if q_positions is not None:
            return scaled_queries(q, self._query_scales(q_positions), per_head)
        return scaled_queries(q, self._default_query_scales(m - q.shape[2], m, q), per_head)

    def _default_query_scales(self, start: int, stop: int, q: Tensor) -> Tensor:
        """tau at positions start .. stop - 1 ([N], in q's compute dtype): a slice of
        the factors of 0 .. R - 1 kept per device and dtype, R a power of two grown as
        calls need, so a decode step (a new key count each) makes none (on a 2-core
        CPU the ten small ops that make them took about 20 us a step). While
        compiling, made in the graph."""
        dtype = compute_dtype(q)
        if torch.compiler.is_compiling():
            positions = torch.arange(start, stop, device=q.device)
            return self._query_scales(positions).to(dtype)

        def scales(reach: int) -> Tensor:  # [R]
            return self._query_scales(torch.arange(reach, device=q.device)).to(dtype)

        key = ("query_scales", str(q.device), dtype)
        return kept_over_reach(self._cache, key, stop, scales)[1][start:stop]

    def parameters_frozen(self) -> contextlib.AbstractContextManager[None]:
        """A context manager: within it, the values kept from this module's parameters
        are compared with them once and then reused (``parameters_frozen(module)``)."""
        return parameters_frozen(self)

    def rotate_keys(
        self, k: Tensor, positions: Tensor | None = None, *, layout: str = "bhnd"
    ) -> Tensor:
        """Rotate keys once, at their positions, for a cache of rotated keys (decode).

        k: [batch, kv_heads, M, head_dim] (or [batch, M, kv_heads, head_dim] with layout
        "bnhd"); positions: int64 [M] or [batch, M], default 0, ..., M - 1. Append the
        result to the cache and call ``forward(q, cache, v, keys_rotated=True, ...)``:
        each decode step then rotates only its new keys and its queries. Without a
        rotary part this returns k itself.

        A schedule that depends on the call's length (dynamic NTK, LongRoPE) rotates
        these keys at the length their positions reach, and the queries of a later
        ``keys_rotated=True`` call at the length that call's q and k positions reach.
        Keys rotated in one call and read at the same positions agree with rotating both
        in the forward; keys cached before the length crossed the schedule's switch keep
        the frequencies they were rotated with, as in Hugging Face's key caches. Pass
        unrotated keys with ``keys_rotated=False`` to rotate every key at the new length.
        """
        (k,) = to_bhnd(layout, k)
        check_one_input(k, self.head_dim, "k")
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
        read_values: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Rotated]:
        """Validate positions; rotate here at M-RoPE axis positions [axes, batch, seq].

        Returns q, k, the token positions that masks and biases read (None, token order,
        where axis positions were given) and what is rotated already. Token positions'
        values are checked unless ``read_values`` is False (the caller checks them with
        ``position_verdict(..., check_values=True)``).
        """
        if q_positions is None and k_positions is None and q.shape[2] <= k.shape[2]:
            return q, k, None, None, rotated  # the defaults (N > M has none: raised below)
        n, m, batch = q.shape[2], k.shape[2], q.shape[0]
        axes, device = self.position_axes, q.device
        q_axes = check_axis_positions(q_positions, axes, n, batch, "q_positions", device)
        k_axes = check_axis_positions(k_positions, axes, m, batch, "k_positions", device)
        if q_axes is None and k_axes is None:
            q_positions, k_positions = check_position_pair(
                q_positions, k_positions, n, m, batch, q.device, read_values
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
            q = self._rotate_queries(q, q_axes, k_axes, m)
        else:
            q, k = self._rotate(q, k, q_axes, k_axes)
        return q, k, None, None, "both"

    def _check_keys_ahead(
        self,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        n: int,
        m: int,
        dtype: torch.dtype,
    ) -> None:
        """Raise ValueError where, in a call without ``causal``, keys lie too far after a
        query for this encoding's logits of q and k in ``dtype`` to stay finite (xPos); a
        no-op for the others."""

    def _sampled_positions(self, length: int, device: torch.device) -> Tensor | None:
        """Positions to use where none are given ([length]), or None for 0 .. length - 1.

        Randomized encodings draw them in training; every other encoding uses the range.
        """
        return None

    def _rotate_queries(
        self, q: Tensor, q_positions: Tensor | None, k_positions: Tensor | None, m: int
    ) -> Tensor:
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
            return self._rotate_queries(q, q_positions, k_positions, k.shape[2]), k
        return self._rotate(q, k, q_positions, k_positions)

    def score_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Position-only score bias: none for this encoding. The positions are checked
        all the same (shape, dtype, sign), as every encoding's score_bias checks them."""
        device = q_positions.device if isinstance(q_positions, Tensor) else torch.device("cpu")
        score_bias_positions(q_positions, k_positions, device)
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

    def _relative_factors(
        self,
        q: Tensor,
        k: Tensor,
        dtype: torch.dtype,
        causal: bool = False,
        diagonals: tuple[int, int] | None = None,
    ) -> list[RelativeFactors] | None:
        """The relative terms at default positions as their factors (``RelativeFactors``:
        the K table rows each reads, what they are dotted with, the row of each
        diagonal), for paths that never build a [B, H, N, M] term per pair; None where
        the encoding has no such form (then ``_relative_terms``' dense tensors serve).
        With ``causal`` the diagonals whose key comes after the query may read any row
        (they are masked). k has q's heads, or grouped-query heads where the factors go to
        ``few_query_inputs``. ``diagonals`` (n, m): the diagonals (and the
        rows they read) of n queries against m keys at default positions instead of
        q's and k's (``_clipped_relative_parts``)."""
        return None

    def _counted_position_table(self) -> Tensor | None:
        """CoPE's table e [max_positions, head_dim], read at positions counted by gates
        of the content logits (``_counted_positions``); None for other encodings."""
        return None

    def _relative_parts(
        self, q: Tensor, k: Tensor, dtype: torch.dtype, causal: bool = False
    ) -> list[RelativePart] | None:
        """The terms of ``_relative_factors`` projected over their rows
        (``RelativePart``), for backends that read them per score or per band."""
        factors = self._relative_factors(q, k, dtype, causal)
        return None if factors is None else projected_parts(factors)

    def _clipped_relative_parts(
        self, q: Tensor, k: Tensor, dtype: torch.dtype
    ) -> list[RelativePart] | None:
        """The relative terms at any positions, where they are clipped at K =
        ``relative_clip``: each projected over every table row its index reads
        (``_clipped_relative_factors``). O((N + M) K) for any positions; None where the
        terms are not clipped."""
        factors = self._clipped_relative_factors(q, k, dtype)
        return None if factors is None else [project_factors(part) for part in factors]

    def _clipped_relative_factors(
        self, q: Tensor, k: Tensor, dtype: torch.dtype
    ) -> list[RelativeFactors] | None:
        """The factors of the relative terms at any positions (merged), where they are
        clipped at K = ``relative_clip``: each term's rows are every table row its index
        reads, its diagonal [2K + 1] indexed by key minus query position clipped to
        -K .. K, plus K (the default diagonals of K + 1 queries and keys), so the term
        of query position i and key position j reads row diagonal[clip(j - i, -K, K) + K].
        None where the terms are not clipped."""
        clip = self.relative_clip
        if clip is None:
            return None
        factors = self._relative_factors(q, k, dtype, diagonals=(clip + 1, clip + 1))
        return None if factors is None else merged_factors(factors)

    def _relative_factors_at_positions(
        self, q: Tensor, k: Tensor, dtype: torch.dtype, relative: Tensor
    ) -> tuple[list[RelativeFactors], Tensor] | None:
        """The relative terms at explicit positions of one row as their factors, and
        each pair's entry of their diagonals: (factors, int64 [N, M]), the term of a
        pair reading row diagonal[entry] of each; relative: key minus query position,
        int64 [N, M]. None where the encoding has no factors, or where the rows would
        be too many.

        Clipped terms: ``_clipped_relative_factors``, entry clip(j - i, -K, K) + K.
        Terms read by distance with no clip (Transformer-XL's): the default diagonals
        of the span low .. high of 0 and every r = j - i present, entry r - low,
        where that span is short (``distance_span_with_zero``: eager mode on the CPU);
        its rows are a slice of the projected rows kept across calls. Transformer-XL's
        decode step at positions two apart, where its dense terms sorted the distances
        and gathered their rows (8 heads of 64, 2-core AMD EPYC, time over plain SDPA):
        10.3x -> 6.1x against 449-512 keys, 13.0x -> 4.4x against 4033-4096
        (``revisions_cpu_float32_decode_distance_span_stride2.md``).
        """
        clip = self.relative_clip
        if clip is not None:
            clipped_factors = self._clipped_relative_factors(q, k, dtype)
            if clipped_factors is None:
                return None
            return clipped_factors, relative.clamp(-clip, clip) + clip
        span = distance_span_with_zero(relative)
        if span is None:
            return None
        low, high = span
        # the diagonals of high + 1 queries against 1 - low keys: r from low to high
        factors = self._relative_factors(q, k, dtype, diagonals=(high + 1, 1 - low))
        return None if factors is None else (factors, relative - low)

    def _relative_rows(
        self, projection: str, rows: Tensor, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """The relative table's rows ``rows`` (row ids, or distances for a table computed
        from them) as the terms read with ``projection`` read them: [K, H, D].
        Encodings with a relative table override it."""
        raise NotImplementedError("this encoding has no relative table")

    def _kept_relative_rows(
        self, dtype: torch.dtype, device: torch.device
    ) -> dict[str, tuple[int, Tensor]] | None:
        """The projected relative rows kept from earlier calls, checked once for this
        call: {projection: (first row, block [rows, H, D], or [H, rows, D] for distances,
        kept heads first)}, which this call's
        ``_reused_relative_rows`` read and extend; None where rows are not kept (under
        torch.compile, with gradients into the parameters, or ``KEEP_RELATIVE_ROWS`` off).

        Keyed on ``parameter_states`` (an optimizer step, load_state_dict or a new
        ``.data`` starts afresh) and kept beside a copy of the parameters, compared once
        here (``parameters_unchanged``: an edit through ``p.data``, which moves no version
        counter, starts afresh too). A method that reads several projections takes this
        once, so DeBERTa's two projections cost one comparison per call, not two.
        """
        if not KEEP_RELATIVE_ROWS:
            return None
        return self._kept_with_parameters(("relative_rows", dtype), device, dict)

    def _kept_with_parameters(
        self, name: tuple[Any, ...], device: torch.device, make: Callable[[], Any]
    ) -> Any:
        """``make()``, a value of the module's parameters alone, kept across calls while
        they are unchanged; None where nothing is kept: under torch.compile (the graph
        computes it) or with gradients into the parameters (training).

        Keyed on ``name``, the device and ``parameter_states`` (an optimizer step,
        load_state_dict or a new ``.data`` starts afresh), and kept beside a copy of the
        parameters, compared at each read (``parameters_unchanged``: an edit through
        ``p.data``, which moves no version counter, starts afresh too): a method reads
        it once per call. A value made in inference mode is kept apart, since it cannot
        enter autograd outside it.
        """
        if torch.compiler.is_compiling() or self._trains_terms() or under_function_transform():
            return None  # a transform's parameters may be batched, with no storage to key
        prefix = (*name, str(device), torch.is_inference_mode_enabled())
        versions = parameter_states(self)
        cached = cache_get(self._cache, (*prefix, versions))
        if cached is not None and parameters_unchanged(self, cached[1]):
            return cached[0]
        for stale in [key for key in self._cache if key[: len(prefix)] == prefix]:
            del self._cache[stale]  # other parameter versions are never read again
        value = make()
        cache_put(self._cache, (*prefix, versions), (value, parameter_snapshot(self)))
        return value

    def _kept_without_sync(
        self, name: tuple[Any, ...], device: torch.device, make: Callable[[], Any]
    ) -> Any:
        """``_kept_with_parameters`` where reading the kept value costs no device sync:
        on ``KEPT_WITHOUT_SYNC_DEVICES`` (the CPU, where ``torch.equal`` compares), or
        inside a ``parameters_frozen`` block (compared once, at its first read); None
        elsewhere, so that the caller
        makes the value every call. For values that are cheap to make (a few small
        ops): a decode step on CUDA outside a block keeps its loop free of syncs."""
        if device.type not in KEPT_WITHOUT_SYNC_DEVICES and frozen_block(self) is None:
            return None
        return self._kept_with_parameters(name, device, make)

    def _kept_distance_vector(
        self,
        name: str,
        n: int,
        m: int,
        device: torch.device,
        of_distances: Callable[[Tensor], Tensor],
    ) -> Tensor | None:
        """``of_distances(default_distances(n, m, device))`` ([..., N + M - 1]) for a bias
        per distance made from trained parameters (KERPLE's, learned slopes, T5's
        table, an expression's): a slice of a vector over a wider span
        (``distance_span_vector``) kept while the parameters are unchanged
        (``_kept_per_distance``: inside a ``parameters_frozen`` block, and outside one
        on the CPU). None elsewhere (training, compiling, outside a block on a GPU),
        where the caller makes it per call. Inside a block, one query against 437-500
        keys (2-core AMD EPYC): KERPLE 3.58x -> 2.79x plain SDPA, learned ALiBi 3.05x ->
        2.80x, T5 2.85x -> 2.74x. Outside one the parameters are compared every call
        (10-25 us), which first cost about what the vector saved (T5 2.88x -> 3.07x);
        once a kept row could go to SDPA unfloored (``kept_row_is_shallow``), a causal
        decode loop at 449-512 keys went T5 2.78x -> 2.50x, KERPLE-log 3.29x -> 2.36x,
        KERPLE-power 3.34x -> 2.82x, FIRE 6.26x -> 3.58x, learned ALiBi (steep: its row
        still takes the floor) 2.87x -> 2.94x
        (``revisions_cpu_float32_decode_kept_outside_blocks.md``)."""
        kept = self._kept_per_distance(name, device)
        if kept is None:
            return None
        return distance_span_vector(kept, (name,), n, m, device, of_distances)

    def _kept_per_distance(self, name: str, device: torch.device) -> dict[Any, Any] | None:
        """The dict in which ``_kept_distance_vector`` keeps the vector ``name`` (under
        ``(name,)``; a caller may keep other values of the same parameters beside it)
        while the parameters are unchanged, where that costs no sync
        (``_kept_without_sync``); None elsewhere (training, compiling, outside a
        ``parameters_frozen`` block on a GPU). Each call compares the parameters once
        outside a block: a caller that needs the dict twice in one call passes it on."""
        kept: dict[Any, Any] | None = self._kept_without_sync(
            ("distance_vector", name), device, dict
        )
        return kept

    def _reused_relative_rows(
        self,
        kept: dict[str, tuple[int, Tensor]] | None,
        projection: str,
        rows: Tensor,
        low: int | None,
        dtype: torch.dtype,
        device: torch.device,
        table_rows: int | None,
    ) -> Tensor:
        """``_relative_rows(projection, rows, dtype, device)``, [K, H, D], read from and
        kept in ``kept`` (``_kept_relative_rows``; None: projected every call): a decode
        loop reads the same projected rows every step (projecting Transformer-XL's M
        sinusoid rows took half of a CPU decode step against 4096 keys, DeBERTa's table a
        tenth).

        low: where rows is the ascending run low, low + 1, ..., low + K - 1
        (``_relative_diagonals``'), its first, which the host knows, so no bound is read
        from the device; None: rows in any order, their bounds read from the device (a
        host sync, in eager mode). table_rows: rows are row ids of a table of that many
        rows (all of them are projected once), or None: rows are distances, and the kept
        block of distances grows by doubling to cover each call's (not kept where the
        distances are sparse, as explicit positions far apart give; a range far from the
        kept block replaces it, so the gap between them is never projected). Rows in
        ascending order come back as a view of the kept block: read them, never write
        into them.
        """
        if kept is None or rows.numel() == 0:
            return self._relative_rows(projection, rows, dtype, device)
        if low is not None:
            high, in_order = low + rows.shape[0] - 1, True
        else:
            low, high = int(rows.min()), int(rows.max())
            in_order = bool((rows.diff() == 1).all())  # low, low + 1, ..., high: a slice
        if table_rows is not None:
            first, last = 0, table_rows - 1
        elif high - low + 1 > 2 * rows.numel():  # sparse distances: project them alone
            return self._relative_rows(projection, rows, dtype, device)
        else:
            first, last = low, high
        # distances (Transformer-XL's, up to M of them) are kept heads first, [H, K, D]: a
        # few queries' projection over them (q . R^T, a matrix per head) then reads each
        # head's rows as one block, where rows first its [D, K] matrices had a row
        # stride of H D ((q + v) . R against 4096 distances, 8 heads of 64: 186-265 us
        # against 114-155 us on a 2-core CPU); table rows stay rows first, [K, H, D], for
        # the key-side terms' gather of one row per key (from a slice of a heads-first
        # block 46 us against 17 us)
        heads_first = table_rows is None
        if projection in kept:
            start, block = kept[projection]
            stop = start + block.shape[1 if heads_first else 0]
            if start <= first and last < stop:
                return _rows_of_block(block, start, low, high, rows, in_order, heads_first)
            size, wanted = stop - start, last - first + 1
            if max(last + 1, stop) - min(first, start) <= 2 * (size + wanted):
                # near the kept block: grow it by at least its size on each short side
                first = min(first, start - size) if first < start else start
                last = max(last, stop - 1 + size) if last >= stop else stop - 1
            # else far from it: keep the new range alone (never the gap between them)
        span = torch.arange(first, last + 1, device=rows.device)
        block = self._relative_rows(projection, span, dtype, device)  # [last - first + 1, H, D]
        if heads_first:
            block = block.permute(1, 0, 2).contiguous()  # [H, last - first + 1, D]
        kept[projection] = (first, block)
        return _rows_of_block(block, first, low, high, rows, in_order, heads_first)

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
        documents: tuple[Tensor, Tensor] | None = None,
        attn_mask: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The terms that depend on q and k, each as it enters the logits; k may have
        grouped-query heads (each term repeats the keys it reads). documents:
        the queries' and the keys' documents (``pair_documents``) where packed, for
        terms that read keys other than the pair's own (CoPE counts only its
        document's keys); None: one document. attn_mask: the call's (checked,
        broadcastable to [B, H, N, M]) for such terms too (CoPE counts only the keys it
        lets the query read); the caller still applies it to the logits."""
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
            q = self._scaled_queries(q, q_positions, k.shape[2])
            if q.shape[2] == 0 or k.shape[2] == 0:
                return self._score_terms_of_none(q, k, q_positions, k_positions, rotated)
            return self._score_terms_exact(q, k, q_positions, k_positions, rotated)

    def _score_terms_of_none(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated,
    ) -> dict[str, Tensor]:
        """``score_terms`` of no queries or no keys: the terms of one query against one
        key at position 0 (zero features), expanded to N and M (one of them 0), so that
        each term has the names, shape and dtype of a call with some."""
        n, m = q.shape[2], k.shape[2]
        terms = self._score_terms_exact(
            q.new_zeros(*q.shape[:2], 1, q.shape[3]),
            k.new_zeros(*k.shape[:2], 1, k.shape[3]),
            None if q_positions is None else _one_position(q_positions),
            None if k_positions is None else _one_position(k_positions),
            rotated,
        )
        return {name: term.expand(*term.shape[:-2], n, m) for name, term in terms.items()}

    def _expected_heads(self) -> int | None:
        return self.heads if self.checks_heads else None

    def _score_terms_exact(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None,
        k_positions: Tensor | None,
        rotated: Rotated = "none",
        documents: tuple[Tensor, Tensor] | None = None,
        attn_mask: Tensor | None = None,
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
            terms.update(
                self._relative_terms(q, k, q_positions, k_positions, dtype, documents, attn_mask)
            )
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


check_argument_devices(AttentionTerms)  # its own entry points (subclasses': on definition)


@contextlib.contextmanager
def parameters_frozen(*modules: nn.Module) -> Iterator[None]:
    """Within the block, every posgen encoding inside ``modules`` reuses the values it
    keeps from its parameters (projected relative rows, TUPE's untied rows, FLOATER's
    trajectory) after comparing them with the parameters once, at their first read.

    Outside such a block each read compares the parameters with a copy kept beside the
    value, since an edit through ``p.data`` (an EMA update, Hugging Face's
    ``_init_weights``) moves no version counter: one read of every parameter per call,
    and a host sync on a GPU (DeBERTa's decode step against 500 keys on a 2-core CPU
    spent half its time there). The block's promise is that no parameter is edited
    through ``.data`` inside it. What autograd's version counters see is still seen:
    ``load_state_dict``, ``torch.nn.init`` and other in-place updates, and parameters
    assigned anew; and every ``torch.optim`` step (a global step hook counts them, since
    a fused step moves no version counter) makes the next read compare the values once
    more. Blocks nest; each compares once more on entry.

        with parameters_frozen(model), torch.inference_mode():
            for step in range(steps):
                ...  # decode: model(...) with a growing key cache

    modules: torch.nn.Module objects holding at least one encoding between them.
    """
    encodings: list[AttentionTerms] = []
    for position, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"parameters_frozen takes torch.nn.Module objects, got "
                f"{type(module).__name__} as argument {position}"
            )
        encodings.extend(m for m in module.modules() if isinstance(m, AttentionTerms))
    if not encodings:
        raise ValueError("parameters_frozen: modules holds no posgen encoding")
    count_optimizer_steps()
    block, before = object(), [m._frozen_block for m in encodings]
    for encoding in encodings:
        encoding._frozen_block = block
    try:
        yield
    finally:
        for encoding, earlier in zip(encodings, before, strict=True):
            encoding._frozen_block = earlier
