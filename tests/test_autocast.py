"""The sdpa backend under CPU autocast (bfloat16) with float32 q, k and v, against the
eager oracle (float32 with autocast off; tests/test_runtime_contract.py):

- a decode step's few queries through ``grouped_query_attention``'s matmuls (a bias's
  flushed rows, grouped-query heads from 2^17 key elements) run with autocast off and
  return autocast's dtype, as the prefill's SDPA does; the terms they read are built
  with autocast off too (``_sdpa_bias``), so the result is the float32 one rounded once;
- CoPE's dense terms (a few queries) and its counted-position node (from
  ``COUNTED_MIN_QUERIES``) build their terms with autocast off, forward and backward.

Outputs and gradients are compared within bfloat16's error: 3e-2 of the reference's
largest entry.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import (
    generated_class,
    head_dim_for,
    runtime_modules,
    runtime_value,
    spec_names,
    spy_calls,
)

BF16 = torch.bfloat16
TOLERANCE = 3e-2


def _module(name: str, heads: int, head_dim: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return generated_class(name)(heads=heads, head_dim=head_dim)


def _qkv(
    heads: int, kv_heads: int, n: int, m: int, head_dim: int, batch: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, n, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, m, head_dim, generator=generator)
    v = torch.randn(batch, kv_heads, m, head_dim, generator=generator)
    return q, k, v


def _assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """got within bfloat16's error of want (float32): TOLERANCE of want's scale."""
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    torch.testing.assert_close(
        got.float(), want, rtol=TOLERANCE, atol=TOLERANCE * scale, check_dtype=False
    )


def _outputs_and_grads(
    pe: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    autocast: bool,
    **options: Any,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output (sdpa under autocast, or eager without) and the gradients of a fixed
    weighting of it into q, k, v and the parameters it reaches, the backward run inside
    the same autocast state."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    pe.zero_grad()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = pe(*leaves, backend="sdpa" if autocast else "eager", **options)
        weighting = torch.linspace(-1, 1, out.numel()).view_as(out)
        (out.float() * weighting).sum().backward()
    grads = []
    for t in leaves:
        assert t.grad is not None
        grads.append(t.grad)
    grads += [p.grad for p in pe.parameters() if p.grad is not None]
    return out.detach(), grads


def _assert_matches_eager(
    pe: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.dtype:
    """sdpa under autocast against eager without: outputs and gradients; returns the
    output's dtype."""
    want, want_grads = _outputs_and_grads(pe, q, k, v, autocast=False, **options)
    got, got_grads = _outputs_and_grads(pe, q, k, v, autocast=True, **options)
    _assert_near(got, want)
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads, strict=True):
        _assert_near(a, b)
    return got.dtype


SPACED = torch.arange(64) * 2  # explicit positions: T5's per-pair bias (no shallow vector)

# (name, batch, heads, key-value heads, decode queries, keys, head_dim, positions): each
# step takes the matmuls (at most GROUPED_QUERY_MAX_ROWS = 16 query rows per key-value
# head): a bias's rows where SDPA would need a floor (T5 at one query, or at explicit
# positions, where its vector is not known to be shallow; ALiBi past its first 80
# keys), RoPE with grouped heads from GROUPED_QUERY_MIN_KEY_ELEMENTS (8 x 2 x 128 x 64)
DECODE_STEPS = [
    ("t5", 1, 4, 4, 1, 64, 16, False),
    ("t5", 1, 4, 4, 16, 64, 16, True),
    ("t5", 1, 8, 2, 4, 64, 16, True),
    ("alibi", 1, 4, 4, 1, 256, 16, False),
    ("alibi", 1, 4, 4, 16, 256, 16, False),
    ("alibi", 1, 8, 2, 4, 256, 16, False),
    ("rope", 8, 8, 2, 1, 128, 64, False),
    ("rope", 8, 8, 2, 4, 128, 64, False),
]


@pytest.mark.parametrize(
    ("name", "batch", "heads", "kv_heads", "n", "m", "head_dim", "explicit"),
    DECODE_STEPS,
    ids=[f"{s[0]}-{s[2]}on{s[3]}-n{s[4]}" + ("-positions" if s[7] else "") for s in DECODE_STEPS],
)
def test_prefill_and_decode_steps_under_autocast(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    batch: int,
    heads: int,
    kv_heads: int,
    n: int,
    m: int,
    head_dim: int,
    explicit: bool,
) -> None:
    """The prefill (SDPA) and a decode step of n queries against its keys (the
    matmuls) give the same dtype, each within bfloat16's error of eager float32,
    forward and backward."""
    pe = _module(name, heads, head_dim)
    q, k, v = _qkv(heads, kv_heads, m, m, head_dim, batch)
    prefill = _assert_matches_eager(pe, q, k, v, causal=True)
    assert prefill == BF16  # SDPA under autocast
    steps = spy_calls(
        monkeypatch, runtime_modules(pe), "grouped_query_attention", lambda q, *_, **__: q.shape
    )
    options: dict[str, Any] = {"causal": True}
    if explicit:
        options.update(q_positions=SPACED[m - n : m], k_positions=SPACED[:m])
    step = _assert_matches_eager(pe, q[:, :, m - n :], k, v, **options)
    assert step == prefill
    assert steps and all(shape == (batch, heads, n, head_dim) for shape in steps)


