"""Projections on a table's rows taken in diagonal order, each run of one row computed
once.

At default positions a relative term of query i and key j reads its table's row
diagonal[t] on diagonal t = j - i + N - 1 (Shaw et al. 2018's clip, Dai et al. 2019,
BERT's relative_key_query, Huang et al. 2020). The strided views of ``_skewed_relative``
and ``_band_views`` read such terms from a projection P[a, c] = x_a . R[rows[c]] over a
window of consecutive diagonals. A table clipped at a distance K reads its first row on
every diagonal before -K and its last past K, so a window that reaches past the clip
starts and ends with runs of one row: the columns of a run are copies of one column
computed, and their gradient is a rank-one update of x's and of that row's. A chunk of
256 BERT queries reaches 1533 diagonals, of which 1023 are distinct.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._first_order import first_order_only


class DiagonalWindow(NamedTuple):
    """The table row of each column of a projection, ``rows`` int64 [W]: columns
    ``first`` .. ``last`` are projected, the columns before ``first`` repeat its row and
    those after ``last`` up to ``visible`` repeat last's, and the columns from
    ``visible`` on are hidden (-inf; a causal mask's diagonals)."""

    rows: Tensor
    first: int
    last: int
    visible: int


def window_of(rows: Tensor, visible: int) -> DiagonalWindow:
    """The ``DiagonalWindow`` of ``rows`` [W] whose columns from ``visible`` on are
    hidden: first .. last span the columns between the runs of one row at either end of
    rows[:visible] (nothing where visible is 0)."""
    changes = torch.nonzero(rows[1:visible] != rows[: max(0, visible - 1)])  # host sync
    if changes.numel() == 0:
        return DiagonalWindow(rows, 0, min(0, visible - 1), visible)
    return DiagonalWindow(rows, int(changes[0]), int(changes[-1]) + 1, visible)


def project_window(x: Tensor, table: Tensor, window: DiagonalWindow, out: Tensor) -> None:
    """out[b, h, a, c] = x[b, h, a] . table[h, rows[c]] for the visible columns, the
    runs copied from the column projected, -inf from ``visible`` on. x: [B, H, r, D];
    table: [H, K, D], x's dtype; out: [B, H, r, W], unit stride along W."""
    first, last, visible = window.first, window.last, window.visible
    if last >= first:
        computed = out[..., first : last + 1]  # [B, H, r, c]
        window_rows = table.index_select(1, window.rows[first : last + 1]).transpose(-1, -2)
        for b in range(x.shape[0]):  # [H, r, D] @ [H, D, c], no copy of the rows per batch row
            torch.bmm(x[b], window_rows, out=computed[b])
        out[..., :first] = computed[..., :1]
        out[..., last + 1 : visible] = computed[..., -1:]
    out[..., visible:] = float("-inf")


def add_window_gradient(
    grad_out: Tensor,
    window: DiagonalWindow,
    x: Tensor,
    table: Tensor,
    grad_x: Tensor,
    grad_table: Tensor,
) -> None:
    """Adds the gradient of ``project_window``'s out, dP [B, H, r, W] (read up to
    ``visible``), into x's, dx = dP R, and the table's, dR = dPᵀ x: each run of one row
    as a rank-one update with its columns' sum. x, grad_x: [B, H, r, D]; table,
    grad_table: [H, K, D]."""
    first, last, visible = window.first, window.last, window.visible
    if last < first:  # every column hidden
        return
    computed_rows = window.rows[first : last + 1]  # [c]
    window_rows = table.index_select(1, computed_rows)  # [H, c, D]
    computed = grad_out[..., first : last + 1]  # [B, H, r, c]
    grad_rows = torch.empty_like(window_rows)  # [H, c, D]
    for b in range(x.shape[0]):  # per batch row: no copy of dP or of the rows
        grad_x[b].baddbmm_(computed[b], window_rows)
        if b == 0:
            torch.bmm(computed[b].transpose(-1, -2), x[b], out=grad_rows)
        else:
            grad_rows.baddbmm_(computed[b].transpose(-1, -2), x[b])
    for start, stop, column in ((0, first, 0), (last + 1, visible, -1)):
        if stop > start:  # a run of the row of computed column ``column``
            weight = grad_out[..., start:stop].sum(-1, keepdim=True)  # [B, H, r, 1]
            grad_x.addcmul_(weight, window_rows[:, column].unsqueeze(1))  # [H, 1, D]
            grad_rows[:, column] += (weight * x).sum((0, 2))  # [H, D]
    grad_table.index_add_(1, computed_rows, grad_rows)


class _WindowProjection(torch.autograd.Function):
    """``window_projection`` with gradients into x and the table."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, table: Tensor, window: DiagonalWindow) -> Tensor:
        out = x.new_empty(x.shape[:-1] + window.rows.shape)  # [B, H, r, W]
        project_window(x, table, window, out)
        ctx.save_for_backward(x, table)
        ctx.window = window
        return out

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, table = ctx.saved_tensors
        grad_x, grad_table = torch.zeros_like(x), torch.zeros_like(table)
        add_window_gradient(grad_out, ctx.window, x, table, grad_x, grad_table)
        needs = ctx.needs_input_grad
        return (grad_x if needs[0] else None), (grad_table if needs[1] else None), None


def window_projection(x: Tensor, table: Tensor, window: DiagonalWindow) -> Tensor:
    """``project_window`` into a new contiguous [B, H, r, W], differentiable in x
    [B, H, r, D] and table [H, K, D]."""
    out: Tensor = _WindowProjection.apply(x, table, window)
    return out
