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

from tests.conftest import SPECS, generated_class, head_dim_for, spec_names, spec_variant
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
    shifted = pe.scores(
        q, k, q_positions=torch.arange(100, 105), k_positions=torch.tensor([9, 3, 0, 7, 1, 2, 5])
    )
    torch.testing.assert_close(shifted, expected, atol=1e-12, rtol=1e-12)
    assert set(pe.score_terms(q, k)) == {"content_content"}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_nope_causal_attention_matches_reference(backend: str) -> None:
    pe = make("nope", heads=2, head_dim=8)
    q = torch.randn(2, 2, 4, 8, dtype=F64)
    k = torch.randn(2, 2, 6, 8, dtype=F64)
    v = torch.randn(2, 2, 6, 5, dtype=F64)
    expected = ref.attention(
        q,
        k,
        v,
        scale=1 / math.sqrt(8),
        causal_q_positions=torch.arange(2, 6),
        causal_k_positions=torch.arange(6),
    )
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


@pytest.mark.parametrize("name", spec_names())
def test_embed_without_an_input_level_part_checks_its_arguments(name: str) -> None:
    """An encoding with no input-level part returns x itself, after the checks an
    encoding with one makes (so that a model switching encodings keeps its errors)."""
    pe = make(name, heads=2, head_dim=head_dim_for(name, 8))
    if hasattr(pe, "model_dim"):
        return  # an input-level part: its contract is assert_embed_contract's
    x = torch.randn(2, 6, 10)
    assert pe.embed(x) is x
    assert pe.embed(x, torch.stack([torch.arange(6), torch.arange(6) + 3])) is x
    bad = {
        "2-D x": lambda: pe.embed(x[0]),
        "integer x": lambda: pe.embed(x.long()),
        "float8 x": lambda: pe.embed(x.to(torch.float8_e4m3fn)),
        "not a tensor": lambda: pe.embed([[0.0] * 10]),
        "float positions": lambda: pe.embed(x, torch.arange(6, dtype=torch.float32)),
        "negative positions": lambda: pe.embed(x, torch.arange(-1, 5)),
        "positions length": lambda: pe.embed(x, torch.arange(7)),
        "positions batch": lambda: pe.embed(x, torch.zeros(3, 6, dtype=torch.long)),
    }
    for label, call in bad.items():
        with pytest.raises(ValueError, match="x must|positions"):
            call()
            pytest.fail(f"{label} was accepted")


# ------------------------------------------------------------------------------ embed contract


def assert_embed_contract(
    pe, *, seq: int = 6, bad_position: int | None = None, explicit_positions: bool = True
) -> None:
    """Shapes, dtype kept, ValueError for bad input, gradient reaches every parameter."""
    d = pe.model_dim
    x = torch.randn(2, seq, d)
    out = pe.embed(x)
    assert out.shape == (2, seq, d) and out.dtype == torch.float32
    for dtype in (torch.float64, torch.bfloat16):
        assert pe.embed(x.to(dtype)).dtype == dtype
    assert pe.embed(x[:, :0]).shape == (2, 0, d)  # no tokens: nothing to encode
    batched = torch.stack([torch.arange(seq), torch.arange(3, 3 + seq)])
    if explicit_positions:
        assert pe.embed(x, batched).shape == (2, seq, d)
        torch.testing.assert_close(pe.embed(x, torch.arange(seq)), out)
    else:
        with pytest.raises(ValueError, match="positions"):
            pe.embed(x, torch.arange(seq))
    bad = {
        "2-D x": lambda: pe.embed(x[0]),
        "wrong width": lambda: pe.embed(x[..., :-1]),
        "integer x": lambda: pe.embed(x.long()),
        "not a tensor": lambda: pe.embed([[0.0] * d]),
        "float positions": lambda: pe.embed(x, torch.arange(seq, dtype=torch.float32)),
        "negative positions": lambda: pe.embed(x, torch.arange(-1, seq - 1)),
        "positions length": lambda: pe.embed(x, torch.arange(seq + 1)),
        "positions batch": lambda: pe.embed(x, torch.zeros(3, seq, dtype=torch.long)),
    }
    if bad_position is not None:
        bad["position out of range"] = lambda: pe.embed(
            x, torch.full((seq,), bad_position, dtype=torch.long)
        )
    for label, call in bad.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"{label} was accepted")
    if bad_position is not None:  # the message names the argument
        with pytest.raises(ValueError, match=r"^positions: position \d+ is "):
            bad["position out of range"]()
    parameters = dict(pe.named_parameters())
    if parameters:
        pe.zero_grad()
        pe.embed(x).square().sum().backward()
        for name, parameter in parameters.items():
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "name",
    ["learned_absolute", "sinusoidal", "multiplicative_learned", "multiplicative_sinusoidal"],
)
def test_table_embed_contract(name: str) -> None:
    pe = make(name, model_dim=16)
    bad = pe.max_positions if hasattr(pe, "max_positions") else None
    assert_embed_contract(pe, bad_position=bad)