@pytest.mark.parametrize("name", ["t5", "fire", "kerple_log", "tupe_r"])
def test_decode_matmuls_under_autocast_are_the_float32_step_rounded_once(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The matmuls run with autocast off on a bias built with it off (``_sdpa_bias``,
    ``_sdpa_by_distance``: FIRE's MLP, TUPE's projections in float32), so a decode
    step under autocast is the step without it, rounded once to bfloat16."""
    pe = _module(name, 4, 16)
    q, k, v = _qkv(4, 4, 1, 64, 16)
    steps = spy_calls(
        monkeypatch, runtime_modules(pe), "grouped_query_attention", lambda *_, **__: 1
    )
    plain = pe(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=BF16):
        got = pe(q, k, v, causal=True)
    assert steps == [1, 1]
    assert got.dtype == BF16
    torch.testing.assert_close(got, plain.to(BF16), rtol=0, atol=0)


@pytest.mark.parametrize("n", [4, 40, 1100])
def test_cope_under_autocast(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """CoPE under autocast: a few queries' dense terms, and from COUNTED_MIN_QUERIES
    (6) the counted-position node (1100: several chunks of queries), forward and
    backward (run inside autocast), within bfloat16's error of eager float32, in the
    dtype that a decode step of one query gives."""
    pe = _module("cope", 2, 8)
    with torch.no_grad():
        pe.cope_positions.normal_(std=0.5)  # a term the size of the content logits
    m = max(n, 64)
    q, k, v = _qkv(2, 2, m, m, 8)
    counted = spy_calls(
        monkeypatch, runtime_modules(pe), "counted_position_attention", lambda *_: 1
    )
    dtype = _assert_matches_eager(pe, q[:, :, m - n :], k, v, causal=True)
    assert bool(counted) == (n >= runtime_value("COUNTED_MIN_QUERIES", pe))
    assert dtype == _assert_matches_eager(pe, q[:, :, m - 1 :], k, v, causal=True)


@pytest.mark.parametrize("name", spec_names())
def test_output_dtype_under_autocast_follows_sdpa_on_every_backend_but_eager(name: str) -> None:
    """Under autocast, "sdpa" and "auto" return the dtype F.scaled_dot_product_attention
    returns there (bfloat16 for float32 inputs), whatever path computed them (the
    relative family and CoPE compute with autocast off); "eager" stays the float32
    oracle. Before, the relative family returned float32 on "sdpa" and biases bfloat16."""
    pe = generated_class(name)(heads=2, head_dim=head_dim_for(name, 8)).eval()
    q, k, v = _qkv(2, 2, 6, 6, pe.head_dim)
    v = v[..., : getattr(pe, "value_dim", pe.head_dim)]
    with torch.autocast("cpu", dtype=BF16):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).dtype
        outputs = {b: pe(q, k, v, causal=True, backend=b) for b in ("sdpa", "auto", "eager")}
    assert expected == BF16
    assert outputs["sdpa"].dtype == outputs["auto"].dtype == BF16
    assert outputs["eager"].dtype == torch.float32
    plain = pe(q, k, v, causal=True, backend="eager")
    _assert_near(outputs["sdpa"], plain)


# (name, keys, causal, grad): each path that makes its own products (the trained-mask
# chunks, the clipped and chunked relative terms, Shaw's weights for its value term)
PRECISION_CASES = [
    ("t5", 48, False, True),
    ("t5_decoder", 1100, True, True),
    ("kerple_log", 48, False, True),
    ("fire", 1100, False, True),
    ("shaw", 1100, False, False),
    ("bert_relative_key", 1100, False, True),
    ("bert_relative_key_query", 1100, False, True),
    ("deberta", 48, False, False),
    ("transformer_xl", 300, True, True),
    ("alibi", 300, False, False),
]


@pytest.mark.parametrize(("name", "m", "causal", "grad"), PRECISION_CASES)
def test_sdpa_under_autocast_is_as_precise_as_bfloat16_inputs(
    name: str, m: int, causal: bool, grad: bool
) -> None:
    """sdpa under autocast (float32 inputs) is no farther from eager float32 than the
    same call on inputs given in bfloat16: autocast rounds q, k and v, never the
    logits. T5's trained-mask chunks had computed q kᵀ in bfloat16 under autocast
    (3.5e-2 off against 1.0e-2 from bfloat16 inputs), and the relative family's own
    products had too (Shaw 1.5e-2 against 5.7e-3)."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=32)
    q, k, v = _qkv(4, 4, m, m, 32)
    with torch.set_grad_enabled(grad):
        want = pe(q, k, v, causal=causal, backend="eager")
        with torch.autocast("cpu", dtype=BF16):
            autocast = pe(q, k, v, causal=causal, backend="sdpa")
        inputs = pe(q.to(BF16), k.to(BF16), v.to(BF16), causal=causal, backend="sdpa")

    def error(got: torch.Tensor) -> float:
        return ((got.float() - want).abs().max() / want.abs().max()).item()

    assert autocast.dtype == inputs.dtype == BF16
    assert error(autocast) <= 1.5 * error(inputs) + 2e-3
