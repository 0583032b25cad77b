"""backend="flex" (FlexAttention) against the eager oracle on every catalogue encoding.

On CPU the modules run FlexAttention's unfused reference (flex_compile None); one test
runs the torch.compile'd kernel, shared by the encodings it covers."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from posgen.codegen.inmemory import encoding_class, module_from_spec
from tests.conftest import (
    ROOT,
    generated_class,
    head_dim_for,
    runtime_modules,
    small_clip_variant,
    spec_names,
    spy_calls,
)

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

NAMES = spec_names()


def _make(name: str, heads: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return generated_class(name)(heads=heads, head_dim=head_dim_for(name, 8)).eval()


def _inputs(pe: torch.nn.Module, batch: int = 2, n: int = 5, m: int = 7, kv_heads: int = 2):
    generator = torch.Generator().manual_seed(1)
    d = pe.head_dim
    value_dim = getattr(pe, "value_dim", None) or 8
    q = torch.randn(batch, pe.heads, n, d, generator=generator, requires_grad=True)
    k = torch.randn(batch, kv_heads, m, d, generator=generator, requires_grad=True)
    v = torch.randn(batch, kv_heads, m, value_dim, generator=generator, requires_grad=True)
    return q, k, v


POSITIONS = {
    "default": {},
    "explicit": {"q_positions": torch.tensor([3, 4, 6, 8, 9]), "k_positions": torch.arange(7)},
    "batched": {
        "q_positions": torch.tensor([[3, 4, 6, 8, 9], [10, 11, 12, 13, 14]]),
        "k_positions": torch.tensor([[0, 1, 2, 3, 4, 5, 6], [8, 9, 10, 11, 12, 13, 14]]),
    },
}


@pytest.mark.parametrize(("batch", "n", "m"), [(2, 0, 7), (2, 0, 0), (0, 5, 7)])
def test_flex_refuses_a_value_term_whatever_the_shape(batch: int, n: int, m: int) -> None:
    """Shaw's value term needs the weights: flex refuses it for empty inputs as well,
    which every backend otherwise answers without attending."""
    pe = _make("shaw")
    q, k, v = _inputs(pe, batch=batch, n=n, m=m)
    with pytest.raises(ValueError, match='backend="flex" cannot add a value-side term'):
        pe(q, k, v, backend="flex")
    assert pe(q, k, v, backend="sdpa").shape == (batch, pe.heads, n, v.shape[-1])


@pytest.mark.parametrize("name", NAMES)
def test_flex_matches_eager_outputs_and_gradients(name: str) -> None:
    pe = _make(name)
    q, k, v = _inputs(pe)
    if pe.has_value_term:
        with pytest.raises(ValueError, match="value-side term"):
            pe(q, k, v, backend="flex")
        return
    params = [p for p in pe.parameters() if p.requires_grad]
    for positions in POSITIONS.values():
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            flex = pe(q, k, v, causal=causal, backend="flex", **positions)
            torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
            inputs = [q, k, v, *params]
            want = torch.autograd.grad(eager.square().sum(), inputs, allow_unused=True)
            got = torch.autograd.grad(flex.square().sum(), inputs, allow_unused=True)
            for a, b in zip(got, want, strict=True):
                if b is None:
                    continue
                assert a is not None
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "t5", "rope", "kerple_log", "deberta", "cope"])
def test_flex_masks_bf16_and_fully_masked_rows(name: str) -> None:
    pe = _make(name)
    q, k, v = (t.detach() for t in _inputs(pe))
    allowed = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    allowed[0, :, 2] = False  # a fully masked query row: zeros, as SDPA gives
    allowed[1, :, :, 0] = False
    for mask in (allowed, torch.where(allowed, 0.0, -30.0)):
        eager = pe(q, k, v, attn_mask=mask, backend="eager")
        flex = pe(q, k, v, attn_mask=mask, backend="flex")
        torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
    assert bool((pe(q, k, v, attn_mask=allowed, backend="flex")[0, :, 2] == 0).all())
    half = pe(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend="flex")
    full = pe(q, k, v, causal=True, backend="eager")
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=2e-2, atol=2e-2)


def test_flex_reads_m_rope_axis_positions() -> None:
    pe = _make("rope_mrope")
    q, k, v = (t.detach() for t in _inputs(pe, n=6, m=6))
    axes = torch.randint(0, 9, (3, 2, 6))
    eager = pe(q, k, v, q_positions=axes, k_positions=axes, causal=True, backend="eager")
    flex = pe(q, k, v, q_positions=axes, k_positions=axes, causal=True, backend="flex")
    torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)


EXPR_SPEC = ROOT / "tests" / "specs" / "expr" / "kerple_log_expr.yaml"


def test_an_expression_bias_is_computed_inside_the_score_mod() -> None:
    """KERPLE-log written as an expression: flex computes it per element (no [H, N, M]
    tensor is captured), equal to eager, gradients included, at every position kind."""
    torch.manual_seed(0)
    pe = encoding_class(module_from_spec(EXPR_SPEC))(heads=4, head_dim=8)
    q, k, v = _inputs(pe)
    assert pe._flex_bias(None, None, 5, 7, q.device, torch.float32) is not None
    params = list(pe.parameters())
    for positions in POSITIONS.values():
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            flex = pe(q, k, v, causal=causal, backend="flex", **positions)
            torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
            want = torch.autograd.grad(eager.square().sum(), [q, *params])
            got = torch.autograd.grad(flex.square().sum(), [q, *params])
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name", ["bert_relative_key", "bert_relative_key_query", "deberta", "transformer_xl"]
)
def test_relative_terms_reach_flex_as_projections_not_dense_terms(name: str) -> None:
    """Default positions: each relative term is its projection over the K rows, read per
    element (O(N·K) captured); flex with them equals eager."""
    pe = _make(name)
    q, k, v = (t.detach() for t in _inputs(pe, kv_heads=4))
    heads_k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    parts = pe._relative_parts(q, heads_k, torch.float32)
    assert parts
    for part in parts:
        if part.side in ("query", "key"):
            assert part.scores.shape[2] in (5, 7) and part.scores.shape[-1] < 5 * 7
        if part.diagonal is not None:
            assert part.diagonal.shape == (5 + 7 - 1,)
    for causal in (False, True):
        flex = pe(q, k, v, causal=causal, backend="flex")
        eager = pe(q, k, v, causal=causal, backend="eager")
        torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bert_relative_key", "bert_relative_key_query", "deberta"])
def test_clipped_relative_terms_at_given_positions_are_read_from_projections(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positions that are no shift of the defaults (strided, per batch row): terms clipped
    at K reach flex as projections over the 2K + 1 rows' diagonal, read per score at
    clip(j - i, -K, K) + K, so flex captures no [B, H, N, M] tensor; small clips, so
    positions reach past them on both sides; equal to eager with gradients."""
    torch.manual_seed(0)
    extra = {"model_dim": 16} if name == "deberta" else {}
    pe = small_clip_variant(name)(heads=4, head_dim=8, **extra)
    # what each call's score_mod captures as a tensor per pair (its second argument)
    captured = spy_calls(monkeypatch, runtime_modules(pe), "flex_score_mod", lambda *a: a[1])
    clip = pe.relative_clip
    assert clip is not None and clip < 13
    heads_k = torch.randn(2, 4, 9, 8)
    parts = pe._clipped_relative_parts(torch.randn(2, 4, 6, 8), heads_k, torch.float32)
    assert parts and all(
        part.diagonal is None or part.diagonal.shape == (2 * clip + 1,) for part in parts
    )
    q, k, v = _inputs(pe, n=6, m=9)
    params = [p for p in pe.parameters() if p.requires_grad]
    strided = {"q_positions": 3 * torch.arange(3, 9), "k_positions": 3 * torch.arange(9)}
    rows = torch.tensor([[0, 1, 2, 5, 9, 14, 15, 16, 30], [7, 8, 9, 10, 11, 12, 13, 14, 15]])
    batched = {"q_positions": rows[:, 3:], "k_positions": rows}
    for positions in (strided, batched):
        for causal in (False, True):
            captured.clear()
            flex = pe(q, k, v, causal=causal, backend="flex", **positions)
            assert captured == [None]
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
            want = torch.autograd.grad(eager.square().sum(), [q, k, *params])
            got = torch.autograd.grad(flex.square().sum(), [q, k, *params])
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["t5", "t5_decoder"])
def test_t5_past_max_distance_reads_a_clipped_vector(name: str) -> None:
    """N + M - 1 > 2 * MAX_DISTANCE + 1: without gradients into the table, flex reads
    table[bucket(clip(j - i))] from a [H, 2 * MAX_DISTANCE + 1] vector (all it
    captures); with them, the distance vector (no atomic adds onto 257 entries). Both
    equal eager, at default and shifted positions, causal and not."""
    pe = _make(name, heads=2)
    n = 150  # distances up to 149 > MAX_DISTANCE = 128
    q, k, v = _inputs(pe, batch=1, n=n, m=n, kv_heads=1)
    bias = pe._flex_bias(None, None, n, n, q.device, torch.float32)
    assert bias is not None
    assert [tuple(t.shape) for t in runtime_captured(bias)] == [(2, 257)]
    table = pe.relative_attention_bias.weight
    shifted = {"q_positions": torch.arange(50, 50 + n), "k_positions": torch.arange(n)}
    for positions in ({}, shifted):
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            with torch.no_grad():
                clipped = pe(q, k, v, causal=causal, backend="flex", **positions)
            torch.testing.assert_close(clipped, eager, rtol=1e-5, atol=1e-5)
            flex = pe(q, k, v, causal=causal, backend="flex", **positions)
            torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
            want = torch.autograd.grad(eager.square().sum(), [q, table])
            got = torch.autograd.grad(flex.square().sum(), [q, table])
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_alibi_flex_bias_is_arithmetic_of_the_indices() -> None:
    """ALiBi's score_mod reads only its [heads] slopes: no per-distance vector."""
    pe = _make("alibi")
    bias = pe._flex_bias(None, None, 5, 7, torch.device("cpu"), torch.float32)
    assert [tuple(t.shape) for t in runtime_captured(bias)] == [(4,)]
    b, h = torch.tensor(0), torch.tensor(1)
    qi, ki = torch.tensor(1), torch.tensor(6)  # query at 2 + 1 = 3, key at 6
    want = -pe._exact_slopes(torch.device("cpu"))[1] * 3
    torch.testing.assert_close(bias(b, h, qi, ki), want)