# ------------------------------------------------------------------------------ add / multiply


@pytest.mark.parametrize(
    "name,how", [("sinusoidal", "add"), ("multiplicative_sinusoidal", "multiply")]
)
def test_sinusoidal_embed_matches_reference(name: str, how: str) -> None:
    pe = make(name, model_dim=12)
    x = torch.randn(2, 7, 12, dtype=F64)
    positions = torch.tensor([0, 1, 2, 3, 50, 999, 4096])
    table = torch.stack([ref.sinusoidal_table(5000, 12)[int(p)] for p in positions])
    expected = ref_abs.combine_input(x, table, how)
    torch.testing.assert_close(pe.embed(x, positions), expected, atol=1e-12, rtol=1e-12)
    default = ref_abs.combine_input(x, ref.sinusoidal_table(7, 12), how)
    torch.testing.assert_close(pe.embed(x), default, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "name,how", [("learned_absolute", "add"), ("multiplicative_learned", "multiply")]
)
def test_learned_embed_matches_reference(name: str, how: str) -> None:
    pe = make(name, model_dim=8).double()
    x = torch.randn(2, 5, 8, dtype=F64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 1023, 0, 5]])
    weight = pe.position_embeddings.weight.detach()
    table = torch.stack([torch.stack([weight[int(p)] for p in row]) for row in positions])
    expected = ref_abs.combine_input(x, table, how)
    torch.testing.assert_close(pe.embed(x, positions), expected, atol=1e-14, rtol=1e-14)


def test_multiplicative_sinusoid_zeroes_sine_features_at_position_zero() -> None:
    """Documented behaviour: sin(0) = 0 removes the even (sine) features at position 0."""
    pe = make("multiplicative_sinusoidal", model_dim=8)
    x = torch.randn(1, 3, 8, dtype=F64)
    out = pe.embed(x)
    assert torch.equal(out[0, 0, 0::2], torch.zeros(4, dtype=F64))
    torch.testing.assert_close(out[0, 0, 1::2], x[0, 0, 1::2])  # cos(0) = 1 keeps x
    assert (out[0, 1, 0::2] != 0).all()


def test_multiplicative_learned_gains_start_near_one() -> None:
    pe = make("multiplicative_learned")
    weight = pe.position_embeddings.weight
    assert weight.shape == (1024, 768)
    assert abs(weight.mean().item() - 1.0) < 1e-3 and abs(weight.std().item() - 0.02) < 1e-3
    x = torch.randn(1, 4, 768)
    assert (pe.embed(x) - x).abs().max() < 0.2 * x.abs().max()


# ------------------------------------------------------------------------------ hierarchical


def test_hierarchical_embed_contract() -> None:
    pe = make("hierarchical_absolute", model_dim=16)
    assert pe.max_positions == 512 * 512
    assert_embed_contract(pe, bad_position=512 * 512)


