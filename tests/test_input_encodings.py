"""Input-level encodings and the no-position baseline, against float64 references.

Each encoding of the input family (positions entering through ``embed``) is checked
against an independent float64 implementation in tests/reference/ (absolute.py, and the
pinned formulas.py), plus the behaviour of its ``embed``: shapes, dtype kept, clear
ValueError for bad input, gradients reaching the trained parameters.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import generated_class
from tests.reference import absolute as ref_abs
from tests.reference import formulas as ref

F64 = torch.float64


def make(name: str, **overrides) -> torch.nn.Module:
    return generated_class(name)(**overrides).eval()


# ------------------------------------------------------------------------------ NoPE


def test_nope_logits_are_plain_scaled_dot_products() -> None:
    pe = make("nope", heads=3, head_dim=16)
    q = torch.randn(2, 3, 5, 16, dtype=F64)
    k = torch.randn(2, 3, 7, 16, dtype=F64)
    expected = ref_abs.plain_logits(q, k, 1.0 / math.sqrt(16))
    torch.testing.assert_close(pe.scores(q, k), expected, atol=1e-12, rtol=1e-12)
    # positions change nothing: any explicit positions give the same logits
    shifted = pe.scores(q, k, q_positions=torch.arange(100, 105),
                        k_positions=torch.tensor([9, 3, 0, 7, 1, 2, 5]))
    torch.testing.assert_close(shifted, expected, atol=1e-12, rtol=1e-12)
    assert set(pe.score_terms(q, k)) == {"content_content"}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_nope_causal_attention_matches_reference(backend: str) -> None:
    pe = make("nope", heads=2, head_dim=8)
    q = torch.randn(2, 2, 4, 8, dtype=F64)
    k = torch.randn(2, 2, 6, 8, dtype=F64)
    v = torch.randn(2, 2, 6, 5, dtype=F64)
    expected = ref.attention(q, k, v, scale=1 / math.sqrt(8),
                             causal_q_positions=torch.arange(2, 6),
                             causal_k_positions=torch.arange(6))
    out = pe(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
    # the first query (position 2) sees keys 0..2 only: changing key 5 leaves it alone
    k2, v2 = k.clone(), v.clone()
    k2[..., 5, :] += 10.0
    v2[..., 5, :] -= 3.0
    out2 = pe(q, k2, v2, causal=True, backend=backend)
    torch.testing.assert_close(out2[..., :3, :], out[..., :3, :])
    assert not torch.allclose(out2[..., 3, :], out[..., 3, :])


def test_nope_without_mask_is_permutation_equivariant() -> None:
    """No position term: permuting keys and values together leaves every output unchanged."""
    pe = make("nope", heads=2, head_dim=8)
    q = torch.randn(1, 2, 5, 8, dtype=F64)
    k = torch.randn(1, 2, 5, 8, dtype=F64)
    v = torch.randn(1, 2, 5, 3, dtype=F64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    out = pe(q, k, v, backend="eager")
    torch.testing.assert_close(pe(q, k[:, :, perm], v[:, :, perm], backend="eager"), out)
    torch.testing.assert_close(pe(q[:, :, perm], k, v, backend="sdpa"), out[:, :, perm])


def test_nope_has_no_parameters_and_identity_parts() -> None:
    pe = make("nope")
    assert list(pe.parameters()) == []
    x = torch.randn(2, 3, 10)
    assert pe.embed(x) is x
    q, k = torch.randn(1, 8, 3, 64), torch.randn(1, 8, 3, 64)
    assert pe.rotate(q, k) == (q, k)
    assert pe.score_bias(torch.arange(3), torch.arange(3)) is None
