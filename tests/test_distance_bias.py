"""Biases of j - i alone (ALiBi, T5) on the sdpa backend: a per-distance vector viewed
as the mask with queries reversed, never an [H, N, M] tensor; outputs and gradients equal
the eager oracle's."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import (
    assert_sdpa_matches_eager,
    generated_class,
    runtime_modules,
    set_runtime,
    spec_names,
    spy_calls,
)

runtime = importlib.import_module("generated._sdpa_backend")
chunks = importlib.import_module("generated._sdpa_chunks")
distances = importlib.import_module("generated._distances")
caches = importlib.import_module("generated._caches")
NAMES = ["alibi", "t5", "t5_decoder"]


def _module(name: str, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return generated_class(name)(heads=heads, head_dim=8).double()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "m", "kv_heads"), [(6, 6, 4), (3, 9, 2), (1, 12, 1)])
def test_sdpa_by_distance_matches_eager_with_gradients(
    name: str, causal: bool, n: int, m: int, kv_heads: int
) -> None:
    assert_sdpa_matches_eager(_module(name), n, m, kv_heads, causal=causal)


def test_diagonal_view_backward_is_the_sum_of_each_diagonal() -> None:
    n, m = 5, 7
    vec = torch.randn(3, n + m - 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: distances.query_reversed_bias(x, n, m), (vec,))
    grad = torch.randn(3, n, m, dtype=torch.float64)
    (got,) = torch.autograd.grad(distances.expand_distance_bias(vec, n, m), vec, grad)
    want = torch.zeros_like(got)
    for i in range(n):
        for j in range(m):
            want[:, j - i + n - 1] += grad[:, i, j]  # query i, key j: distance j - i - (m - n)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "name", [name for name in spec_names() if generated_class(name).bias_by_distance]
)
def test_decode_step_mask_has_contiguous_keys(name: str, monkeypatch) -> None:
    """One query against the cache (a decode step) reads its per-distance vector as the
    mask's one row: its keys must be contiguous (stride 1), which CUDA's fused SDPA
    kernels require of a mask; T5's vector came heads innermost (key stride H) and every
    T5 decode step on an H200 fell to SDPA's math kernel (22x plain SDPA)."""
    pe = generated_class(name)(heads=4, head_dim=8)
    set_runtime(monkeypatch, "GROUPED_QUERY_DEVICES", set())  # SDPA, as on CUDA
    masks = spy_calls(
        monkeypatch,
        runtime_modules(pe),
        "scaled_dot_product",  # SDPA's one caller: the mask goes to it unchanged
        lambda q, k, v, mask, *_, **__: (tuple(mask.shape), mask.stride(-1)),
    )
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 40, 8)  # grouped-query heads
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            pe(q.to(dtype), k.to(dtype), k.to(dtype))
    assert masks == [((1, 4, 1, 40), 1)] * 2  # [1, H, 1, M], key stride 1