def test_hierarchical_embed_matches_reference() -> None:
    pe = make("hierarchical_absolute", model_dim=8).double()
    u = pe.position_embeddings.weight.detach()
    positions = torch.tensor([[0, 1, 511, 512, 513, 1024], [262143, 70000, 5, 1023, 3, 512 * 300]])
    x = torch.randn(2, 6, 8, dtype=F64)
    table = torch.stack(
        [torch.stack([ref.hierarchical_position(u, int(p), 0.4) for p in row]) for row in positions]
    )
    expected = ref_abs.combine_input(x, table, "add")
    torch.testing.assert_close(pe.embed(x, positions), expected, atol=1e-14, rtol=1e-14)
    with pytest.raises(ValueError, match="262144"):
        pe.embed(x, positions + 1)


def test_hierarchical_order_of_the_two_digits_matters() -> None:
    """alpha != 0.5: positions i*n + j and j*n + i get different encodings."""
    pe = make("hierarchical_absolute", model_dim=8)
    x = torch.zeros(1, 2, 8)
    out = pe.embed(x, torch.tensor([3 * 512 + 7, 7 * 512 + 3]))
    assert not torch.allclose(out[0, 0], out[0, 1])


def test_hierarchical_extends_a_trained_bert_table() -> None:
    """BERT's learned table loads through load_absolute_table: positions < n give BERT's
    vectors exactly, positions up to n^2 - 1 follow the reference decomposition."""
    from transformers import BertConfig, BertModel

    n, d = 16, 8
    config = BertConfig(
        vocab_size=32,
        hidden_size=d,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=n,
    )
    bert = BertModel(config).double().eval()
    p = bert.embeddings.position_embeddings.weight.detach()
    # the catalogue spec with a 16-row basis, to match this small BERT
    pe = spec_variant("hierarchical_absolute", ("base_positions: 512", f"base_positions: {n}"))
    pe = pe(model_dim=d).double()
    pe.load_absolute_table(p)
    torch.testing.assert_close(
        pe.position_embeddings.weight.detach(),
        ref.hierarchical_basis_from_absolute(p, 0.4),
        atol=1e-14,
        rtol=1e-14,
    )
    x = torch.randn(1, n, d, dtype=F64)
    # positions below n reproduce BERT's position embeddings
    bert_positions = bert.embeddings.position_embeddings(torch.arange(n))
    torch.testing.assert_close(pe.embed(x), x + bert_positions, atol=1e-12, rtol=1e-12)
    far = torch.tensor([n, n + 1, 5 * n + 3, n * n - 1])
    expected = torch.stack(
        [
            ref.hierarchical_position(ref.hierarchical_basis_from_absolute(p, 0.4), int(q), 0.4)
            for q in far
        ]
    )
    torch.testing.assert_close(pe.embed(x[:, :4], far), x[:, :4] + expected, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError):
        pe.embed(x[:, :1], torch.tensor([n * n]))
    with pytest.raises(ValueError):
        pe.load_absolute_table(p[:-1])


# ------------------------------------------------------------------------------ convolutional


def conv_class(padding: str):
    if padding == "same":
        return generated_class("convolutional")
    return spec_variant("convolutional", ("padding: same", "padding: causal"))


@pytest.mark.parametrize("padding", ["same", "causal"])
def test_convolutional_embed_contract(padding: str) -> None:
    assert_embed_contract(conv_class(padding)(model_dim=16).eval(), explicit_positions=False)


@pytest.mark.parametrize("padding", ["same", "causal"])
@pytest.mark.parametrize("kernel", [3, 5])
def test_convolutional_embed_matches_reference(padding: str, kernel: int) -> None:
    cls = spec_variant(
        "convolutional",
        ("kernel_size: 3", f"kernel_size: {kernel}"),
        ("padding: same", f"padding: {padding}"),
    )
    pe = cls(model_dim=6)
    assert tuple(pe.position_conv.weight.shape) == (6, 1, kernel)
    x = torch.randn(2, 9, 6, dtype=F64)
    conv = pe.position_conv
    expected = x + ref_abs.depthwise_conv1d(x, conv.weight.detach(), conv.bias.detach(), padding)
    torch.testing.assert_close(pe.embed(x), expected, atol=1e-12, rtol=1e-12)
    # float32 input is computed in float32 and stays float32
    torch.testing.assert_close(pe.embed(x.float()), expected.float(), atol=1e-5, rtol=1e-5)