def test_fire_flex_bias_computes_the_mlp_per_score() -> None:
    """FIRE without gradients into its weights: flex computes f(psi(i - j) / psi(max(i, L)))
    inside the score_mod, capturing only the MLP's weights, |c| and one normaliser per
    query (no [H, N, M] bias), equal to eager at every position kind, causal and not,
    with q's gradient too."""
    pe = _make("fire")
    with torch.no_grad():  # kinks inside [0, 1], where psi's ratio lies; L = 5.12
        pe.fire_mlp[0].bias.copy_(-torch.linspace(0.0, 1.0, pe.fire_mlp[0].bias.numel()))
        pe.fire_mlp[0].weight.fill_(1.5)
        pe.fire_threshold_scale.fill_(0.01)  # so that queries past L have their own
    pe.requires_grad_(False)
    q, k, v = _inputs(pe)
    bias = pe._flex_bias(None, None, 5, 7, q.device, torch.float32)
    hidden = pe.fire_mlp[0].bias.numel()
    shapes = sorted(tuple(t.shape) for t in runtime_captured(bias))
    assert shapes == sorted([(), (1, 5), (hidden,), (hidden,), (4, hidden), (4,)])
    indices = [
        torch.arange(size).view([-1 if d == a else 1 for d in range(4)])
        for a, size in enumerate((2, 4, 5, 7))
    ]  # b, h, qi, ki: broadcast
    for positions in POSITIONS.values():
        given = (positions.get("q_positions"), positions.get("k_positions"))
        per_score = pe._flex_bias(*given, 5, 7, q.device, torch.float32)(*indices)
        want_bias = pe._position_bias(*given, 5, 7, q.device)  # [(B,) H, N, M]
        torch.testing.assert_close(per_score, want_bias.expand(2, 4, 5, 7), rtol=1e-5, atol=1e-6)
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            flex = pe(q, k, v, causal=causal, backend="flex", **positions)
            torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
            want = torch.autograd.grad(eager.square().sum(), q)
            got = torch.autograd.grad(flex.square().sum(), q)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def runtime_captured(function: object) -> list[torch.Tensor]:
    """The tensors a score_mod (or a bias function it calls) closes over."""
    found: list[torch.Tensor] = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a name the closure never bound
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, torch.Tensor):
                found.append(item)
            elif callable(item):
                found.extend(runtime_captured(item))
    return found


