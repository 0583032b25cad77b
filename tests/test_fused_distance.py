"""The runtime's fused Triton attention for a bias of j - i alone
(``fused_distance_attention``) against float64 oracles.

softmax(q kᵀ · s + b(j - i) + mask) v is written out score by score here, for ALiBi's
c_h |r| (Press et al. 2022), a per-distance vector (T5's clipped buckets, Raffel et al.
2020; any other bias of r), causal and windowed masks, and grouped-query heads. The
kernels run on CPU tensors under TRITON_INTERPRET=1 (defined afresh per test; the
runtime's own definitions are restored after). Shapes are small: the interpreter runs
each program in NumPy. It multiplies bfloat16 operands of ``tl.dot`` as raw bits
(triton-lang/triton#11584), so half precision is checked here in float16, which takes
the same code path; bfloat16 runs on CUDA (tests/test_gpu.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import generated._distance_kernel as kernels_source
import generated._flex_backend as flex_backend
import generated._fused_distance as runtime
from tests.conftest import (
    bias_kind,
    generated_class,
    interpret_distance_kernels,
    needs_triton,
    run_backend,
    runtime_modules,
    set_runtime,
    spec_variant,
    spy_calls,
)

pytestmark = needs_triton


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    interpret_distance_kernels(monkeypatch)
    yield runtime


def formula(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None,
    kind: str,
    base: int,
    causal: bool,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax(q kᵀ scale + b(r) + mask) v and the row log-sum-exp, every score
    written out; query i at position i + M - N, r = key - query position; key head h //
    (H / H_kv) serves query head h."""
    q, k, v = q.double(), k.double(), v.double()
    n, m = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    r = torch.arange(m)[None, :] - (torch.arange(n)[:, None] + m - n)  # [N, M]
    scores = q @ k.transpose(-1, -2) * scale
    if kind == "slope":
        assert bias is not None
        scores = scores + bias.double()[:, None, None] * r.abs()
    elif kind == "vector":
        assert bias is not None
        scores = scores + bias.double()[:, (r + base).clamp(0, bias.shape[1] - 1)]
    allowed = torch.ones(n, m, dtype=torch.bool)
    if causal:
        allowed &= r <= 0
    if window is not None:
        allowed &= r.abs() < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _bias(kind: str, heads: int, length: int, generator: torch.Generator) -> torch.Tensor | None:
    if kind == "slope":  # ALiBi-like: c_h = -slope_h
        return -torch.rand(heads, generator=generator) - 0.05
    if kind == "vector":
        return torch.randn(heads, length, generator=generator)
    return None


def _assert_kernel_matches_formula(
    n: int,
    m: int,
    heads: int,
    kv_heads: int,
    kind: str,
    base: int,
    length: int,
    causal: bool,
    window: int | None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    train_bias: bool = True,
) -> None:
    """Outputs, lse and the gradients into q, k, v and (``train_bias``) the bias
    against the float64 formula."""
    generator = torch.Generator().manual_seed(seed)
    # one batch entry: the interpreter runs each program in NumPy (the modules' tests
    # below take two)
    q = torch.randn(1, heads, n, 16, generator=generator)
    k = torch.randn(1, kv_heads, m, 16, generator=generator)
    v = torch.randn(1, kv_heads, m, 32, generator=generator)  # value width != head width
    weight = torch.randn(1, heads, n, 32, generator=generator)  # d loss / d out
    bias = _bias(kind, heads, length, generator)
    trained = bias is not None and train_bias
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    if trained:
        assert bias is not None
        leaves.append(bias.requires_grad_())
    out, lse = runtime.fused_distance_attention(
        *leaves[:3], 0.3, bias, kind, base, causal=causal, window=window
    )
    grads = torch.autograd.grad((out * weight.to(dtype)).sum(), leaves)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    wide_bias = wide[3] if trained else bias
    want, want_lse = formula(*wide[:3], 0.3, wide_bias, kind, base, causal, window)
    want_grads = torch.autograd.grad((want * weight.double()).sum(), wide)
    if dtype == torch.float32:
        tolerance = {"rtol": 1e-5, "atol": 1e-5}
    else:  # float16: products rounded to 11 bits, P rounded before P V
        tolerance = {"rtol": 2e-2, "atol": 2e-2}
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, **tolerance)
    torch.testing.assert_close(lse.double(), want_lse, **tolerance)
    for name, got, expected in zip("qkvb", grads, want_grads, strict=False):
        assert got.dtype == (torch.float32 if name == "b" else dtype)
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            got.double(),
            expected,
            rtol=tolerance["rtol"],
            atol=tolerance["atol"] * max(scale, 1.0),
            msg=lambda text, name=name: f"grad {name}: {text}",
        )


