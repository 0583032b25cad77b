"""Edge cases of forward's masking semantics across backends, against softmax(scores + mask) v.

ALiBi's logits are written out here (q·k / sqrt(d) − slope_h·|i − j|, slopes 2^(−8h/H))
and the masking and softmax done in float64, independently of the runtime: fully masked
rows (zeros, zero gradients), attn_mask shapes that broadcast, causal at explicit
positions that are non-monotone, repeated, batched or in small integer dtypes (a key is
masked where its position is greater than the query's), more queries than keys,
grouped-query heads from expanded and transposed views, and gradients into q, k, v and a
float mask. Other position terms are compared with the eager oracle on the same cases.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from tests.conftest import generated_class

BACKENDS = ("eager", "sdpa", "auto")
B, H, KV, D = 2, 4, 2, 16


def alibi_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_positions: Tensor,
    k_positions: Tensor,
    causal: bool,
    attn_mask: Tensor | None,
) -> Tensor:
    """softmax(q·k / sqrt(d) − slope·|i − j| + masks) v in float64, a fully masked row 0."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    heads = q.shape[1]
    slopes = torch.tensor([2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)])
    qp = q_positions.long().reshape(-1, 1, q.shape[2], 1).double()
    kp = k_positions.long().reshape(-1, 1, 1, k.shape[2]).double()
    logits = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits = logits - slopes.double().view(1, -1, 1, 1) * (qp - kp).abs()
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    if causal:
        allowed = allowed & (kp <= qp)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = allowed & attn_mask
    elif attn_mask is not None:
        logits = logits + attn_mask.double()
    logits = logits.masked_fill(~allowed, float("-inf"))
    top = logits.amax(-1, keepdim=True)
    empty = torch.isneginf(top)
    weights = torch.exp(logits - torch.where(empty, 0.0, top))
    total = weights.sum(-1, keepdim=True)
    weights = torch.where(empty, 0.0, weights / torch.where(empty, 1.0, total))
    return weights @ v


def _inputs(n: int, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """q transposed from [B, N, H, D]; k and v with KV heads, v an expanded view."""
    q = torch.randn(B, n, H, D, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, KV, m, D, dtype=torch.float64)
    v = torch.randn(B, 1, m, D // 2, dtype=torch.float64).expand(B, KV, m, D // 2)
    return q, k, v


def _cases() -> dict[str, tuple[int, int, dict[str, object]]]:
    """name: (N, M, forward's keyword arguments)."""
    g = torch.Generator().manual_seed(1)
    n, m = 5, 7
    row_masked = torch.rand(n, m, generator=g) > 0.3
    row_masked[1] = False
    float_mask = torch.randn(B, 1, n, m, dtype=torch.float64, generator=g)
    float_mask = float_mask.masked_fill(torch.rand(B, 1, n, m, generator=g) < 0.3, float("-inf"))
    float_mask[1, :, 2] = float("-inf")
    padding = torch.ones(B, 1, 1, m, dtype=torch.bool)
    padding[1, ..., :3] = False
    per_head = torch.rand(B, H, n, m, generator=g) > 0.5
    per_head[0, 3, 4] = False
    return {
        "bool [N, M], a row masked": (n, m, {"attn_mask": row_masked}),
        "float [B, 1, N, M], a row -inf": (n, m, {"attn_mask": float_mask, "causal": True}),
        "[1, 1, N, M]": (n, m, {"attn_mask": row_masked[None, None]}),
        "[B, 1, 1, M] padding": (n, m, {"attn_mask": padding, "causal": True}),
        "[B, H, N, M]": (n, m, {"attn_mask": per_head}),
        "[M]": (n, m, {"attn_mask": row_masked[0]}),
        "non-monotone repeated int16": (
            n,
            m,
            {
                "q_positions": torch.tensor([3, 0, 3, 9, 1], dtype=torch.int16),
                "k_positions": torch.tensor([2, 2, 0, 5, 1, 3, 3], dtype=torch.int16),
                "causal": True,
            },
        ),
        "batched uint8, a query before every key": (
            n,
            m,
            {
                "q_positions": torch.tensor([[0, 4, 4, 8, 6], [9, 1, 0, 2, 2]], dtype=torch.uint8),
                "k_positions": torch.tensor(
                    [[1, 2, 3, 4, 5, 6, 7], [6, 5, 4, 3, 2, 1, 1]], dtype=torch.uint8
                ),
                "causal": True,
                "attn_mask": padding,
            },
        ),
        "N > M, causal": (
            6,
            2,
            {
                "q_positions": torch.tensor([0, 1, 2, 3, 4, 5]),
                "k_positions": torch.tensor([2, 4]),
                "causal": True,
            },
        ),
        "N = M = 1, masked by causal": (
            1,
            1,
            {"q_positions": torch.tensor([0]), "k_positions": torch.tensor([3]), "causal": True},
        ),
    }


CASES = _cases()


def _positions(n: int, m: int, kwargs: dict[str, object]) -> tuple[Tensor, Tensor]:
    """The positions forward reads: the given ones, else keys 0 … M − 1, queries the last N."""
    k_positions = kwargs.get("k_positions", torch.arange(m))
    q_positions = kwargs.get("q_positions", torch.arange(m - n, m))
    assert isinstance(q_positions, Tensor) and isinstance(k_positions, Tensor)
    return q_positions, k_positions


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_alibi_matches_the_formula_with_gradients(case: str, backend: str) -> None:
    n, m, kwargs = CASES[case]
    module = generated_class("alibi")(heads=H, head_dim=D).double()
    q, k, v = _inputs(n, m)
    mask = kwargs.get("attn_mask")
    assert mask is None or isinstance(mask, Tensor)
    trained_mask = mask is not None and mask.dtype != torch.bool
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if trained_mask:
        assert mask is not None
        leaves.append(mask.clone().requires_grad_())
        ref_leaves.append(mask.clone().requires_grad_())
    given = {**kwargs, "attn_mask": leaves[3] if trained_mask else mask}
    out = module(*leaves[:3], backend=backend, **given)
    q_positions, k_positions = _positions(n, m, kwargs)
    expected = alibi_reference(
        *ref_leaves[:3],
        q_positions,
        k_positions,
        bool(kwargs.get("causal", False)),
        ref_leaves[3] if trained_mask else mask,
    )
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    weights = torch.randn(expected.shape, dtype=torch.float64)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(
    "name",
    ["t5", "kerple_log", "fire", "bert_relative_key", "deberta", "transformer_xl", "cope", "shaw"],
)
def test_backends_agree_with_eager_on_the_edge_cases(name: str) -> None:
    cls = generated_class(name)
    module = (
        cls(heads=H, head_dim=D, value_dim=D // 2) if name == "shaw" else cls(heads=H, head_dim=D)
    )
    module = module.double()
    for case, (n, m, kwargs) in CASES.items():
        q, k, v = _inputs(n, m)
        results = {}
        for backend in BACKENDS:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = module(*leaves, backend=backend, **kwargs)
            out.pow(2).sum().backward()
            grads = [leaf.grad for leaf in leaves]
            grads += [p.grad for p in module.parameters()]
            module.zero_grad(set_to_none=True)
            results[backend] = (out.detach(), grads)
        for backend in BACKENDS[1:]:
            out, grads = results[backend]
            torch.testing.assert_close(out, results["eager"][0], atol=1e-10, rtol=1e-9, msg=case)
            for got, want in zip(grads, results["eager"][1], strict=True):
                assert (got is None) == (want is None), case
                if got is not None:
                    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-8, msg=case)
