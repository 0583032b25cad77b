"""CUDA checks (skipped without a GPU): device moves, cache rebuilds, bf16 at long range,
the compiled flex kernel and the fused Triton rotation."""

from __future__ import annotations

import warnings

import pytest
import torch

from generated import parameters_frozen
from tests.conftest import (
    bias_kind,
    generated_class,
    head_dim_for,
    runtime_modules,
    runtime_value,
    set_runtime,
    spec_names,
    spy_calls,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture
def flex_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """flex through FlexAttention alone: the fused route (ALiBi's default on CUDA) off,
    so that the compiled score_mod is what the test checks; the route has its own test."""
    set_runtime(monkeypatch, "FUSED_DISTANCE_ROUTES", {})


@pytest.mark.parametrize("name", spec_names())
def test_cuda_matches_cpu_and_backends_agree(name: str) -> None:
    head_dim = head_dim_for(name, 32)
    pe = generated_class(name)(heads=4, head_dim=head_dim).eval()
    q, k, v = (torch.randn(2, 4, 64, head_dim) for _ in range(3))
    expected = pe(q, k, v, causal=True, backend="eager")
    pe = pe.to(CUDA)
    for backend in ("eager", "sdpa"):
        got = pe(q.to(CUDA), k.to(CUDA), v.to(CUDA), causal=True, backend=backend)
        torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-3)
    half = pe(
        q.to(CUDA, torch.bfloat16),
        k.to(CUDA, torch.bfloat16),
        v.to(CUDA, torch.bfloat16),
        causal=True,
        backend="sdpa",
    )
    assert half.dtype == torch.bfloat16
    # against the float32 oracle on the same bf16-rounded inputs: what is left is bf16
    # arithmetic inside SDPA (weights rounded before P.V, output rounded once)
    rounded = [t.bfloat16().float() for t in (q, k, v)]
    reference = pe.cpu()(*rounded, causal=True, backend="eager")
    torch.testing.assert_close(half.float().cpu(), reference, atol=2.5e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["alibi", "t5", "transformer_xl", "learned_absolute"])
def test_inputs_on_another_device_than_the_module_are_named(name: str) -> None:
    pe = generated_class(name)(heads=2, head_dim=head_dim_for(name, 16))
    if name == "learned_absolute":
        x = torch.randn(1, 5, pe.model_dim, device=CUDA)
        with pytest.raises(ValueError, match=r"x is on cuda:0, the module's \S+ on cpu"):
            pe.embed(x)
        assert pe.to(CUDA).embed(x).device.type == "cuda"
        return
    q = torch.randn(1, 2, 5, pe.head_dim, device=CUDA)
    with pytest.raises(ValueError, match=r"q is on cuda:0, the module's \S+ on cpu"):
        pe(q, q, q)
    with pytest.raises(ValueError, match=r"q_positions is on cpu, the module's \S+ on cuda"):
        pe.to(CUDA).score_bias(torch.arange(5), torch.arange(5))  # read after the move
    assert pe(q, q, q).device.type == "cuda"


@pytest.mark.parametrize("name", ["rope", "rope_gptj"])
def test_rotary_cache_follows_the_device(name: str) -> None:
    pe = generated_class(name)(heads=2, head_dim=16)
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    cpu_q, _ = pe.rotate(q, k)
    cuda_q, _ = pe.rotate(q.to(CUDA), k.to(CUDA))  # module stays on CPU: cache rebuilt
    assert pe._cos_cache.device.type == "cuda"
    assert pe._cos_cache.dtype == torch.float32
    back_q, _ = pe.rotate(q, k)
    assert pe._cos_cache.device.type == "cpu"
    torch.testing.assert_close(cuda_q.cpu(), cpu_q)
    torch.testing.assert_close(back_q, cpu_q)
    # the cache is a plain attribute, not a buffer: module.to() neither moves nor casts
    # it, so it follows the inputs and stays float32 under .to(CUDA, bfloat16)
    assert "_cos_cache" not in dict(pe.named_buffers())
    pe = pe.to(CUDA, torch.bfloat16)
    assert pe._cos_cache.device.type == "cpu"
    cuda_q, _ = pe.rotate(q.to(CUDA), k.to(CUDA))
    assert pe._cos_cache.device.type == "cuda" and pe._cos_cache.dtype == torch.float32
    torch.testing.assert_close(cuda_q.cpu(), cpu_q)


