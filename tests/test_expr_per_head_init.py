"""Expression parameters that start from one value per head (``init: [...]``).

The values a module holds and the bias it computes are compared with the spec's numbers
and an independent float64 computation of the stated expression; the refusals
(wrong count, a list on a scalar, a value outside bounds or not positive, a head whose
values make the bias infinite) are the invalid fixtures of tests/specs/invalid.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.spec.model.biases import MAX_EXPR_INIT_HEADS, ExprParam
from tests.conftest import assert_sdpa_matches_eager, expr_bias_spec

R1 = [0.5, 1.0, 1.5, 2.0]  # after softplus
R2 = [0.25, 0.5, 0.75, 1.0]
C = 0.125
PARAMS = (
    f"{{r1: {{shape: [heads], init: {R1}, positive: true}}, "
    f"r2: {{shape: [heads], init: {R2}, bounds: [0.01, 10]}}, c: {{shape: [], init: {C}}}}}"
)
EXPRESSION = "-r1[h] * log1p(r2[h] * abs(i - j)) + c"


@pytest.fixture(scope="module")
def per_head_class(tmp_path_factory: pytest.TempPathFactory) -> type[torch.nn.Module]:
    folder: Path = tmp_path_factory.mktemp("per_head")
    spec = expr_bias_spec(folder, "kerple_per_head", EXPRESSION, heads=4, params=PARAMS)
    return encoding_class(module_from_spec(spec))


def _float64_module(cls: type[torch.nn.Module], **options: int) -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return cls(**options)
    finally:
        torch.set_default_dtype(previous)


def test_each_head_starts_from_its_listed_value(per_head_class: type[torch.nn.Module]) -> None:
    pe = _float64_module(per_head_class, head_dim=8)
    r1 = torch.nn.functional.softplus(pe.expr_r1.detach())
    torch.testing.assert_close(r1, torch.tensor(R1, dtype=torch.float64), rtol=1e-15, atol=0)
    assert pe.expr_r2.tolist() == R2 and pe.expr_c.item() == C
    q_pos, k_pos = torch.tensor([0, 3, 9]), torch.tensor([0, 1, 5, 9, 12])
    distance = (q_pos[:, None] - k_pos[None, :]).abs().double()  # [N, M]
    want = torch.stack(
        [-a * torch.log1p(b * distance) + C for a, b in zip(R1, R2, strict=True)]
    )  # [H, N, M], the stated expression at the listed values
    torch.testing.assert_close(pe.score_bias(q_pos, k_pos), want, rtol=1e-14, atol=1e-14)
    assert math.isclose(want[3, 0, 4].item(), -2.0 * math.log(13.0) + C)  # head 3, |i - j| = 12


def test_per_head_values_train_and_agree_on_every_backend(
    per_head_class: type[torch.nn.Module],
) -> None:
    pe = _float64_module(per_head_class, head_dim=8)
    for causal in (False, True):
        assert_sdpa_matches_eager(pe, 6, 9, kv_heads=2, causal=causal)
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    pe(q, q, q, causal=True).sum().backward()
    assert pe.expr_r1.grad is not None and bool((pe.expr_r1.grad != 0).all())


def test_reset_parameters_returns_to_the_listed_values(
    per_head_class: type[torch.nn.Module],
) -> None:
    pe = per_head_class()
    with torch.no_grad():
        pe.expr_r2.fill_(3.0)
    pe.reset_parameters()
    assert pe.expr_r2.tolist() == R2


def test_a_module_with_another_head_count_is_refused(
    per_head_class: type[torch.nn.Module],
) -> None:
    with pytest.raises(
        ValueError,
        match=r"parameter r1 starts from 4 values, one per head: "
        r"heads must be 4, got 6",
    ):
        per_head_class(heads=6)


def test_a_list_holds_at_most_the_checked_number_of_heads() -> None:
    ExprParam(shape=["heads"], init=[0.5] * MAX_EXPR_INIT_HEADS)
    with pytest.raises(ValidationError, match=f"holds 1 to {MAX_EXPR_INIT_HEADS}"):
        ExprParam(shape=["heads"], init=[0.5] * (MAX_EXPR_INIT_HEADS + 1))
    with pytest.raises(ValidationError, match="holds 1 to"):
        ExprParam(shape=["heads"], init=[])