BIASES = [  # (kind, base, length)
    ("none", 0, 1),
    ("slope", 0, 1),
    # clipped at 1 and 2: tiles wholly past the clip read one value, and at N = M = 48
    # with 16-wide tiles a tile's r reaches exactly -1 (clip 1) or 1 = clip - 1 (clip 2)
    ("vector", 1, 3),
    ("vector", 2, 5),
    ("vector", 47, 95),  # a full per-distance vector at N = M = 48: base M - 1
]
# a window of 15: the tile below the diagonal has r = -15 = -window, just outside
MASKS = [(False, None), (True, None), (False, 15), (True, 7)]


@pytest.mark.parametrize(("causal", "window"), MASKS)
@pytest.mark.parametrize(("kind", "base", "length"), BIASES)
def test_the_kernel_matches_the_formula(interpreted, kind, base, length, causal, window) -> None:
    # 48 = three 16-wide tiles: the corner tiles lie wholly past the clip both ways
    _assert_kernel_matches_formula(48, 48, 4, 2, kind, base, length, causal, window)


@pytest.mark.parametrize(("causal", "window"), MASKS)
def test_clipped_vectors_gathered_in_every_tile_match_the_formula(
    interpreted, causal, window, monkeypatch
) -> None:
    monkeypatch.setattr(runtime, "FUSED_DISTANCE_CONSTANT_TILES", False)
    _assert_kernel_matches_formula(48, 48, 4, 2, "vector", 2, 5, causal, window)


def test_only_clipped_vectors_test_their_tiles_for_one_value() -> None:
    q = torch.zeros(1, 2, 8, 16)

    def code(length: int, n: int = 8, m: int = 8) -> int:
        bias = torch.zeros(2, length)
        _, meta = runtime._distance_bias_arguments(q, bias, "vector", 0, n, m, False, None)
        return int(meta["BIAS"])

    assert (code(5), code(14), code(15), code(30)) == (2, 2, 3, 3)  # N + M - 1 = 15
    assert code(15, n=8, m=9) == 2  # 16 distances: the vector is clipped
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(runtime, "FUSED_DISTANCE_CONSTANT_TILES", False)
        assert code(5) == 3


def test_a_constant_bias_gets_no_gradient_work(interpreted) -> None:
    # the bias as a constant (BIAS_GRAD off): outputs and gradients into q, k and v
    for kind, base, length in (("slope", 0, 1), ("vector", 2, 5)):
        _assert_kernel_matches_formula(
            48, 48, 4, 2, kind, base, length, True, None, train_bias=False
        )


@pytest.mark.parametrize("bias_trains", [False, True])
def test_what_the_autotuner_zeroes_is_never_an_input(interpreted, bias_trains, monkeypatch):
    # on CUDA the dQ kernel is autotuned with reset_to_zero=["grad_bias_ptr",
    # "grad_rows_ptr"] and the dK kernel with ["grad_rows_ptr"], so the tensors passed
    # there are zeroed by every trial: a scratch float or a gradient being summed, never
    # q or another input (the first version passed q when no bias trained)
    launches = []
    launch = runtime._launch_distance_kernel

    def record(name: str, *args: Any, **meta: Any) -> None:
        launches.append((name, args[4:], meta))
        launch(name, *args, **meta)

    monkeypatch.setattr(runtime, "_launch_distance_kernel", record)
    q, k, v = (torch.randn(1, 2, 20, 16).requires_grad_() for _ in range(3))
    bias = torch.randn(2, 5).requires_grad_(bias_trains)
    out, _ = runtime.fused_distance_attention(q, k, v, 0.3, bias, "vector", 2)
    out.sum().backward()
    # and relative terms on both sides, whose scores train where the bias would
    diagonal = (torch.arange(39) % 3).int()
    terms = [
        runtime.RelativeRows(torch.randn(1, 2, 20, 3).requires_grad_(bias_trains), diagonal)
        for _ in range(2)
    ]
    out, _ = runtime.fused_relative_attention(q, k, v, 0.3, *terms)
    out.sum().backward()
    kernels = kernels_source.distance_attention_kernels()
    resets = {"query_grad": ["grad_bias_ptr", "grad_rows_ptr"], "key_grad": ["grad_rows_ptr"]}
    for name, reset in resets.items():
        for _, args, meta in [launch for launch in launches if launch[0] == name]:
            zeroed = [args[kernels[name].arg_names.index(argument)] for argument in reset]
            inputs = [t for t in args if isinstance(t, torch.Tensor)]
            inputs = [t for t in inputs if all(t is not z for z in zeroed)]
            assert meta["ROWS_GRAD"] is (bias_trains and meta["QUERY_ROWS"] > 0)
            for tensor in zeroed:
                assert tensor.dtype == torch.float32
                assert all(tensor.data_ptr() != t.data_ptr() for t in inputs)
    assert [meta["BIAS_GRAD"] for name, _, meta in launches if name == "query_grad"] == [
        bias_trains,
        False,
    ]
    assert (bias.grad is not None) is bias_trains
    assert all((term.scores.grad is not None) is bias_trains for term in terms)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_the_bias_gradient_holds_for_tiles_of_unequal_sides(interpreted, blocks, monkeypatch):
    # the autotuner's dQ tiles are up to 128 queries by 32 keys, so a tile's rows wrap
    # past several key-tile widths when its diagonals are summed
    monkeypatch.setattr(runtime, "FUSED_DISTANCE_BLOCKS", blocks)
    for causal in (False, True):
        _assert_kernel_matches_formula(40, 56, 4, 2, "vector", 3, 7, causal, None)
    _assert_kernel_matches_formula(40, 56, 4, 2, "vector", 55, 95, False, 20)  # full vector