@pytest.mark.parametrize("name", ["rope", "rope_gptj"])
def test_bf16_rotation_at_long_positions(name: str) -> None:
    """bf16 input stays within bf16 rounding of the fp32 result at positions near 2^20."""
    pe = generated_class(name)(heads=2, head_dim=64).to(CUDA)
    positions = torch.arange(2**20 - 256, 2**20, device=CUDA)
    x = torch.randn(1, 2, 256, 64, device=CUDA)
    fp32, _ = pe.rotate(x, x, positions, positions)
    bf16, _ = pe.rotate(x.bfloat16(), x.bfloat16(), positions, positions)
    # rotation is applied in fp32 to the bf16-rounded input, then rounded once more
    reference, _ = pe.rotate(x.bfloat16().float(), x.bfloat16().float(), positions, positions)
    torch.testing.assert_close(bf16.float(), reference.bfloat16().float(), atol=0, rtol=0)
    assert (bf16.float() - fp32).abs().max() < 4 * 2**-8 * x.abs().max()


@pytest.mark.parametrize(
    "name",
    [
        "alibi",
        "t5",
        "rope",
        "kerple_log",
        "fire",
        "sandwich",
        "deberta",
        "transformer_xl",
        "bert_relative_key",
    ],
)
def test_compiled_flex_forward_and_backward_match_eager_on_cuda(name: str, flex_only) -> None:
    """The compiled FlexAttention kernel: outputs and gradients (inputs and trained
    tables) against eager, fp32 and bf16, causal and not, explicit positions, GQA."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    q = torch.randn(2, 4, 256, 64, device=CUDA, requires_grad=True)
    k = torch.randn(2, 2, 256, 64, device=CUDA, requires_grad=True)
    v = torch.randn(2, 2, 256, 64, device=CUDA, requires_grad=True)
    params = [p for p in pe.parameters() if p.requires_grad]
    explicit = {
        "q_positions": torch.arange(7, 263, device=CUDA),
        "k_positions": torch.arange(7, 263, device=CUDA),
    }
    for positions in ({}, explicit):
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            flex = pe(q, k, v, causal=causal, backend="flex", **positions)
            torch.testing.assert_close(flex, eager, atol=2e-4, rtol=2e-3)
            want = torch.autograd.grad(eager.square().sum(), [q, k, v, *params])
            got = torch.autograd.grad(flex.square().sum(), [q, k, v, *params])
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)
    with torch.no_grad():
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        half = pe(q, k, v, causal=True, backend="flex")
        # against the float32 oracle on the same bf16 inputs: what is left is the kernel's
        # rounding of the weights to bf16 before P.V (<= 2^-9 |v|) and of the output
        reference = pe(q.float(), k.float(), v.float(), causal=True, backend="eager")
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), reference, atol=1.5e-2, rtol=1e-2)


def assert_flex_matches_float32_eager(
    pe: torch.nn.Module, inputs: list[torch.Tensor], dtype: torch.dtype, **options: object
) -> None:
    """flex on q, k, v = ``inputs`` cast to ``dtype`` against eager in float32 on the same
    rounded values: the output and the gradients of its squared sum into q, k, v and the
    parameters that train, float32 tight, bfloat16 within bfloat16 error (each gradient
    relative to its own scale, or to 3% of the largest gradient's where it is smaller)."""
    params = [p for p in pe.parameters() if p.requires_grad]
    q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
    flex = pe(q, k, v, backend="flex", **options)
    got = torch.autograd.grad(flex.float().square().sum(), [q, k, v, *params])
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    eager = pe(*wide, backend="eager", **options)
    want = torch.autograd.grad(eager.square().sum(), [*wide, *params])
    loose = dtype == torch.bfloat16
    torch.testing.assert_close(
        flex.float(), eager, atol=1.5e-2 if loose else 2e-4, rtol=1e-2 if loose else 2e-3
    )
    # each gradient within its own scale, but at least 3% of the largest one's: one that
    # cancels to zero (DeBERTa's pos_key_proj.bias adds q_i . b to every key of row i,
    # which softmax ignores) keeps its terms' rounding: 0.029 against float32's 4e-5
    # (6e-5 of the largest gradient, 454) in float16 under the interpreter, the likely
    # cause of DeBERTa's bf16 case failing on an H200 (its report was cut off)
    floor = 3e-2 * max(b.abs().max().item() for b in want)
    for a, b in zip(got, want, strict=True):
        scale = max(b.abs().max().item(), floor)
        tolerance = 3e-2 if loose else 2e-3
        torch.testing.assert_close(a.float(), b, atol=tolerance * scale, rtol=tolerance)


@pytest.mark.parametrize("name", ["t5", "t5_decoder"])
def test_compiled_flex_trains_a_clipped_table_through_the_attached_gradient(
    name: str, monkeypatch
) -> None:
    """flex with ``CLIPPED_BIAS_FLEX_DEVICES`` on CUDA: the compiled kernel reads T5's
    clipped vector per score as a constant and the table's gradient comes from the band
    and the triangles (``attach_clipped_bias_gradient``); outputs and gradients against
    eager, float32 and bf16 (gradients of bf16 against the float32 oracle on the same
    rounded inputs), causal and not, GQA, N = 1024 = 8 clip distances."""
    set_runtime(monkeypatch, "CLIPPED_BIAS_FLEX_DEVICES", {"cuda"})
    attached = spy_calls(
        monkeypatch, runtime_modules(), "attach_clipped_bias_gradient", lambda out, *_: out.shape[2]
    )
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    inputs = [torch.randn(2, h, 1024, 64, device=CUDA) for h in (4, 2, 2)]
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            assert_flex_matches_float32_eager(pe, inputs, dtype, causal=causal)
    assert attached == [1024] * 4


def tune_one_candidate(monkeypatch: pytest.MonkeyPatch, candidate: int) -> None:
    """The fused kernels autotuned over their tile candidate ``candidate`` alone, with no
    tuned kernel kept from before (a compile per candidate, bias form, band and dtype
    took over 150 s a case with all four)."""
    configs = runtime_value("_distance_attention_configs")

    def one_candidate(kernel: str) -> list[object]:
        return configs(kernel)[candidate:][:1]

    set_runtime(monkeypatch, "_distance_attention_configs", one_candidate)
    cache = runtime_value("TRITON_CACHE")
    set_runtime(monkeypatch, "TRITON_CACHE", {k: v for k, v in cache.items() if "tuned" not in k})


@pytest.mark.parametrize(
    ("name", "candidate"), [("alibi", 0), ("t5", 1), ("t5_decoder", 2), ("kerple_log", 3)]
)
def test_fused_distance_kernel_matches_eager_on_cuda(
    name: str, candidate: int, monkeypatch
) -> None:
    """flex's fused route on CUDA for every bias form (``FUSED_DISTANCE_ROUTES``): the
    compiled Triton kernels (the autotuner's tiles, bfloat16 tensor cores) against
    eager, float32 and bf16 (bf16 against the float32 oracle on the same rounded
    inputs), causal and not, a window, GQA, N < M; T5's table trains through the
    attached gradient, KERPLE is frozen and reads its full vector per score. Each case
    autotunes over one of the kernels' tile candidates (a compile per candidate, bias
    form, band and dtype took over 150 s a case): the four cases cover all four."""
    tune_one_candidate(monkeypatch, candidate)
    set_runtime(monkeypatch, "FUSED_DISTANCE_ROUTES", {"slope": {"cuda"}, "vector": {"cuda"}})
    kinds = spy_calls(monkeypatch, runtime_modules(), "fused_distance_attention", bias_kind)
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    if name == "kerple_log":
        pe.requires_grad_(False)
    inputs = [torch.randn(2, h, length, 64, device=CUDA) for h, length in ((4, 1000), (2, 1100))]
    inputs.append(torch.randn(2, 2, 1100, 64, device=CUDA))
    for dtype in (torch.float32, torch.bfloat16):
        for causal, window in ((False, None), (True, None), (True, 300)):
            assert_flex_matches_float32_eager(pe, inputs, dtype, causal=causal, window=window)
    assert kinds and "none" not in kinds[:1]


@pytest.mark.parametrize(
    ("name", "candidate"), [("alibi_learned", 0), ("t5", 1), ("kerple_log", 2)]
)
def test_trained_biases_through_the_fused_distance_kernel_on_cuda(
    name: str, candidate: int, monkeypatch
) -> None:
    """``FUSED_DISTANCE_TRAINED_DEVICES`` on CUDA: learned slopes, T5's clipped table and
    KERPLE's parameters train through the dQ kernel's tile and diagonal sums (atomics,
    the autotuner's trials zeroed), against eager in float32 and bf16, causal and not,
    GQA, N < M; one tile candidate per case (they differ in shape: 128 x 32, 128 x 64,
    64 x 64)."""
    tune_one_candidate(monkeypatch, candidate)
    set_runtime(monkeypatch, "FUSED_DISTANCE_ROUTES", {"slope": {"cuda"}, "vector": {"cuda"}})
    set_runtime(monkeypatch, "FUSED_DISTANCE_TRAINED_DEVICES", {"cuda"})
    kinds = spy_calls(monkeypatch, runtime_modules(), "fused_distance_attention", bias_kind)
    attached = spy_calls(
        monkeypatch, runtime_modules(), "attach_clipped_bias_gradient", lambda *_: 1
    )
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    inputs = [torch.randn(2, h, length, 64, device=CUDA) for h, length in ((4, 1000), (2, 1100))]
    inputs.append(torch.randn(2, 2, 1100, 64, device=CUDA))
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (False, True):
            assert_flex_matches_float32_eager(pe, inputs, dtype, causal=causal)
    assert kinds and "none" not in kinds and attached == []


@pytest.mark.parametrize(("causal", "window"), [(False, None), (True, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Transformer-XL's float32 forward with candidate 1 (128 x 128 tiles, three stages) needs
# 232456 bytes of shared memory, 8 more than a Hopper block may have (sm_90 compile,
# tests/test_kernel_compile.py): as the only candidate it cannot launch, the likely cause
# of both float32 cases failing on an H200 (their reports were cut off). Among the four
# the autotuner skips it; the case takes candidate 3.
@pytest.mark.parametrize(("name", "candidate"), [("deberta", 0), ("transformer_xl", 3)])
def test_fused_distance_kernel_reads_relative_terms_on_cuda(
    name: str, candidate: int, dtype: torch.dtype, causal: bool, window: int | None, monkeypatch
) -> None:
    """``FUSED_RELATIVE_DEVICES`` and ``FUSED_RELATIVE_TRAINED_DEVICES`` on CUDA: flex
    with the relative terms read from their projections in the compiled kernels
    (DeBERTa's c2p and p2c through their log-bucket diagonals; Transformer-XL's merged
    (q + v) . R and u . k_j per key), a forward and a training step (gradients into q,
    k, v and the parameters) against eager in float32 and bf16 (on the same rounded
    inputs), not causal and causal with a window, GQA, N < M; one tile candidate per
    case (each dtype and mask a case of its own, so that their kernels compile in
    parallel under pytest-xdist)."""
    tune_one_candidate(monkeypatch, candidate)
    set_runtime(monkeypatch, "FUSED_RELATIVE_DEVICES", {"cuda"})
    set_runtime(monkeypatch, "FUSED_RELATIVE_TRAINED_DEVICES", {"cuda"})
    launches = spy_calls(
        monkeypatch,
        runtime_modules(),
        "attend_fused",
        lambda *args, **_: tuple(rows is not None for rows in args[9:11]),
    )
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    with torch.no_grad():
        for parameter in pe.parameters():  # unit scale, so that the relative terms matter
            parameter.normal_()
    inputs = [torch.randn(2, h, length, 64, device=CUDA) for h, length in ((4, 1000), (2, 1100))]
    inputs.append(torch.randn(2, 2, 1100, 64, device=CUDA))
    q, k, v = (t.to(dtype) for t in inputs)
    with torch.no_grad():
        got = pe(q, k, v, backend="flex", causal=causal, window=window)
        want = pe(q.float(), k.float(), v.float(), backend="eager", causal=causal, window=window)
    loose = dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), want, atol=1.5e-2 if loose else 2e-4, rtol=1e-2 if loose else 2e-3
    )
    assert_flex_matches_float32_eager(pe, inputs, dtype, causal=causal, window=window)
    assert launches == [(True, True)] * 2  # the forward and the training step


def test_alibi_takes_the_fused_kernel_by_default_on_cuda(monkeypatch) -> None:
    """The shipped routes: ALiBi's flex backend runs the fused kernel on CUDA, T5's runs
    FlexAttention (``FUSED_DISTANCE_ROUTES``), both agreeing with eager in bf16."""
    kinds = spy_calls(monkeypatch, runtime_modules(), "fused_distance_attention", bias_kind)
    q, k, v = (torch.randn(2, 4, 256, 64, device=CUDA) for _ in range(3))
    for name in ("alibi", "t5"):
        pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
        with torch.no_grad():
            got = pe(*(t.bfloat16() for t in (q, k, v)), causal=True, backend="flex")
            rounded = [t.bfloat16().float() for t in (q, k, v)]
            want = pe(*rounded, causal=True, backend="eager")
        torch.testing.assert_close(got.float(), want, atol=1.5e-2, rtol=1e-2)
    assert kinds == ["slope"]


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "t5", "deberta", "tupe_a"])
def test_compiled_flex_with_windows_and_documents_matches_eager_on_cuda(
    name: str, flex_only
) -> None:
    """Sliding windows and packed documents as compiled block masks (N = M = 512, four
    128-token blocks, document boundaries inside blocks): flex and sdpa outputs and
    gradients equal eager given the same mask as an explicit bool attn_mask."""
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    length = 512
    q = torch.randn(2, 4, length, 64, device=CUDA, requires_grad=True)
    k = torch.randn(2, 2, length, 64, device=CUDA, requires_grad=True)
    v = torch.randn(2, 2, length, 64, device=CUDA, requires_grad=True)
    params = [p for p in pe.parameters() if p.requires_grad]
    token = torch.arange(length, device=CUDA)
    documents = torch.stack([(token >= 100).long() + (token >= 400).long(), token // 200])
    # block masks built per call (every other position: the defaults, given or shifted,
    # take the default paths); not where an absolute table is shorter than the positions
    # (TUPE-A's 512 rows raise ValueError for position 1022, as they should)
    explicit = {"q_positions": 2 * token, "k_positions": 2 * token}
    table = getattr(pe, "max_positions", None)
    for positions in ({}, explicit) if table is None or 2 * length <= table else ({},):
        spot = positions.get("q_positions", token)  # a window is measured in positions
        for causal in (False, True):
            for masks in (
                {"window": 96},
                {"document_ids": documents},
                {"window": 200, "document_ids": documents},
            ):
                distance = spot[:, None] - spot[None, :]  # query - key position, [N, M]
                allowed = torch.ones(2, 1, length, length, dtype=torch.bool, device=CUDA)
                if causal:
                    allowed &= distance >= 0
                if "window" in masks:
                    allowed &= distance.abs() < masks["window"]
                if "document_ids" in masks:
                    allowed &= documents[:, None, :, None] == documents[:, None, None, :]
                eager = pe(q, k, v, attn_mask=allowed, backend="eager", **positions)
                want = torch.autograd.grad(eager.square().sum(), [q, k, v, *params])
                for backend in ("flex", "sdpa"):
                    got_out = pe(q, k, v, causal=causal, backend=backend, **masks, **positions)
                    torch.testing.assert_close(got_out, eager, atol=2e-4, rtol=2e-3)
                    got = torch.autograd.grad(got_out.square().sum(), [q, k, v, *params])
                    for a, b in zip(got, want, strict=True):
                        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize(
    "name",
    [
        "alibi",
        "t5",
        "rope",
        "rope_yarn",
        "kerple_log",
        "fire",
        "deberta",
        "transformer_xl",
        "tupe_a",
    ],
)
def test_inductor_fullgraph_compile_on_cuda(name: str) -> None:
    """torch.compile(fullgraph=True) with inductor on CUDA, explicit positions, sdpa and
    flex backends: no graph break, no host sync, the eager module's outputs."""
    torch._dynamo.reset()
    d = head_dim_for(name, 64)
    pe = generated_class(name)(heads=4, head_dim=d).to(CUDA).eval()
    q = torch.randn(2, 4, 128, d, device=CUDA)
    k, v = (torch.randn(2, 2, 128, d, device=CUDA) for _ in "kv")  # grouped-query
    positions = {
        "q_positions": torch.arange(5, 133, device=CUDA),
        "k_positions": torch.arange(5, 133, device=CUDA),
    }
    compiled = torch.compile(pe, fullgraph=True)
    want = pe(q, k, v, causal=True, backend="eager", **positions)
    for backend in ("sdpa", "flex"):
        got = compiled(q, k, v, causal=True, backend=backend, **positions)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-3)


@pytest.mark.parametrize("name", ["rope", "rope_gptj", "rope_partial", "rope_xpos"])
def test_inductor_compiled_rotation_matches_the_kernel_with_gradients(name: str) -> None:
    """Compiled, the rotation is ``rotate_by_halves`` with its tables through the
    opaque ``posgen::materialize``; in bf16 its outputs and the gradients into q and k
    stay within bf16 error of the fused kernel's (eager mode)."""
    torch._dynamo.reset()
    pe = generated_class(name)(heads=8, head_dim=64).to(CUDA)
    q, k, gq, gk = (torch.randn(2, 8, 256, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(4))
    compiled = torch.compile(pe.rotate, fullgraph=True)
    results = []
    for rotate in (pe.rotate, compiled):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        outs = rotate(*leaves)
        grads = torch.autograd.grad(outs, leaves, (gq, gk))
        results.append([t.float() for t in (*outs, *grads)])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("alibi", "flex"),
        ("t5", "flex"),
        ("deberta", "flex"),
        ("transformer_xl", "flex"),
        ("rope", "sdpa"),
        ("sinusoidal", "sdpa"),
        ("tupe_a", "sdpa"),  # the untied term folds into q and k
        ("shaw", "eager"),  # the value-side term needs the weights
    ],
)
def test_auto_picks_the_measured_backend_on_cuda(name: str, expected: str) -> None:
    pe = generated_class(name)(heads=4, head_dim=64).to(CUDA)
    q = torch.randn(1, 4, 64, 64, device=CUDA)
    assert pe._auto_backend(q) == expected
    decode_step = "eager" if expected == "eager" else "sdpa"
    assert pe._auto_backend(q[:, :, :1]) == decode_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "name", ["rope", "rope_gptj", "rope_partial", "rope_xpos", "rope_mrope", "rope_p"]
)
def test_fused_rotation_on_cuda_matches_the_cpu_formula(name: str, dtype: torch.dtype) -> None:
    """rotate() on CUDA (the fused Triton kernel, forward and backward) against the CPU
    eager formula on the same values: default and batched explicit positions, q as a
    transposed [B, N, H, D] view."""
    rotation = pytest.importorskip("generated._rotation")
    pytest.importorskip("triton", reason="the fused rotation needs triton")
    head_dim = head_dim_for(name, 64)
    pe = generated_class(name)(heads=4, head_dim=head_dim)
    q = torch.randn(2, 48, 4, head_dim).to(dtype).transpose(1, 2)  # [B, H, N, D] view
    k = torch.randn(2, 4, 64, head_dim).to(dtype)
    grads = torch.randn(2, 4, 48, head_dim).to(dtype), torch.randn(2, 4, 64, head_dim).to(dtype)
    explicit = torch.stack((torch.arange(64) * 3, torch.arange(64) + 1000))  # [2, 64]
    launches: list[bool] = []
    launch = rotation.launch_rotation

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(True)
        return launch(*args, **kwargs)  # type: ignore[arg-type]

    for q_positions, k_positions in ((None, None), (explicit[:, 16:], explicit)):
        results = []
        for device in ("cpu", "cuda"):
            # fresh leaves per run (q.to("cpu") is q itself: its .grad would accumulate)
            x_q = q.detach().to(device, copy=True).requires_grad_()
            x_k = k.detach().to(device, copy=True).requires_grad_()
            positions = [p if p is None else p.to(device) for p in (q_positions, k_positions)]
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(rotation, "launch_rotation", counted)
                q_rot, k_rot = pe.rotate(x_q, x_k, *positions)
                torch.autograd.backward((q_rot, k_rot), [g.to(device) for g in grads])
            results.append([t.detach().cpu().float() for t in (q_rot, k_rot, x_q.grad, x_k.grad)])
        for got, want in zip(results[1], results[0], strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            else:  # one bf16 rounding of float32 values that agree to float32 error
                spacing = 2**-7 * want.abs() + 1e-6
                assert bool(((got - want).abs() <= spacing).all())
    assert len(launches) == 8  # CUDA only: q and k, forward and backward, twice


@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_decode_matches_eager_on_cuda(
    monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype
) -> None:
    """The grouped-query matmuls switched on for CUDA (``GROUPED_QUERY_DEVICES``, off
    until timed): bf16 through bmm's float32 output, one query and three causal ones,
    against the float32 oracle on the same rounded inputs."""
    set_runtime(monkeypatch, "GROUPED_QUERY_DEVICES", {"cpu", "cuda"})
    calls = spy_calls(monkeypatch, runtime_modules(), "grouped_query_attention", lambda *_, **__: 1)
    pe = generated_class(name)(heads=8, head_dim=64).to(CUDA)
    for n, causal in ((1, False), (2, True)):
        q = torch.randn(2, 8, n, 64, device=CUDA).to(dtype)
        k = torch.randn(2, 2, 512, 64, device=CUDA).to(dtype)
        v = torch.randn(2, 2, 512, 64, device=CUDA).to(dtype)
        if pe.has_rotation:
            k = pe.rotate_keys(k)
        rotated = {"keys_rotated": True} if pe.has_rotation else {}
        with torch.no_grad():
            got = pe(q, k, v, causal=causal, backend="sdpa", **rotated)
            oracle = pe(q.float(), k.float(), v.float(), causal=causal, backend="eager", **rotated)
        assert got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), oracle, atol=tolerance, rtol=tolerance)
    assert len(calls) == 2
    # a gradient through half precision keeps SDPA (bmm's float32 output is a forward)
    q.requires_grad_()
    pe(q, k, v, causal=True, backend="sdpa", **rotated).float().sum().backward()
    assert q.grad is not None
    if dtype != torch.float32:
        assert len(calls) == 2