def test_causal_convolution_reads_only_earlier_tokens() -> None:
    pe = conv_class("causal")(model_dim=4)
    x = torch.randn(1, 8, 4, dtype=F64, requires_grad=True)
    out = pe.embed(x)
    for i in range(8):
        (grad,) = torch.autograd.grad(out[0, i].sum(), x, retain_graph=True)
        touched = grad[0].abs().sum(dim=-1) > 0
        assert not touched[i + 1 :].any(), f"output {i} reads a later token"
        assert touched[max(0, i - 2) : i + 1].all()  # kernel 3: tokens i-2 .. i
    # and the 'same' kernel does read the next token
    same = conv_class("same")(model_dim=4)
    out = same.embed(x)
    (grad,) = torch.autograd.grad(out[0, 3].sum(), x)
    assert grad[0, 4].abs().sum() > 0


def test_convolutional_positions_come_from_content_and_edges() -> None:
    """Constant content: interior tokens get one encoding, only the padded edges differ."""
    pe = conv_class("same")(model_dim=4)
    x = torch.ones(1, 6, 4, dtype=F64)
    c = pe.embed(x) - x
    for i in range(2, 5):
        torch.testing.assert_close(c[0, i], c[0, 1])
    assert not torch.allclose(c[0, 0], c[0, 1]) and not torch.allclose(c[0, 5], c[0, 4])
    # zero content: only the bias is left, the same at every position
    zero = pe.embed(torch.zeros(1, 6, 4, dtype=F64))
    torch.testing.assert_close(zero[0], pe.position_conv.bias.detach().double().expand(6, 4))


# ------------------------------------------------------------------------------ complex order


def _complex_reference(r, omega, theta, positions):
    """ref.complex_order_embedding per batch row; omega/theta [B, S, D] or [D]."""
    reals, imags = [], []
    for b in range(r.shape[0]):
        row_positions = positions if positions.dim() == 1 else positions[b]
        w = omega if omega.dim() == 1 else omega[b]
        t = theta if theta.dim() == 1 else theta[b]
        real, imag = ref.complex_order_embedding(r[b], w, t, row_positions)
        reals.append(real)
        imags.append(imag)
    return torch.stack(reals), torch.stack(imags)