@pytest.mark.parametrize(("n", "m"), [(20, 37), (1, 33), (16, 16), (5, 5)])
def test_queries_are_the_last_n_keys_and_edges_are_masked(interpreted, n, m) -> None:
    for causal in (False, True):
        _assert_kernel_matches_formula(n, m, 4, 1, "vector", 4, 9, causal, None)


def test_large_biases_stay_finite_past_the_last_query(interpreted) -> None:
    # a bias of +-100 per distance: exp of it overflows float32 unless the rows past N
    # (read as zeros, their lse 0) are masked in the backward too
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, length, 16, generator=generator) for length in (20, 37, 37))
    bias = 100 * torch.randn(2, 9, generator=generator).sign()
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, _ = runtime.fused_distance_attention(*leaves, 0.3, bias, "vector", 4)
    grads = torch.autograd.grad(out.sum(), leaves)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want, _ = formula(*wide, 0.3, bias, "vector", 4, False, None)
    want_grads = torch.autograd.grad(want.sum(), wide)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["slope", "vector"])
def test_float16_stays_within_float16_error(interpreted, kind) -> None:
    _assert_kernel_matches_formula(40, 48, 2, 2, kind, 4, 9, True, None, torch.float16)


@settings(max_examples=8, deadline=None)
@given(
    n=st.integers(1, 40),
    extra_keys=st.integers(0, 20),
    groups=st.sampled_from([1, 2]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 30)),
    kind=st.sampled_from(["none", "slope", "vector"]),
    clip=st.integers(0, 12),
)
def test_any_shape_band_and_bias_match_the_formula(
    n, extra_keys, groups, causal, window, kind, clip
) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:  # hypothesis reruns the body
        interpret_distance_kernels(monkeypatch)
        _assert_kernel_matches_formula(
            n, n + extra_keys, 2 * groups, 2, kind, clip, 2 * clip + 1, causal, window, seed=n
        )


def test_bad_arguments_raise_value_errors_naming_them(interpreted) -> None:
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    attend = runtime.fused_distance_attention
    with pytest.raises(ValueError, match="bias_kind"):
        attend(q, k, v, 1.0, torch.zeros(2), "linear")
    with pytest.raises(ValueError, match=r"bias must be \[heads\]"):
        attend(q, k, v, 1.0, torch.zeros(3), "slope")
    with pytest.raises(ValueError, match="bias must be given"):
        attend(q, k, v, 1.0, None, "vector")
    with pytest.raises(ValueError, match="must not exceed"):
        attend(torch.randn(1, 2, 9, 16), k, v, 1.0)
    with pytest.raises(ValueError, match="must divide"):
        attend(torch.randn(1, 3, 8, 16), k, v, 1.0)
    with pytest.raises(ValueError, match="float16, bfloat16 or"):
        attend(q.double(), k.double(), v.double(), 1.0)
    with pytest.raises(ValueError, match="powers of two"):
        attend(*(torch.randn(1, 2, 8, 8) for _ in range(3)), 1.0)
    with pytest.raises(ValueError, match="window"):
        attend(q, k, v, 1.0, window=0)