#: syncs each step of a decoding loop at default positions may make on CUDA: the one
#: comparison of kept projections with the parameters (parameters_unchanged; values
#: cheap to make, FIRE's pieces and trained biases per distance, are kept on CUDA only
#: inside a parameters_frozen block)
KEPT_ROW_SYNCS = {
    "deberta": 1,
    "deberta_absolute_input": 1,
    "transformer_xl": 1,
    "tupe_a": 1,
    "tupe_r": 1,
}


@pytest.mark.parametrize("name", spec_names())
def test_a_decode_loop_syncs_only_to_compare_kept_rows_on_cuda(name: str) -> None:
    """The CUDA form of test_decode's count of reads of device data: with
    torch.cuda.set_sync_debug_mode("warn"), a decoding loop at default positions (one
    key more each step, over keys rotated once) makes no synchronizing call, except one
    per step where projected rows are kept (``KEPT_ROW_SYNCS``), and none at all inside
    a ``parameters_frozen`` block (its one comparison falls on a step before the loop).
    The caches are made first, for the loop's longest step: their builds, rare as they
    double, may copy a constant to the device."""
    d = head_dim_for(name, 32)
    pe = generated_class(name)(heads=4, head_dim=d).to(CUDA).eval()
    generator = torch.Generator().manual_seed(5)
    k, v = (torch.randn(1, 2, 80, d, generator=generator).to(CUDA) for _ in "kv")
    queries = torch.randn(20, 1, 4, 1, d, generator=generator).to(CUDA)
    cache = pe.rotate_keys(k)

    def loop_syncs() -> list[str]:
        """The synchronizing calls of 20 steps, against 60 ... 79 keys."""
        for m in (79, 59):  # caches made for every step, rows kept (and compared)
            pe(queries[0], cache[:, :, :m], v[:, :, :m], keys_rotated=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for step, m in enumerate(range(60, 80)):
                    pe(queries[step], cache[:, :, :m], v[:, :, :m], keys_rotated=True)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # (set_sync_debug_mode's first call in a process also warns that the mode is a
        # prototype: not a synchronizing call)
        return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]

    with torch.no_grad():
        syncs = loop_syncs()
        with parameters_frozen(pe):
            frozen_syncs = loop_syncs()
    assert len(syncs) <= 20 * KEPT_ROW_SYNCS.get(name, 0), syncs[:3]
    assert not frozen_syncs, frozen_syncs[:3]