def test_complex_order_per_token_matches_reference() -> None:
    pe = make("complex_order", model_dim=6)
    r = torch.randn(2, 5, 6, dtype=F64)
    omega = torch.rand(2, 5, 6, dtype=F64) * 3
    theta = torch.rand(2, 5, 6, dtype=F64) * 6.28
    positions = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 500, 7, 100000]])
    real, imag = pe.embed(r, positions, frequency=omega, phase=theta)
    exp_real, exp_imag = _complex_reference(r, omega, theta, positions)
    torch.testing.assert_close(real, exp_real, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(imag, exp_imag, atol=1e-12, rtol=1e-12)
    # per-feature omega / theta given by the caller broadcast over tokens
    real, imag = pe.embed(r, frequency=omega[0, 0], phase=theta[0, 0])
    exp_real, exp_imag = _complex_reference(r, omega[0, 0], theta[0, 0], torch.arange(5))
    torch.testing.assert_close(
        torch.complex(real, imag), torch.complex(exp_real, exp_imag), atol=1e-12, rtol=1e-12
    )


def test_complex_order_learned_fallbacks() -> None:
    pe = make("complex_order", model_dim=4)
    expected_omega = torch.tensor([10000.0 ** (-d / 4) for d in range(4)])
    torch.testing.assert_close(pe.frequency.detach(), expected_omega)
    assert torch.equal(pe.phase.detach(), torch.zeros(4))
    with torch.no_grad():
        pe.phase.copy_(torch.tensor([0.1, -0.2, 0.3, 1.0]))
    r = torch.randn(1, 3, 4, dtype=F64)
    real, imag = pe.embed(r)
    exp_real, exp_imag = _complex_reference(
        r, pe.frequency.detach(), pe.phase.detach(), torch.arange(3)
    )
    torch.testing.assert_close(real, exp_real, atol=1e-7, rtol=1e-7)  # float32 parameters
    torch.testing.assert_close(imag, exp_imag, atol=1e-7, rtol=1e-7)
    # gradients reach the module's fallbacks and the caller's amplitude
    r32 = torch.randn(2, 3, 4, requires_grad=True)
    real, imag = pe.embed(r32, torch.tensor([5, 6, 7]))
    (real.sum() + 2 * imag.sum()).backward()
    for tensor in (pe.frequency, pe.phase, r32):
        assert tensor.grad is not None and tensor.grad.abs().sum() > 0
    # and a caller's per-token frequency gets its gradient instead
    omega = torch.rand(2, 3, 4, requires_grad=True)
    pe.zero_grad()
    real, _ = pe.embed(r32.detach(), torch.tensor([5, 6, 7]), frequency=omega)
    real.sum().backward()
    assert omega.grad is not None and omega.grad.abs().sum() > 0
    assert pe.frequency.grad is None or pe.frequency.grad.abs().sum() == 0


def test_complex_order_shift_is_a_phase_rotation() -> None:
    """Wang et al. 2020: moving a word by n multiplies each feature by exp(i omega n)."""
    pe = make("complex_order", model_dim=5)
    r, omega, theta = (torch.rand(1, 4, 5, dtype=F64) for _ in range(3))
    positions = torch.tensor([0, 3, 9, 20])
    z = torch.complex(*pe.embed(r, positions, frequency=omega, phase=theta))
    shifted = torch.complex(*pe.embed(r, positions + 7, frequency=omega, phase=theta))
    torch.testing.assert_close(
        shifted, z * torch.polar(torch.ones_like(omega), omega * 7), atol=1e-12, rtol=1e-12
    )
    assert torch.allclose(shifted.abs(), r)


def test_complex_order_embed_shapes_dtypes_and_errors() -> None:
    pe = make("complex_order", model_dim=8)
    x = torch.randn(2, 6, 8)
    real, imag = pe.embed(x)
    assert real.shape == imag.shape == (2, 6, 8) and real.dtype == torch.float32
    for dtype in (torch.float64, torch.bfloat16):
        real, imag = pe.embed(x.to(dtype), frequency=torch.rand(2, 6, 8, dtype=dtype))
        assert real.dtype == imag.dtype == dtype
    # long positions stay accurate for float32 input: angles are formed in float64
    far = torch.full((6,), 10**7)
    real, _ = pe.embed(x, far)
    exp_real, _ = _complex_reference(
        x.double(), pe.frequency.detach().double(), pe.phase.detach().double(), far
    )
    torch.testing.assert_close(real.double(), exp_real, atol=1e-5, rtol=1e-5)
    bad = {
        "2-D x": lambda: pe.embed(x[0]),
        "wrong width": lambda: pe.embed(x[..., :-1]),
        "integer x": lambda: pe.embed(x.long()),
        "float positions": lambda: pe.embed(x, torch.arange(6.0)),
        "negative positions": lambda: pe.embed(x, torch.arange(-1, 5)),
        "frequency shape": lambda: pe.embed(x, frequency=torch.rand(2, 5, 8)),
        "phase shape": lambda: pe.embed(x, phase=torch.rand(7)),
        "integer phase": lambda: pe.embed(x, phase=torch.zeros(2, 6, 8, dtype=torch.long)),
        "list frequency": lambda: pe.embed(x, frequency=[1.0] * 8),
    }
    for label, call in bad.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"{label} was accepted")