def test_nothing_is_served_where_the_devices_are_not_listed() -> None:
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    # the CPU runs the kernels only interpreted, in tests; the flex route takes ALiBi's
    # slope on CUDA, where it was timed faster than flex, and leaves vectors to flex
    assert runtime.FUSED_DISTANCE_DEVICES == {"cuda"}
    assert flex_backend.FUSED_DISTANCE_ROUTES == {"slope": {"cuda"}, "vector": set()}
    # trained biases stay off the kernel until its gradient is timed on a GPU
    assert flex_backend.FUSED_DISTANCE_TRAINED_DEVICES == set()
    assert not runtime.fused_distance_attention_serves(q, k, v)
    with pytest.raises(ValueError, match="FUSED_DISTANCE_DEVICES"):
        runtime.fused_distance_attention(q, k, v, 1.0)


# ---- the generated modules' flex backend on the fused route ----


def spy_kinds(pe: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Serve ``pe``'s runtime interpreted and record the bias kind of each fused call."""
    interpret_distance_kernels(monkeypatch, pe)
    return spy_calls(monkeypatch, runtime_modules(pe), "fused_distance_attention", bias_kind)


def _clipped_t5(name: str = "t5") -> type[torch.nn.Module]:
    """``name`` with 8 buckets clipped at distance 8, so that short sequences have
    tiles past the clip and the table trains through the attached gradient."""
    clip = [("buckets: 32", "buckets: 8"), ("max_distance: 128", "max_distance: 8")]
    return spec_variant(name, *clip, name=f"{name}_clipped_at_8")


def _inputs(n: int, m: int, kv_heads: int, dtype: torch.dtype = torch.float32) -> dict:
    generator = torch.Generator().manual_seed(5)
    shapes = {"q": (2, 4, n, 16), "k": (2, kv_heads, m, 16), "v": (2, kv_heads, m, 16)}
    return {
        key: torch.randn(*shape, generator=generator).to(dtype) for key, shape in shapes.items()
    }


def assert_flex_matches_eager(
    pe: torch.nn.Module, n: int, m: int, kv_heads: int, **options: Any
) -> None:
    """The flex backend (float32) against the eager oracle of a float64 copy: outputs
    and gradients into q, k, v and the parameters."""
    inputs = _inputs(n, m, kv_heads)
    got, got_grads = run_backend(pe, inputs, "flex", **options)
    oracle = copy.deepcopy(pe).double()
    wide = {key: value.double() for key, value in inputs.items()}
    want, want_grads = run_backend(oracle, wide, "eager", **options)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert len(got_grads) == len(want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5 * max(w.abs().max(), 1))


@pytest.mark.parametrize(
    ("name", "kind"),
    [("alibi", "slope"), ("kerple_log", "vector"), ("sandwich", "vector")],
)
@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, None), (True, 9)])
def test_fixed_biases_run_the_kernel_and_match_eager(name, kind, causal, window, monkeypatch):
    pe = generated_class(name)(heads=4, head_dim=16).requires_grad_(False)  # nothing trains
    kinds = spy_kinds(pe, monkeypatch)
    assert_flex_matches_eager(pe, 40, 56, 2, causal=causal, window=window)
    assert kinds == [kind]


@pytest.mark.parametrize("name", ["t5", "t5_decoder"])
@pytest.mark.parametrize("causal", [False, True])
def test_t5_trains_its_table_through_the_kernel_and_the_attached_gradient(
    name, causal, monkeypatch
) -> None:
    pe = _clipped_t5(name)(heads=4, head_dim=16)
    set_runtime(monkeypatch, "CLIPPED_BIAS_BAND_ROWS", 16, pe)
    kinds = spy_kinds(pe, monkeypatch)
    launches = spy_calls(
        monkeypatch, runtime_modules(pe), "distance_attention_forward", lambda *a: a[4]
    )
    assert_flex_matches_eager(pe, 64, 72, 2, causal=causal)
    assert kinds == ["vector"]
    # the attention, then (not causal) the backward's triangle, which has no bias
    assert launches == (["vector"] if causal else ["vector", "none"])


def test_the_backward_uses_the_kernel_whatever_the_settings_are_by_then(monkeypatch) -> None:
    pe = _clipped_t5()(heads=4, head_dim=16)
    set_runtime(monkeypatch, "CLIPPED_BIAS_BAND_ROWS", 16, pe)
    kinds = spy_kinds(pe, monkeypatch)

    class RouteOffAfterForward(torch.nn.Module):
        """``pe``, with the fused route and devices turned off once its forward ran."""

        def __init__(self) -> None:
            super().__init__()
            self.pe = pe

        def forward(self, *args: Any, **options: Any) -> torch.Tensor:
            out = self.pe(*args, **options)
            set_runtime(monkeypatch, "FUSED_DISTANCE_DEVICES", set(), pe)
            set_runtime(monkeypatch, "FUSED_DISTANCE_ROUTES", {}, pe)
            return out

    # not causal: the backward's triangle runs the kernel after the settings changed
    assert_flex_matches_eager(RouteOffAfterForward(), 64, 72, 2, causal=False)
    assert kinds == ["vector"]  # the triangle calls the kernel below the checked entry


