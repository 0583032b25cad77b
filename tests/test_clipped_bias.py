"""A trained bias that is constant past a distance (T5's buckets past max_distance) on
the CPU: ``clipped_bias_attention`` runs FlashAttention with the bias as a view and gets
the bias's gradient from a band of diagonals and two triangles. Outputs and gradients
are checked against softmax(q kᵀ s + c[clamp(j - i, -K, K)]) v written out in float64
here, and the modules that take the path against their eager oracle.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import (
    assert_sdpa_matches_eager,
    generated_class,
    run_backend,
    runtime_modules,
    runtime_value,
    set_runtime,
    spec_variant,
    spy_calls,
    spy_query_shapes,
)

trained = importlib.import_module("generated._trained_bias")
masks = importlib.import_module("generated._masks")


def formula(q, k, v, clipped, scale: float, causal: bool) -> torch.Tensor:
    """softmax(q kᵀ scale + c[clamp(j - i, -K, K)]) v, the queries being the last N of the
    M keys, with every score written out: [B, H, N, value_dim]."""
    n, m = q.shape[2], k.shape[2]
    clip = (clipped.shape[1] - 1) // 2
    distance = torch.arange(m)[None, :] - (torch.arange(n)[:, None] + m - n)  # key - query
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores + clipped[:, distance.clamp(-clip, clip) + clip]
    if causal:
        scores = scores.masked_fill(distance > 0, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _inputs(n: int, m: int, clip: int, dtype=torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, n, 8, generator=generator, dtype=dtype)
    k, v = (torch.randn(2, 3, m, 8, generator=generator, dtype=dtype) for _ in range(2))
    clipped = torch.randn(3, 2 * clip + 1, generator=generator, dtype=dtype)
    weight = torch.randn(2, 3, n, 8, generator=generator, dtype=dtype)  # d loss / d out
    return [t.requires_grad_() for t in (q, k, v, clipped)], weight


def _outputs_and_gradients(attend, leaves, weight):
    out = attend(*leaves)
    return out.detach(), torch.autograd.grad((out * weight).sum(), leaves)


def _assert_matches_formula(n, m, clip, causal, dtype=torch.float64, tolerance=None):
    leaves, weight = _inputs(n, m, clip, dtype)
    got, got_grads = _outputs_and_gradients(
        lambda q, k, v, c: trained.clipped_bias_attention(q, k, v, c, 0.3, causal), leaves, weight
    )
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want, want_grads = _outputs_and_gradients(
        lambda q, k, v, c: formula(q, k, v, c, 0.3, causal), wide, weight.double()
    )
    tolerance = tolerance or {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(got.double(), want, **tolerance)
    for name, g, w in zip(("q", "k", "v", "clipped"), got_grads, want_grads, strict=True):
        torch.testing.assert_close(
            g.double(), w, **tolerance, msg=lambda text, name=name: name + text
        )


CASES = [  # (n, m, clip): far regions on both sides, queries the last N of M, no far region
    (37, 37, 5),
    (20, 37, 5),
    (9, 12, 5),
    (37, 37, 40),
    (30, 30, 29),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "clip"), CASES)
def test_clipped_bias_attention_matches_the_formula(n, m, clip, causal, monkeypatch) -> None:
    # small band steps and causal chunks, so that several of each (and short last ones) run
    monkeypatch.setattr(trained, "CLIPPED_BIAS_BAND_ROWS", 7)
    monkeypatch.setitem(masks.SDPA_QUERY_CHUNK, "cpu", 8)
    _assert_matches_formula(n, m, clip, causal)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 40),
    extra_keys=st.integers(0, 20),
    clip=st.integers(1, 45),
    causal=st.booleans(),
    band_rows=st.integers(1, 50),
    query_chunk=st.integers(1, 50),
)
def test_any_clip_band_and_chunking_match_the_formula(
    n, extra_keys, clip, causal, band_rows, query_chunk
) -> None:
    chunks = dict(masks.SDPA_QUERY_CHUNK)
    saved_rows = trained.CLIPPED_BIAS_BAND_ROWS
    masks.SDPA_QUERY_CHUNK["cpu"] = query_chunk
    trained.CLIPPED_BIAS_BAND_ROWS = band_rows
    try:
        _assert_matches_formula(n, n + extra_keys, clip, causal)
    finally:
        masks.SDPA_QUERY_CHUNK.clear()
        masks.SDPA_QUERY_CHUNK.update(chunks)
        trained.CLIPPED_BIAS_BAND_ROWS = saved_rows


@pytest.mark.parametrize(("n", "m", "clip"), [(6, 6, 6), (4, 6, 6), (6, 6, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_entries_no_pair_reads_get_exactly_zero_gradient(n, m, clip, causal) -> None:
    # every |key - query| < clip: the far entries (and, causal, the later keys) are unused
    leaves, weight = _inputs(n, m, clip)
    out = trained.clipped_bias_attention(*leaves, 0.3, causal)
    (grad,) = torch.autograd.grad((out * weight).sum(), leaves[3])
    distance = torch.arange(-clip, clip + 1)
    unused = (distance <= -m) | (distance >= n) | (distance.abs() == clip)
    if causal:
        unused |= distance > 0
    assert torch.equal(grad[:, unused], torch.zeros_like(grad[:, unused]))
    assert (grad[:, ~unused] != 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_clipped_bias_attention_in_float32_stays_within_float32_error(causal) -> None:
    # long rows: the far side's gradient is minus the rest of each zero row sum
    _assert_matches_formula(300, 300, 8, causal, torch.float32, {"rtol": 1e-4, "atol": 2e-5})


def _clipped(name: str, **replace: str) -> type[torch.nn.Module]:
    """``name`` with 8 buckets clipped at distance 8 (so the path serves short
    sequences), and any other replacements."""
    clip = [("buckets: 32", "buckets: 8"), ("max_distance: 128", "max_distance: 8")]
    replacements = [*clip, *replace.items()]
    return spec_variant(name, *replacements, name=f"{name}_clipped_at_8")


@pytest.mark.parametrize("name", ["t5", "t5_decoder"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), [(70, 70, 4), (50, 80, 2), (64, 64, 1)])
def test_t5_training_takes_the_clipped_path_and_matches_eager(
    name, causal, n, m, kv_heads, monkeypatch
) -> None:
    pe = _clipped(name)(heads=4, head_dim=8).double()
    monkeypatch.setitem(runtime_value("SDPA_QUERY_CHUNK", pe), "cpu", 16)
    set_runtime(monkeypatch, "CLIPPED_BIAS_BAND_ROWS", 16, pe)
    route = spy_query_shapes(monkeypatch, pe, "clipped_bias_attention")
    assert pe.clipped_distance == 8
    assert_sdpa_matches_eager(pe, n, m, kv_heads, causal=causal)
    assert route == [(2, 4, n, 8)]  # the sdpa call, not the eager one


def test_a_bias_inside_the_scale_is_scaled_on_the_clipped_path(monkeypatch) -> None:
    cls = _clipped(
        "t5",
        **{
            "scale: none ": "scale: inv_sqrt_head_dim ",
            "placement: after_scale": "placement: before_scale",
        },
    )
    pe = cls(heads=4, head_dim=8).double()
    route = spy_query_shapes(monkeypatch, pe, "clipped_bias_attention")
    assert pe.position_bias_inside_scale and pe.scale != 1.0
    assert_sdpa_matches_eager(pe, 70, 70, 4)
    assert route


def test_the_catalogue_t5_serves_from_eight_clip_distances_of_keys(monkeypatch) -> None:
    pe = generated_class("t5")(heads=2, head_dim=8).double()
    route = spy_query_shapes(monkeypatch, pe, "clipped_bias_attention")
    assert pe.clipped_distance == 128
    min_keys = trained.CLIPPED_BIAS_MIN_KEYS_PER_CLIP * 128
    for m in (min_keys - 1, min_keys):
        q, k, v = (torch.randn(1, 2, m, 8, dtype=torch.float64) for _ in range(3))
        pe(q, k, v, backend="sdpa").sum().backward()
    assert route == [(1, 2, min_keys, 8)]


@pytest.mark.parametrize("value_dim", [5, 12])
def test_values_of_another_width_train_off_the_clipped_path(value_dim, monkeypatch) -> None:
    """The CPU flash kernel needs values as wide as the queries: T5 trained with values
    of another width (a RuntimeError from SDPA before) takes the chunked path, as eager."""
    pe = _clipped("t5")(heads=4, head_dim=8).double()
    route = spy_query_shapes(monkeypatch, pe, "clipped_bias_attention")
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 70, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 4, 70, value_dim, generator=generator, dtype=torch.float64)
    for causal in (False, True):
        outputs = {}
        for backend in ("eager", "sdpa", "auto"):
            pe.zero_grad()
            out = pe(q, k, v, backend=backend, causal=causal)
            out.square().sum().backward()
            grads = [p.grad.clone() for p in pe.parameters()]
            outputs[backend] = (out.detach(), grads)
        for backend in ("sdpa", "auto"):
            torch.testing.assert_close(outputs[backend], outputs["eager"], rtol=1e-9, atol=1e-10)
    assert route == []


def test_the_clipped_path_is_for_training_the_table_in_full_precision(monkeypatch) -> None:
    pe = _clipped("t5")(heads=4, head_dim=8)
    route = spy_query_shapes(monkeypatch, pe, "clipped_bias_attention")
    q, k, v = (torch.randn(1, 4, 70, 8, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        pe(q, k, v, backend="sdpa")
    pe(q, k, v, backend="sdpa", window=20)  # a window: the chunked path skips its keys
    pe(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="sdpa")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pe(q, k, v, backend="sdpa")
    pe.requires_grad_(False)  # a frozen table: SDPA's flash kernel with the bias as a mask
    pe(q, k, v, backend="sdpa")
    assert route == []
    pe.requires_grad_(True)
    pe(q, k, v, backend="sdpa")
    assert route == [(1, 4, 70, 8)]


def test_the_clipped_path_traces_whole_under_compile(monkeypatch) -> None:
    pe = _clipped("t5")(heads=4, head_dim=8).double()
    route = spy_query_shapes(monkeypatch, pe, "clipped_bias_attention")
    inputs = {
        key: torch.randn(
            1, 4, 70, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
        )
        for key in ("q", "k", "v")
    }
    compiled = torch.compile(pe, fullgraph=True, backend="aot_eager", dynamic=False)
    got, got_grads = run_backend(compiled, inputs, "sdpa", causal=True)
    want, want_grads = run_backend(pe, inputs, "eager", causal=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    assert route


# ---- flex: the bias read per score as a constant, its gradient attached ----


def _flex_route(pe: torch.nn.Module, monkeypatch, devices=("cpu",)) -> list[int]:
    """Turn the flex route on for ``devices`` and count its gradient attachments."""
    set_runtime(monkeypatch, "CLIPPED_BIAS_FLEX_DEVICES", set(devices), pe)
    return spy_calls(
        monkeypatch,
        runtime_modules(pe),
        "attach_clipped_bias_gradient",
        lambda out, *_: out.shape[2],
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", ["t5", "t5_decoder"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), [(70, 70, 4), (40, 80, 2), (64, 64, 1)])
def test_flex_trains_a_clipped_bias_through_the_attached_gradient(
    name, causal, n, m, kv_heads, monkeypatch
) -> None:
    pe = _clipped(name)(heads=4, head_dim=8).double()
    set_runtime(monkeypatch, "CLIPPED_BIAS_BAND_ROWS", 16, pe)
    calls = _flex_route(pe, monkeypatch)
    generator = torch.Generator().manual_seed(4)
    shapes = {"q": (2, 4, n, 8), "k": (2, kv_heads, m, 8), "v": (2, kv_heads, m, 8)}
    inputs = {
        key: torch.randn(*shape, generator=generator, dtype=torch.float64)
        for key, shape in shapes.items()
    }
    got, got_grads = run_backend(pe, inputs, "flex", causal=causal)
    want, want_grads = run_backend(pe, inputs, "eager", causal=causal)
    assert calls == [n]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert len(got_grads) == len(want_grads) == 4  # q, k, v and the table
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_with_the_clipped_gradient_in_bfloat16_stays_within_bfloat16_error(
    monkeypatch,
) -> None:
    pe = _clipped("t5")(heads=4, head_dim=8)
    calls = _flex_route(pe, monkeypatch)
    half = {key: torch.randn(2, 4, 80, 8).bfloat16() for key in ("q", "k", "v")}
    got, got_grads = run_backend(pe, half, "flex", causal=True)
    # the eager oracle on the same bf16 inputs: float32 inside, a bf16 output (so the
    # loss and the gradient into the output are rounded alike)
    want, want_grads = run_backend(pe, half, "eager", causal=True)
    assert calls == [80]
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    *qkv, table = got_grads
    for g, w in zip(qkv, want_grads[:3], strict=True):  # bf16 gradients
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2 * w.abs().max().item())
    # the table trains in float32: its gradient is summed in float32 from float32 terms
    torch.testing.assert_close(table, want_grads[3], rtol=1e-5, atol=1e-5 * table.abs().max())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_keeps_the_distance_vector_where_the_route_is_off(monkeypatch) -> None:
    pe = _clipped("t5")(heads=4, head_dim=8)
    calls = _flex_route(pe, monkeypatch, devices=())
    q, k, v = (torch.randn(1, 4, 70, 8, requires_grad=True) for _ in range(3))
    pe(q, k, v, backend="flex").sum().backward()
    assert calls == []
    assert pe.relative_attention_bias.weight.grad is not None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_route_traces_whole_under_compile(monkeypatch) -> None:
    pe = _clipped("t5")(heads=4, head_dim=8).double()
    calls = _flex_route(pe, monkeypatch)
    generator = torch.Generator().manual_seed(3)
    inputs = {
        key: torch.randn(1, 4, 70, 8, dtype=torch.float64, generator=generator)
        for key in ("q", "k", "v")
    }
    compiled = torch.compile(pe, fullgraph=True, backend="aot_eager", dynamic=False)
    for causal in (False, True):
        got, got_grads = run_backend(compiled, inputs, "flex", causal=causal)
        want, want_grads = run_backend(pe, inputs, "eager", causal=causal)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    assert calls  # traced through the route