def test_complex_order_without_module_parameters_needs_callers_tables() -> None:
    cls = spec_variant(
        "complex_order",
        (
            "module_parameters: learned_per_feature   # fallback omega, theta when "
            "the caller has none\n  frequency_base: 10000",
            "module_parameters: none\n  #",
        ),
    )
    pe = cls(model_dim=4)
    assert list(pe.parameters()) == []
    r = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match="frequency is required"):
        pe.embed(r, phase=torch.zeros(4))
    with pytest.raises(ValueError, match="phase is required"):
        pe.embed(r, frequency=torch.ones(4))
    real, imag = pe.embed(r, frequency=torch.ones(4), phase=torch.zeros(4))
    torch.testing.assert_close(real[0, 2], r[0, 2] * math.cos(2.0))
    torch.testing.assert_close(imag[0, 2], r[0, 2] * math.sin(2.0))


# ------------------------------------------------------------------------------ FLOATER


def floater_class(
    integrator="rk4", steps=1, initial="zero", activation="relu", hidden=5, horizon=4096
):
    return spec_variant(
        "floater",
        ("hidden: 512", f"hidden: {hidden}"),
        ("integrator: rk4", f"integrator: {integrator}"),
        ("steps_per_position: 1", f"steps_per_position: {steps}"),
        ("initial: zero", f"initial: {initial}"),
        ("activation: tanh", f"activation: {activation}"),
        ("max_positions: 4096", f"max_positions: {horizon}"),
    )


def floater_reference(pe, count: int, integrator: str, steps: int, activation: str):
    h = ref_abs.floater_dynamics(
        pe.dynamics_in.weight,
        pe.dynamics_in.bias,
        pe.dynamics_out.weight,
        pe.dynamics_out.bias,
        activation,
    )
    p0 = (
        pe.initial_position.detach()
        if hasattr(pe, "initial_position")
        else torch.zeros(pe.model_dim)
    )
    return ref_abs.ode_trajectory(h, p0, count, 0.1, steps, integrator)