def test_the_route_takes_only_the_forms_listed_for_the_device(monkeypatch) -> None:
    alibi = generated_class("alibi")(heads=4, head_dim=16).requires_grad_(False)
    t5 = _clipped_t5()(heads=4, head_dim=16).requires_grad_(False)
    found = {}
    for name, pe in (("alibi", alibi), ("t5", t5)):
        kinds = spy_kinds(pe, monkeypatch)
        routes = {"slope": {"cpu"}, "vector": set()}
        set_runtime(monkeypatch, "FUSED_DISTANCE_ROUTES", routes, pe)
        flex_calls = spy_calls(monkeypatch, runtime_modules(pe), "run_flex", lambda *_, **__: 1)
        assert_flex_matches_eager(pe, 20, 24, 2, causal=True)
        found[name] = (kinds, len(flex_calls))
    # ALiBi's slope took the kernel; T5's vector went to FlexAttention
    assert found == {"alibi": (["slope"], 0), "t5": ([], 1)}


@pytest.mark.parametrize(
    ("name", "kind"), [("alibi_learned", "slope"), ("t5", "vector"), ("kerple_log", "vector")]
)
@pytest.mark.parametrize("causal", [False, True])
def test_trained_biases_take_the_kernel_and_its_gradient_where_listed(
    name, kind, causal, monkeypatch
) -> None:
    # learned slopes, T5's clipped table (8 buckets: tiles past the clip and across it)
    # and KERPLE's full per-distance vector, all trained through the dQ kernel's sums
    pe = (_clipped_t5() if name == "t5" else generated_class(name))(heads=4, head_dim=16)
    assert any(parameter.requires_grad for parameter in pe.parameters())
    set_runtime(monkeypatch, "FUSED_DISTANCE_TRAINED_DEVICES", {"cpu"}, pe)
    kinds = spy_kinds(pe, monkeypatch)
    attached = spy_calls(
        monkeypatch, runtime_modules(pe), "attach_clipped_bias_gradient", lambda *_: 1
    )
    assert_flex_matches_eager(pe, 40, 56, 2, causal=causal)
    assert kinds == [kind] and attached == []


def test_a_frozen_t5_table_reads_its_clipped_vector(monkeypatch) -> None:
    pe = _clipped_t5()(heads=4, head_dim=16).requires_grad_(False)
    kinds = spy_kinds(pe, monkeypatch)
    assert_flex_matches_eager(pe, 20, 40, 4, causal=True)
    assert kinds == ["vector"]


def test_float16_modules_stay_within_float16_error(monkeypatch) -> None:
    pe = generated_class("alibi")(heads=4, head_dim=16)
    kinds = spy_kinds(pe, monkeypatch)
    half = _inputs(48, 48, 4, torch.float16)
    got, got_grads = run_backend(pe, half, "flex", causal=True)
    # the eager oracle on the same float16 inputs: float32 inside, a float16 output
    want, want_grads = run_backend(pe, half, "eager", causal=True)
    assert kinds == ["slope"]
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2 * w.abs().max().item())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_kernel_serves_only_what_it_computes(monkeypatch) -> None:
    alibi = generated_class("alibi")(heads=4, head_dim=16)
    kinds = spy_kinds(alibi, monkeypatch)
    q, k, v = (torch.randn(1, 4, 24, 16) for _ in range(3))
    with torch.no_grad():
        alibi(q, k, v, backend="flex", k_positions=torch.arange(24) * 2)  # explicit positions
        alibi(q, k, v, backend="flex", attn_mask=torch.ones(24, 24, dtype=torch.bool))
        alibi(q, k, v, backend="flex", document_ids=torch.zeros(24, dtype=torch.long))
        alibi(q, k, v, backend="sdpa")
        alibi(q.double(), k.double(), v.double(), backend="flex")  # float64
        small = [t[..., :8] for t in (q, k, v)]  # head_dim 8: below Triton's dot tile
        generated_class("alibi")(heads=4, head_dim=8)(*small, backend="flex")
    learned = generated_class("alibi_learned")(heads=4, head_dim=16)
    learned(q, k, v, backend="flex").sum().backward()  # trained slopes: the vector path
    assert learned.slopes.grad is not None
    assert kinds == []
    with torch.no_grad():
        learned(q, k, v, backend="flex")  # the same slopes, not trained here
    assert kinds == ["slope"]
