"""The runtime's fused Triton rotation (``fused_rotation``) against float64 oracles.

RoPE (Su et al. 2021) turns each feature pair (a, b) by its angle: a cos - b sin and
b cos + a sin. The kernel runs here on CPU tensors under TRITON_INTERPRET=1 (set before
the kernel is defined: each test defines it afresh and the runtime's own definition is
restored after); shapes are small because the interpreter is slow. On CUDA the same
kernel serves the generated modules (tests/test_gpu.py).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

import generated._rotation as rotation
import generated._rotation_kernel as kernel
from tests.conftest import ROOT, generated_class, head_dim_for, needs_triton, set_runtime


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The runtime's rotation with the kernel defined afresh under TRITON_INTERPRET=1,
    serving CPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    set_runtime(monkeypatch, "TRITON_CACHE", {})
    monkeypatch.setattr(kernel, "FUSED_ROTATION_DEVICES", ["cuda", "cpu"])
    yield rotation


def pair_features(rotary_dim: int, half_pairing: bool) -> tuple[list[int], list[int]]:
    """The first feature of each pair and its partner."""
    pairs = rotary_dim // 2
    if half_pairing:
        return list(range(pairs)), [k + pairs for k in range(pairs)]
    return list(range(0, rotary_dim, 2)), list(range(1, rotary_dim, 2))


def angle_layout(per_pair: torch.Tensor, half_pairing: bool) -> torch.Tensor:
    """[..., pairs] -> [..., rotary_dim] in the pairing's layout."""
    if half_pairing:
        return torch.cat((per_pair, per_pair), dim=-1)
    return per_pair.repeat_interleave(2, dim=-1)