@pytest.mark.parametrize(
    "integrator,steps,initial,activation",
    [
        ("rk4", 1, "zero", "relu"),
        ("rk4", 3, "learned", "tanh"),
        ("euler", 2, "learned", "gelu"),
        ("euler", 1, "zero", "sigmoid"),
    ],
)
def test_floater_embed_matches_reference(integrator, steps, initial, activation) -> None:
    torch.manual_seed(1)
    pe = floater_class(integrator, steps, initial, activation)(model_dim=4).double()
    if initial == "learned":
        with torch.no_grad():
            pe.initial_position.normal_()  # a visible p_0
    with torch.no_grad():  # larger weights and biases than the init, so h is not tiny
        for layer in (pe.dynamics_in, pe.dynamics_out):
            layer.bias.normal_()
    x = torch.randn(2, 4, 4, dtype=F64)
    positions = torch.tensor([[0, 1, 2, 3], [11, 5, 0, 7]])
    path = floater_reference(pe, 12, integrator, steps, activation)
    expected = ref_abs.combine_input(x, path[positions], "add")
    torch.testing.assert_close(pe.embed(x, positions), expected, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(pe.trajectory(12, F64), path, atol=1e-11, rtol=1e-11)


def test_floater_rk4_converges_at_fourth_order() -> None:
    """The module's own integrator: halving its step divides the error by about 16."""
    torch.manual_seed(2)
    cls = {steps: floater_class("rk4", steps, "learned", "tanh") for steps in (2, 4)}
    state = cls[2](model_dim=3).double().state_dict()
    fine = None
    errors = []
    for steps in (2, 4):
        pe = cls[steps](model_dim=3).double()
        pe.load_state_dict(state)
        with torch.no_grad():
            pe.initial_position.copy_(torch.tensor([1.0, -1.0, 0.5]))
            for layer in (pe.dynamics_in, pe.dynamics_out):
                layer.weight.mul_(3.0)
        if fine is None:
            fine = floater_reference(pe, 8, "rk4", 64, "tanh")
        errors.append((pe.trajectory(8, F64).detach() - fine).abs().max().item())
    assert errors[0] / errors[1] == pytest.approx(16.0, rel=0.3)


def test_floater_embed_contract_and_horizon() -> None:
    pe = floater_class(initial="learned", horizon=8192)(model_dim=8)
    assert pe.max_positions == 8192
    assert_embed_contract(pe, bad_position=pe.max_positions)
    assert set(dict(pe.named_parameters())) == {
        "dynamics_in.weight",
        "dynamics_in.bias",
        "dynamics_out.weight",
        "dynamics_out.bias",
        "initial_position",
    }
    assert tuple(pe.dynamics_in.weight.shape) == (5, 9)
    assert tuple(pe.dynamics_out.weight.shape) == (8, 6)
    with pytest.raises(ValueError, match="horizon"):
        pe.embed(torch.zeros(1, 1, 8), torch.tensor([8192]))


def test_floater_is_defined_up_to_its_horizon_and_refuses_past_it() -> None:
    """The shipped spec bounds the cost of any position: 4096 integration steps at most."""
    pe = make("floater", model_dim=8)
    assert pe.max_positions == 4096
    with torch.no_grad():
        far = pe.embed(torch.zeros(1, 1, 8), torch.tensor([4095]))
        assert torch.isfinite(far).all() and far.abs().sum() > 0
        for position in (4096, 10**5, 10**6):
            with pytest.raises(ValueError, match="horizon of 4096"):
                pe.embed(torch.zeros(1, 1, 8), torch.tensor([position]))


def test_an_ode_table_without_a_horizon_is_a_spec_error(tmp_path) -> None:
    from posgen.spec.diagnostics import SpecError
    from posgen.spec.loader import load_spec

    text = (SPECS / "floater.yaml").read_text(encoding="utf-8")
    line = next(row for row in text.splitlines() if "max_positions:" in row)
    path = tmp_path / "floater.yaml"
    path.write_text(text.replace(line + "\n", ""), encoding="utf-8")
    with pytest.raises(SpecError, match="max_positions"):
        load_spec(path)


def test_floater_zero_initial_position_is_not_a_parameter() -> None:
    pe = make("floater", model_dim=8)
    assert "initial_position" not in dict(pe.named_parameters())
    x = torch.zeros(1, 3, 8)
    torch.testing.assert_close(pe.embed(x)[0, 0], torch.zeros(8))  # p(0) = 0
    assert pe.embed(x)[0, 2].abs().sum() > 0


def test_convolutional_grid_matches_reference_and_cpvt_peg_weights() -> None:
    """The 2-D form: float64 loop reference, and CPVT's PEG (a depthwise Conv2d whose
    output is added to the patch tokens) loads its weights directly."""
    pe = make("convolutional_grid", model_dim=4)
    x = torch.randn(2, 12, 4, dtype=F64)
    conv = pe.position_conv
    assert tuple(conv.weight.shape) == (4, 1, 3, 3)
    expected = x + ref_abs.depthwise_conv2d_grid(x, conv.weight.detach(), conv.bias.detach(), 3, 4)
    torch.testing.assert_close(pe.embed(x, grid=(3, 4)), expected, atol=1e-12, rtol=1e-12)
    # a PEG as CPVT writes it: tokens -> [B, C, H, W] -> proj(feat) + feat -> tokens
    peg = torch.nn.Conv2d(4, 4, 3, 1, 1, groups=4).double()
    pe.position_conv.load_state_dict(peg.state_dict())
    feat = x.transpose(1, 2).reshape(2, 4, 3, 4)
    cpvt = (peg(feat) + feat).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pe.embed(x, grid=(3, 4)), cpvt, atol=1e-12, rtol=1e-12)