@pytest.mark.parametrize("name", NAMES)
def test_sdpa_mask_is_a_view_of_a_per_distance_vector(name: str, monkeypatch) -> None:
    pe = generated_class(name)(heads=4, head_dim=8)
    n = m = 64
    seen = []  # the masks given to SDPA, or to trained-mask attention (a trained bias)
    original = runtime.F.scaled_dot_product_attention
    original_trained = chunks.trained_mask_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return original(*args, **kwargs)

    def spy_trained(q, k, v, mask, scale):
        seen.append(mask)
        return original_trained(q, k, v, mask, scale)

    monkeypatch.setattr(runtime.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(chunks, "trained_mask_attention", spy_trained)
    q = torch.randn(1, 4, n, 8)
    for causal in (False, True):
        pe(q, q, q, causal=causal, backend="sdpa")
    assert len(seen) == 2
    for mask in seen:
        assert mask.shape == (1, 4, n, m)
        assert mask.untyped_storage().nbytes() == 4 * (n + m - 1) * mask.element_size()
    for value in pe._cache.values():  # nothing cached grows with N * M
        parts = value if isinstance(value, tuple) else (value,)
        tensors = [part for part in parts if isinstance(part, torch.Tensor)]
        # a kept per-distance vector reaches back and ahead to powers of two: at most
        # twice the N + M - 1 distances, per head
        assert tensors and all(t.numel() <= 4 * 2 * (n + m) for t in tensors)


def test_a_kept_distance_vector_serves_every_shape_it_spans() -> None:
    """``distance_span_vector`` gives exactly the vector of (N, M)'s own distances, and
    makes a new one only when a call reaches past the kept one: in a decode loop (N = 1,
    M = 1 .. 40) only where M - 1 passes the power of two kept, and for a prefill of 20
    queries once, after which calls of 1 or 5 queries up to 64 keys fit."""
    made: list[tuple[int, int]] = []

    def of_distances(relative: torch.Tensor) -> torch.Tensor:  # [L] -> [2, L]
        made.append((int(relative[0]), int(relative[-1])))
        return torch.stack([relative * 3 + 1, relative.square()])

    cache: dict = {}
    calls = [(1, m) for m in range(1, 41)] + [(20, 40)] + [(n, m) for n in (1, 5) for m in (30, 64)]
    for n, m in calls:
        got = distances.distance_span_vector(cache, ("k",), n, m, torch.device("cpu"), of_distances)
        want_distances = torch.arange(-(m - 1), n)
        assert torch.equal(got, torch.stack([want_distances * 3 + 1, want_distances.square()]))
    # reached back 1, 2, 4, 8, 16, 32, 64 keys and 1 ahead during the loop (M - 1 = 0,
    # 2, 3, 5, 9, 17, 33), then 32 ahead for the prefill; the last calls fit the kept one
    back = [1, 2, 4, 8, 16, 32, 64]
    assert made == [(-reach, 1) for reach in back] + [(-64, 32)]


def test_arange_views_are_the_ranges_and_share_one_kept_vector() -> None:
    """``arange_view`` gives torch.arange(start, stop) (or its reverse) for ranges on
    either side of 0, and within the kept reach every call reads the same storage: a
    decode loop's ranges make no new vector until they pass the power of two kept."""
    cache: dict = {}
    device = torch.device("cpu")
    for descending in (False, True):
        first = caches.arange_view(cache, -16, 16, device, descending)  # a reach of 16
        storages = [first.untyped_storage().data_ptr()]
        for start, stop in [(0, 1), (0, 5), (-3, 4), (2, 9), (-16, 1), (5, 5), (0, 0), (7, 17)]:
            got = caches.arange_view(cache, start, stop, device, descending)
            want = torch.arange(start, stop)
            assert torch.equal(got, want.flip(0) if descending else want), (start, stop)
            storages.append(got.untyped_storage().data_ptr())
        assert len(set(storages)) == 1  # all within the reach of 16
        wider = caches.arange_view(cache, -20, 30, device, descending)
        assert torch.equal(
            wider, torch.arange(-20, 30).flip(0) if descending else torch.arange(-20, 30)
        )
        assert wider.untyped_storage().data_ptr() != storages[0]


def test_kept_index_ends_equal_the_index_at_the_ends() -> None:
    """``monotone_index_ends`` with a cache reads the least and largest rows from a host
    list kept over a span of distances: the same as DeBERTa's log buckets (and a clip)
    computed at the two end distances, for spans in either direction that grow past the
    kept reach, and the index is computed once per reach."""
    from generated.bert_relative_key import _relative_index as clip_index
    from generated.deberta import _relative_index as log_buckets

    spans = [(-(m - 1), n - 1) for m in (1, 2, 5, 40, 300, 1000) for n in (1, 3)]
    spans += [(0, 7), (-1, 0), (1 - 3, 600)]
    for index_of in (log_buckets, clip_index):
        computed: list[int] = []

        def counted(relative: torch.Tensor, index_of=index_of, computed=computed) -> torch.Tensor:
            computed.append(relative.numel())
            return index_of(relative)

        cache: dict = {}
        for first, last in spans:
            got = distances.monotone_index_ends(counted, first, last, cache, ("ends",))
            want = sorted(index_of(torch.tensor([first, last])).tolist())
            assert list(got) == want, (first, last)
        # reaches 1, 2, 4, 64, 512, 1024: the list made once per growth
        assert computed == [2 * reach + 1 for reach in (1, 2, 4, 64, 512, 1024)]


@pytest.mark.parametrize("name", ["alibi", "t5", "t5_decoder", "sandwich"])
def test_a_decode_loop_reads_its_bias_from_one_kept_vector(name: str) -> None:
    """A decode loop's bias per distance (one query, one key more each step, after a
    prefill), a slice of a vector kept from earlier steps, equals ``score_bias`` at the
    same positions given explicitly (a bias per pair, by another path)."""
    pe = _module(name)
    device = torch.device("cpu")
    shapes = [(16, 16)] + [(1, m) for m in range(17, 70)] + [(4, 70)]
    for n, m in shapes:
        vector = pe._distance_bias(n, m, device)  # [H, N + M - 1]
        assert vector.shape == (4, n + m - 1)
        per_pair = pe.score_bias(torch.arange(m - n, m), torch.arange(m))  # [H, N, M]
        torch.testing.assert_close(
            distances.expand_distance_bias(vector, n, m), per_pair, rtol=1e-12, atol=1e-12
        )


def _flagged_at_most_zero() -> list[str]:
    """The specs whose bias of j - i alone is flagged ``distance_bias_at_most_zero``."""
    return [
        name
        for name in spec_names()
        if generated_class(name).bias_by_distance
        and generated_class(name).distance_bias_at_most_zero
    ]


def randomized_modules(
    name: str, seed: int, spread: float, head_dim: int = 8, trials: int = 5
) -> Iterator[torch.nn.Module]:
    """``trials`` modules of ``name`` (6 heads) with every floating-point parameter and
    buffer drawn from a normal distribution of standard deviation ``spread``, their
    caches empty."""
    cls = generated_class(name)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        pe = cls(heads=6, head_dim=head_dim)
        with torch.no_grad():
            for tensor in [*pe.parameters(), *pe.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) * spread)
        pe._cache.clear()
        yield pe