def oracle(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, half_pairing: bool
) -> torch.Tensor:
    """float64 rotation of x [B, H, N, D], pair by pair, from the values at each pair's
    first feature (cos, sin broadcastable to [B, H, N, rotary_dim])."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    first, partner = pair_features(rotary_dim, half_pairing)
    c, s = cos[..., first], sin[..., first]
    a, b = x[..., first], x[..., partner]
    out = x.clone()
    out[..., first] = a * c - b * s
    out[..., partner] = b * c + a * s
    return out


def cos_sin(
    batch: int | None, length: int, rotary_dim: int, half_pairing: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles and per-pair scales (as xPos or an attention factor would give) laid out for
    the pairing: float32 [N, rotary_dim], or [B, 1, N, rotary_dim] when batch is given."""
    shape = (length, rotary_dim // 2) if batch is None else (batch, 1, length, rotary_dim // 2)
    theta = torch.rand(shape, dtype=torch.float64) * 20 - 10
    scale = 0.5 + torch.rand(shape, dtype=torch.float64)
    cos = angle_layout(theta.cos() * scale, half_pairing).float()
    sin = angle_layout(theta.sin() * scale, half_pairing).float()
    return cos, sin


def make_x(shape: tuple[int, int, int, int], dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """x [B, H, N, D]; transposed: a [B, N, H, D] tensor viewed as [B, H, N, D]."""
    batch, heads, length, dim = shape
    if transposed:
        return torch.randn(batch, length, heads, dim).to(dtype).transpose(1, 2)
    return torch.randn(shape).to(dtype)


@needs_triton
@pytest.mark.parametrize("half_pairing", [True, False], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 6], ids=["full", "partial"])
@pytest.mark.parametrize("batched", [False, True], ids=["shared", "batched"])
@pytest.mark.parametrize("transposed", [False, True], ids=["bhnd", "bnhd_view"])
def test_float32_output_and_gradient_match_the_float64_formula(
    interpreted: ModuleType, half_pairing: bool, rotary_dim: int, batched: bool, transposed: bool
) -> None:
    x = make_x((2, 3, 5, 16), torch.float32, transposed).requires_grad_()
    cos, sin = cos_sin(2 if batched else None, 5, rotary_dim, half_pairing)
    out = interpreted.fused_rotation(x, cos, sin, rotary_dim, half_pairing)
    grad = torch.randn(out.shape)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    want = oracle(x64, cos, sin, rotary_dim, half_pairing)
    want.backward(grad.double())
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert x.grad is not None and x64.grad is not None
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("half_pairing", [True, False], ids=["half", "interleaved"])
def test_half_precision_is_rounded_once(
    interpreted: ModuleType, dtype: torch.dtype, half_pairing: bool
) -> None:
    """Computed in float32 from x's values and rounded once: within one unit in the last
    place of the float64 result. float16 is rounded to nearest (but for float32 error at
    ties); Triton 3.6's interpreter truncates float32 -> bfloat16 where the compiled
    kernel rounds to nearest even, so bfloat16's rounding is checked on CUDA
    (tests/test_gpu.py)."""
    x = make_x((2, 2, 7, 12), dtype, transposed=True).requires_grad_()
    cos, sin = cos_sin(None, 7, 8, half_pairing)
    out = interpreted.fused_rotation(x, cos, sin, 8, half_pairing)
    grad = torch.randn(out.shape).to(dtype)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    want = oracle(x64, cos, sin, 8, half_pairing)
    want.backward(grad.double())
    assert out.dtype == dtype and x.grad is not None and x64.grad is not None
    ulp = torch.finfo(dtype).eps  # relative spacing at 1
    for got, exact in ((out, want), (x.grad, x64.grad)):
        error = (got.double() - exact).abs()
        assert bool((error <= ulp * exact.abs() + 1e-30).all())
        if dtype == torch.float16:
            assert (got != exact.to(dtype)).float().mean() < 0.02  # nearly all to nearest


@needs_triton
def test_pass_through_features_are_copied_exactly(interpreted: ModuleType) -> None:
    x = make_x((1, 2, 3, 10), torch.bfloat16, transposed=False)
    cos, sin = cos_sin(None, 3, 4, True)
    out = interpreted.fused_rotation(x, cos, sin, 4, True)
    assert torch.equal(out[..., 4:], x[..., 4:])


@needs_triton
@pytest.mark.parametrize(
    "name", ["rope", "rope_gptj", "rope_partial", "rope_xpos", "rope_mrope", "rope_p"]
)
def test_generated_rotate_uses_the_kernel_and_matches_eager(
    interpreted: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    request: pytest.FixtureRequest,
) -> None:
    """rotate() through the kernel (CPU served under the interpreter) against the same
    module's eager path: outputs and gradients, default and batched explicit positions."""
    head_dim = head_dim_for(name, 16)
    pe = generated_class(name)(heads=2, head_dim=head_dim)
    launches: list[bool] = []
    launch = interpreted.launch_rotation

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(True)
        return launch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(interpreted, "launch_rotation", counted)
    q = torch.randn(2, 2, 5, head_dim, requires_grad=True)
    k = torch.randn(2, 2, 7, head_dim, requires_grad=True)
    positions = torch.tensor([[3, 9, 4, 0, 11, 2, 6], [1, 2, 3, 4, 5, 6, 7]])
    for q_positions, k_positions in ((None, None), (positions[:, 2:], positions)):
        results = []
        for devices in (["cuda", "cpu"], ["cuda"]):  # kernel, then eager
            monkeypatch.setattr(kernel, "FUSED_ROTATION_DEVICES", devices)
            q.grad = k.grad = None
            q_rot, k_rot = pe.rotate(q, k, q_positions, k_positions)
            (q_rot.sin().sum() + (k_rot * k_rot).sum()).backward()
            results.append((q_rot.detach(), k_rot.detach(), q.grad, k.grad))
        for got, want in zip(*results, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(launches) == 8  # q and k, forward and backward, at both position kinds


@needs_triton
def test_bad_input_is_a_value_error(interpreted: ModuleType) -> None:
    x = torch.randn(1, 2, 3, 8)
    cos, sin = cos_sin(None, 3, 8, True)
    with pytest.raises(ValueError, match="cos must be"):
        interpreted.fused_rotation(x, cos[:2], sin[:2], 8, True)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        interpreted.fused_rotation(x, cos, sin, 7, True)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        interpreted.fused_rotation(x.double(), cos, sin, 8, True)
    with pytest.raises(ValueError, match="share a shape"):
        interpreted.fused_rotation(x, cos, sin[..., :4], 8, True)


def test_dispatch_keeps_the_eager_path_where_the_kernel_does_not_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float64, gradients into cos, compiling, and (by default) CPU take the formula."""
    monkeypatch.setattr(kernel, "triton_available", lambda: True)
    x, cos = torch.randn(1, 2, 3, 8), torch.randn(3, 8)
    assert not kernel.fused_rotation_enabled(x, cos, cos)  # CPU is not served by default
    monkeypatch.setattr(kernel, "FUSED_ROTATION_DEVICES", ["cpu"])
    assert kernel.fused_rotation_enabled(x, cos, cos)
    assert not kernel.fused_rotation_enabled(x.double(), cos, cos)
    learned = cos.clone().requires_grad_()
    assert not kernel.fused_rotation_enabled(x, learned, cos)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kernel.fused_rotation_enabled(x, cos, cos)


def test_heads_are_split_only_when_the_grid_would_leave_sms_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kernel, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert kernel._heads_per_program(cuda, 4 * 256, 32) == 32  # 1024 row programs: enough
    assert kernel._heads_per_program(cuda, 16, 32) == 1  # decoding-sized: one head each
    assert kernel._heads_per_program(cuda, 64, 32) == 2  # 64 x 16 programs >= 4 x 132
    assert kernel._heads_per_program(torch.device("cpu"), 1, 32) == 32
    monkeypatch.setattr(kernel, "FUSED_ROTATION_HEADS_PER_PROGRAM", 8)
    assert kernel._heads_per_program(cuda, 1, 32) == 8


def test_the_runtime_works_without_triton() -> None:
    """With triton unimportable the runtime imports and rotary modules take the formula."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import generated._triton as triton_support\n"
        "from generated.rope import Rope\n"
        "assert not triton_support.triton_available()\n"
        "q = torch.randn(1, 2, 4, 8, requires_grad=True)\n"
        "q_rot, _ = Rope(heads=2, head_dim=8).rotate(q, q)\n"
        "q_rot.sum().backward()\n"
        "assert q.grad is not None\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