def test_convolutional_grid_embed_errors_and_gradients() -> None:
    pe = make("convolutional_grid", model_dim=4)
    x = torch.randn(2, 6, 4)
    out = pe.embed(x, grid=(2, 3))
    assert out.shape == (2, 6, 4) and out.dtype == torch.float32
    assert pe.embed(x.to(torch.bfloat16), grid=(3, 2)).dtype == torch.bfloat16
    for bad in (None, (2, 2), (6,), (2.0, 3), [2, 3], (True, 6), (0, 6)):
        with pytest.raises(ValueError, match="grid"):
            pe.embed(x, grid=bad)
    with pytest.raises(ValueError, match="positions"):
        pe.embed(x, torch.arange(6), grid=(2, 3))
    with pytest.raises(ValueError):
        pe.embed(x[0], grid=(2, 3))
    pe.embed(x, grid=(2, 3)).square().sum().backward()
    assert pe.position_conv.weight.grad.abs().sum() > 0
    assert pe.position_conv.bias.grad.abs().sum() > 0


# ------------------------------------------------------------------------------ stated claims


def _position_vectors(pe, name: str, positions: torch.Tensor) -> torch.Tensor:
    """The per-position vectors p of an input table: embed of zeros (add) or ones (multiply)."""
    multiply = name.startswith("multiplicative")
    base = torch.ones if multiply else torch.zeros
    return pe.embed(base(1, positions.numel(), pe.model_dim, dtype=F64), positions)[0]


@pytest.mark.parametrize(
    "name,far",
    [
        ("sinusoidal", 10**6),
        ("multiplicative_sinusoidal", 10**6),
        ("hierarchical_absolute", 512 * 512 - 1),
        ("floater", 2000),
        ("learned_absolute", None),
        ("multiplicative_learned", None),
    ],
)
def test_stated_unique_and_extrapolates_claims(name: str, far: int | None) -> None:
    """unique: distinct positions get distinct vectors; extrapolates: far positions are
    finite, or (claim false) raise ValueError."""
    from posgen.spec.loader import load_spec

    claims = load_spec(SPECS / f"{name}.yaml").spec.claims
    pe = make(name, model_dim=8).double()
    positions = torch.randperm(300)[:60]
    vectors = _position_vectors(pe, name, positions)
    distances = torch.cdist(vectors, vectors) + torch.eye(60, dtype=F64)
    if claims.unique is not None:  # floater leaves it unstated: it depends on training
        assert claims.unique is True and distances.min() > 1e-9
    if claims.extrapolates:
        assert torch.isfinite(_position_vectors(pe, name, torch.tensor([far]))).all()
    else:
        assert claims.extrapolates is False
        with pytest.raises(ValueError, match="extrapolate"):
            _position_vectors(pe, name, torch.tensor([pe.max_positions]))


def test_not_unique_claims_have_counterexamples() -> None:
    """nope and the convolutions state unique: false; show two positions that coincide."""
    from posgen.spec.loader import load_spec

    for name in ("nope", "convolutional", "convolutional_grid"):
        assert load_spec(SPECS / f"{name}.yaml").spec.claims.unique is False
    x = torch.ones(1, 7, 4, dtype=F64)  # constant content
    conv = make("convolutional", model_dim=4)
    out = conv.embed(x)
    torch.testing.assert_close(out[0, 2], out[0, 4])  # interior positions coincide
    grid = make("convolutional_grid", model_dim=4)
    out = grid.embed(torch.ones(1, 25, 4, dtype=F64), grid=(5, 5))
    torch.testing.assert_close(out[0, 6], out[0, 12])  # two interior cells coincide
    assert make("nope").embed(x) is x  # no position reaches the input at all


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ((-1,), "count"),
        ((2.5,), "count"),
        ((None,), "count"),
        ((True,), "count"),
        ((3, torch.int64), "dtype"),
        ((3, torch.bool), "dtype"),
    ],
)
def test_floater_trajectory_names_a_bad_argument(arguments: tuple, named: str) -> None:
    """count must be an int >= 0 and dtype a float dtype: -1 had given [0, 512]
    silently, the others TypeError or RuntimeError from inside torch."""
    pe = make("floater", model_dim=8)
    with pytest.raises(ValueError, match=f"^{named} must be"):
        pe.trajectory(*arguments)
    assert pe.trajectory(0).shape == (0, 8)