@pytest.mark.parametrize("name", _flagged_at_most_zero())
def test_a_bias_flagged_at_most_zero_is_so_for_any_parameters(name: str) -> None:
    """``distance_bias_at_most_zero`` (no half-precision shift) holds whatever the
    parameters: with every parameter and buffer drawn at random, signs included, each
    head's vector peaks at exactly 0, at distance 0, for decode and prefill shapes."""
    for trial, pe in enumerate(randomized_modules(name, seed=1, spread=3.0)):
        for n, m in ((1, 1), (1, 40), (7, 7), (3, 20)):
            vector = pe._distance_bias(n, m, torch.device("cpu"))  # [H, N + M - 1]
            assert torch.equal(vector.amax(dim=-1), torch.zeros(6)), (trial, n, m)
            assert torch.equal(vector[:, m - 1], torch.zeros(6))  # distance 0


def test_the_flag_is_on_for_fixed_slopes_and_kerple_not_for_trained_slopes() -> None:
    """ALiBi's fixed slopes and KERPLE's clamped kernels take the flag; trained slopes do
    not, since one that turns negative gives a bias above 0 far from the query."""
    flagged = set(_flagged_at_most_zero())
    assert {"alibi", "kerple_log", "kerple_power"} <= flagged
    assert "alibi_learned" not in flagged
    pe = generated_class("alibi_learned")(heads=2, head_dim=8)
    with torch.no_grad():
        pe.slopes.fill_(-0.5)
    assert pe._distance_bias(1, 5, torch.device("cpu")).amax() > 0