def test_compiled_flex_matches_eager_and_is_compiled_once() -> None:
    """The torch.compile'd kernel (CPU here: forward only, FlexAttention has no CPU
    backward), one compiled function shared by ALiBi's per-distance vector, T5's,
    DeBERTa's c2p and p2c read from their [B, H, N, K] projections, an expression bias
    and FIRE's MLP computed inside the score_mod (FIRE not causal only: each compile
    takes 10-15 s here)."""
    import generated._flex as flex_runtime

    expression = encoding_class(module_from_spec(EXPR_SPEC))
    for name in ("alibi", "t5", "deberta", "expression", "fire"):
        pe = expression(heads=4, head_dim=8) if name == "expression" else _make(name)
        pe.flex_compile = True
        q, k, v = (t.detach() for t in _inputs(pe, batch=1, n=16, m=16))
        with torch.no_grad():
            for causal in (False,) if name == "fire" else (False, True):
                eager = pe(q, k, v, causal=causal, backend="eager")
                flex = pe(q, k, v, causal=causal, backend="flex")
                torch.testing.assert_close(flex, eager, rtol=1e-4, atol=1e-4)
    assert list(flex_runtime._COMPILED_FLEX) == ["flex"]


@pytest.mark.parametrize(
    ("device", "width", "score_mod", "small_tiles"),
    [
        ("cuda", 64, True, True),  # a score_mod reads captured tables
        ("cuda", 64, False, False),  # FlashAttention-like: torch's own tiles
        ("cuda", 130, False, True),  # TUPE-A folded: padded to 256, three stages overflow
        ("cuda", 192, False, True),
        ("cuda", 256, False, False),  # a width torch has tiles for
        ("cpu", 130, True, False),
    ],
)
def test_flex_kernel_options_shrink_tiles_where_the_defaults_overflow_shared_memory(
    device: str, width: int, score_mod: bool, small_tiles: bool
) -> None:
    """On an H100 (torch 2.11) the compiled flex kernel ran out of shared memory with
    FlexAttention's default tiles for a score_mod and for TUPE-A's 130 folded features;
    only the kernel options' choice is tested here (the device and width are all it
    reads), the kernels themselves in tests/test_gpu.py."""
    (options,) = {
        vars(m)["flex_kernel_options"]
        for m in runtime_modules()
        if "flex_kernel_options" in vars(m)
    }
    q = SimpleNamespace(device=torch.device(device), shape=(1, 1, 1, width))
    small = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1}
    assert options(q, score_mod) == (small if small_tiles else None)


def test_the_unfused_cpu_flex_call_gives_no_warning() -> None:
    """flex on the CPU runs unfused on purpose (``flex_compile = False``, documented);
    torch's once-per-process advice to compile printed a screenful on the first call. In
    a fresh process, where that warning has not yet been given, every UserWarning is an
    error."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = (
        "import torch\n"
        "from generated.alibi import Alibi\n"
        "pe = Alibi(heads=4, head_dim=8)\n"
        "q = torch.randn(1, 4, 6, 8)\n"
        "print(tuple(pe(q, q, q, backend='flex').shape))\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(1, 4, 6, 8)"
