"""Projections on a table's rows in diagonal order with each run of one row projected
once (``_diagonal_projection``): the runs found, and the projection and its gradients
against the same projection gathered column by column through autograd, float64."""

from __future__ import annotations

import importlib

import pytest
import torch

projection = importlib.import_module("generated._diagonal_projection")

F64 = torch.float64


@pytest.mark.parametrize(
    ("rows", "visible", "want"),
    [
        ([0, 0, 0, 1, 2, 3, 3], 7, (2, 5)),  # a clip at both ends
        ([0, 0, 0, 1, 2, 3, 3], 4, (2, 3)),  # the trailing run hidden
        ([0, 1, 2, 3], 4, (0, 3)),  # no run: every column
        ([2, 2, 2], 3, (0, 0)),  # one row: one column
        ([2, 2, 2], 1, (0, 0)),
        ([0, 1, 2], 0, (0, -1)),  # every column hidden: none projected
    ],
)
def test_the_columns_projected_lie_between_the_runs(
    rows: list[int], visible: int, want: tuple[int, int]
) -> None:
    window = projection.window_of(torch.tensor(rows), visible)
    assert (window.first, window.last, window.visible) == (*want, visible)


@pytest.mark.parametrize(
    ("rows", "visible"),
    [
        ([0, 0, 0, 1, 2, 3, 4, 4], 8),
        ([0, 0, 1, 2, 2, 2, 2, 2], 5),
        ([3, 3, 3, 3], 4),
        ([4, 3, 2, 1, 0, 0], 6),  # reversed order (a key-side term's)
        ([0, 1, 2], 0),
    ],
)
def test_the_projection_and_its_gradients_match_a_gather_per_column(
    rows: list[int], visible: int
) -> None:
    """out[b, h, a, c] = x[b, h, a] . table[h, rows[c]], -inf from ``visible``; the
    gradients of a weighted sum of the visible columns into x and the table."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 5, 4, generator=generator, dtype=F64, requires_grad=True)
    table = torch.randn(3, 5, 4, generator=generator, dtype=F64, requires_grad=True)
    index = torch.tensor(rows)
    weights = torch.randn(2, 3, 5, visible, generator=generator, dtype=F64)

    got = projection.window_projection(x, table, projection.window_of(index, visible))
    got_grads = torch.autograd.grad((got[..., :visible] * weights).sum(), (x, table))

    want = torch.stack([(x * table[:, row].unsqueeze(1)).sum(-1) for row in rows], dim=-1)
    want_grads = torch.autograd.grad((want[..., :visible] * weights).sum(), (x, table))
    want = want.detach().clone()
    want[..., visible:] = float("-inf")

    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