def _flagged_finite() -> list[str]:
    """The specs whose bias of j - i alone is flagged ``position_bias_finite``."""
    return [
        name
        for name in spec_names()
        if generated_class(name).bias_by_distance and generated_class(name).position_bias_finite
    ]


@pytest.mark.parametrize("name", _flagged_finite())
def test_a_bias_flagged_finite_is_so_for_any_finite_parameters(name: str) -> None:
    """``position_bias_finite`` (the few-query matmuls skip the fully-masked-row care)
    holds for parameters and buffers drawn at random, signs and large values included,
    for decode and prefill shapes."""
    for trial, pe in enumerate(randomized_modules(name, seed=2, spread=10.0)):
        for n, m in ((1, 1), (1, 300), (7, 7), (3, 20)):
            vector = pe._distance_bias(n, m, torch.device("cpu"))  # [H, N + M - 1]
            assert torch.isfinite(vector).all(), (trial, n, m)


@pytest.mark.parametrize("name", ["fire", "tupe_a", "tupe_r"])
def test_a_bias_per_pair_flagged_finite_is_so_for_any_finite_parameters(name: str) -> None:
    """FIRE's and TUPE's biases (per pair, not of j - i alone) are flagged finite and
    are so with parameters and buffers drawn at random, signs and large values
    included, at default and explicit positions (FIRE's threshold L above and below
    the positions)."""
    assert generated_class(name).position_bias_finite
    for trial, pe in enumerate(randomized_modules(name, seed=3, spread=10.0, head_dim=64)):
        for positions in (torch.arange(40), torch.arange(40) * 7 + 3):
            bias = pe.score_bias(positions[-3:], positions)  # [H, 3, 40]
            assert bias is not None and torch.isfinite(bias).all(), (trial, positions[:2])


def test_every_built_in_bias_of_the_distance_is_flagged_finite() -> None:
    """Not an encoding without a position bias."""
    assert not generated_class("rope").position_bias_finite
    assert set(_flagged_finite()) >= {
        "alibi",
        "alibi_learned",
        "kerple_log",
        "kerple_power",
        "sandwich",
        "t5",
        "t5_decoder",
    }


@pytest.mark.parametrize("name", ["alibi", "kerple_log"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_without_the_shift_gives_the_same_outputs(
    name: str, dtype: torch.dtype, monkeypatch
) -> None:
    """Where the flag skips ``half_precision_bias``'s shift, the outputs equal those with
    the shift taken, bit for bit (the shift is 0): a decode step and causal prefill."""
    pe = generated_class(name)(heads=4, head_dim=8)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=generator).to(dtype) for _ in "qkv")
    calls = [(q[:, :, -1:], {}), (q, {"causal": True}), (q, {"causal": True, "window": 3})]
    flagged = [pe(rows, k, v, backend="sdpa", **options) for rows, options in calls]
    monkeypatch.setattr(type(pe), "distance_bias_at_most_zero", False)
    shifted = [pe(rows, k, v, backend="sdpa", **options) for rows, options in calls]
    for got, want in zip(flagged, shifted, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_bias_shifts_each_row_by_its_largest_finite_maximum(
    dtype: torch.dtype,
) -> None:
    """Each row loses its largest entry before the cast; a row whose largest entry is
    not finite (all -inf, a +inf, a NaN) is cast unshifted."""
    inf, nan = float("inf"), float("nan")
    rows = [[60.0, 59.5, -3.0], [-inf, -inf, -inf], [1.0, inf, 2.0], [nan, 4.0, 5.0]]
    bias = torch.tensor(rows)
    got = distances.half_precision_bias(bias, dtype)
    want = [[0.0, -0.5, -63.0], rows[1], rows[2], rows[3]]
    torch.testing.assert_close(got, torch.tensor(want).to(dtype), equal_nan=True)
    assert got.dtype == dtype
