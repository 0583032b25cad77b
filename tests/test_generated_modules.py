"""Every generated module honours the module contract (DESIGN.md §4).

Generic over the catalogue: import, run every backend, agree with the eager oracle,
stay consistent under a KV cache, and reject bad input with ValueError.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import generated_class, head_dim_for, spec_names

NAMES = spec_names()


def make(name: str, **overrides) -> torch.nn.Module:
    if "head_dim" in overrides:
        overrides["head_dim"] = head_dim_for(name, overrides["head_dim"])
    return generated_class(name)(**overrides).eval()


def qkv(pe, batch=2, n=5, m=9, value_dim=6, dtype=torch.float32):
    value_dim = getattr(pe, "value_dim", value_dim)  # a value-side table fixes the width
    q = torch.randn(batch, pe.heads, n, pe.head_dim, dtype=dtype)
    k = torch.randn(batch, pe.heads, m, pe.head_dim, dtype=dtype)
    v = torch.randn(batch, pe.heads, m, value_dim, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("name", NAMES)
def test_module_metadata_and_registry(name: str) -> None:
    import generated

    cls = generated_class(name)
    assert generated.ENCODINGS[name] is cls
    module = __import__(f"generated.{name}", fromlist=["SPEC_FILE"])
    assert module.SPEC_FILE == f"{name}.yaml"
    assert len(module.SPEC_SHA256) == 64
    assert module.__doc__ and "References:" in module.__doc__


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_eager(name: str, causal: bool) -> None:
    pe = make(name, heads=4, head_dim=16)
    for n, m in ((7, 7), (3, 9)):
        q, k, v = qkv(pe, n=n, m=m)
        eager = pe(q, k, v, causal=causal, backend="eager")
        sdpa = pe(q, k, v, causal=causal, backend="sdpa")
        auto = pe(q, k, v, causal=causal)
        assert eager.shape == (2, 4, n, v.shape[-1])
        torch.testing.assert_close(sdpa, eager, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(auto, sdpa)


@pytest.mark.parametrize("name", NAMES)
def test_masks_and_batched_positions_agree(name: str) -> None:
    pe = make(name, heads=2, head_dim=8)
    q, k, v = qkv(pe, n=4, m=6)
    # packed sequences: per-batch positions, plus a padding mask on the last key
    q_positions = torch.tensor([[2, 3, 4, 5], [0, 1, 2, 3]])
    k_positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[1, ..., 5] = False
    for mask in (keep, torch.zeros(2, 1, 1, 6).masked_fill(~keep, float("-inf"))):
        kwargs = dict(q_positions=q_positions, k_positions=k_positions, attn_mask=mask)
        eager = pe(q, k, v, causal=True, backend="eager", **kwargs)
        sdpa = pe(q, k, v, causal=True, backend="sdpa", **kwargs)
        torch.testing.assert_close(sdpa, eager, atol=2e-5, rtol=1e-4)
    # a batch row with the same positions as the default equals the default result
    default = pe(q, k, v, causal=True, backend="eager")
    explicit = pe(
        q, k, v, causal=True, backend="eager", q_positions=q_positions, k_positions=k_positions
    )
    torch.testing.assert_close(explicit[0], default[0])


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_rows_match_full_computation(name: str) -> None:
    """Scores of the last N queries against M keys equal the last N rows of the full M×M."""
    pe = make(name, heads=2, head_dim=8)
    q_full, k, v = qkv(pe, n=10, m=10)
    full_scores = pe.scores(q_full, k)
    full_out = pe(q_full, k, v, causal=True, backend="eager")
    q_block = q_full[:, :, 7:]
    torch.testing.assert_close(pe.scores(q_block, k), full_scores[:, :, 7:])
    explicit = pe.scores(q_block, k, q_positions=torch.arange(7, 10))
    torch.testing.assert_close(explicit, full_scores[:, :, 7:])
    for backend in ("eager", "sdpa"):
        out = pe(q_block, k, v, causal=True, backend=backend)
        torch.testing.assert_close(out, full_out[:, :, 7:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_scores_are_the_sum_of_terms(name: str) -> None:
    pe = make(name, heads=2, head_dim=8)
    q, k, _ = qkv(pe, n=3, m=5)
    terms = pe.score_terms(q, k)
    assert "content_content" in terms
    total = sum(term.expand(2, 2, 3, 5) for term in terms.values())
    torch.testing.assert_close(pe.scores(q, k), total)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_output_keeps_input_dtype(name: str, dtype: torch.dtype) -> None:
    pe = make(name, heads=2, head_dim=8)
    q, k, v = qkv(pe, dtype=dtype)
    for backend in ("eager", "sdpa"):
        out = pe(q, k, v, causal=True, backend=backend)
        assert out.dtype == dtype
        assert torch.isfinite(out).all()
    rotated_q, rotated_k = pe.rotate(q, k)
    assert rotated_q.dtype == dtype and rotated_k.dtype == dtype


@pytest.mark.parametrize("name", NAMES)
def test_float64_eager_matches_float32(name: str) -> None:
    pe = make(name, heads=2, head_dim=8)
    q, k, v = qkv(pe)
    out64 = pe(q.double(), k.double(), v.double(), causal=True, backend="eager")
    out32 = pe(q, k, v, causal=True, backend="eager")
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out32.double(), out64, atol=1e-5, rtol=1e-4)


def _bad_calls(pe):
    q, k, v = qkv(pe, n=4, m=4)
    return {
        "3-D q": lambda: pe(q[0], k, v),
        "integer q": lambda: pe(q.long(), k, v),
        "mixed dtypes": lambda: pe(q, k.double(), v),
        "wrong head_dim": lambda: pe(q[..., :-1], k[..., :-1], v),
        "k/v length mismatch": lambda: pe(q, k, v[:, :, :3]),
        "batch mismatch": lambda: pe(q, k[:1], v[:1]),
        "float positions": lambda: pe(q, k, v, q_positions=torch.arange(4.0)),
        "negative positions": lambda: pe(q, k, v, k_positions=torch.arange(-1, 3)),
        "positions length": lambda: pe(q, k, v, q_positions=torch.arange(5)),
        "positions batch": lambda: pe(q, k, v, q_positions=torch.zeros(3, 4, dtype=torch.long)),
        "unknown backend": lambda: pe(q, k, v, backend="flash"),
        "mask shape": lambda: pe(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
        "mask dtype": lambda: pe(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.long)),
        "mask on the meta device": lambda: pe(  # no values to move to q's device
            q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool, device="meta")
        ),
        # [4, 4] broadcasts with [B, H, 1, 4] to a larger shape, not to it
        "mask rows past the queries, eager": lambda: pe(
            q[:, :, :1], k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), backend="eager"
        ),
        "mask rows past the queries, sdpa": lambda: pe(
            q[:, :, :1], k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), backend="sdpa"
        ),
        "mask batch past the inputs": lambda: pe(
            q[:1], k[:1], v[:1], attn_mask=torch.ones(3, 1, 4, 4, dtype=torch.bool)
        ),
        "tensor causal": lambda: pe(q, k, v, causal=torch.tensor(True)),
        "string causal": lambda: pe(q, k, v, causal="no"),
        "integer keys_rotated": lambda: pe(q, k, v, keys_rotated=1),
    }


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise_value_error(name: str) -> None:
    pe = make(name, heads=2, head_dim=8)
    for label, call in _bad_calls(pe).items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"{label} was accepted")


@pytest.mark.parametrize("name", NAMES)
def test_float64_additive_masks_keep_float64_on_every_backend(name: str) -> None:
    """float64 inputs with a float64 additive attn_mask: every backend adds the mask in
    float64, as eager does (a mask rounded to the parameters' float32 moved the sdpa
    outputs of ten bias encodings by 1e-8 to 1e-6)."""
    pe = make(name, heads=2, head_dim=8)
    for n, m in ((5, 9), (8, 8)):
        q, k, v = (t.double() for t in qkv(pe, n=n, m=m))
        mask = torch.randn(n, m, dtype=torch.float64) * 3
        want = pe(q, k, v, attn_mask=mask, backend="eager")
        for backend in ("sdpa", "auto"):
            got = pe(q, k, v, attn_mask=mask, backend=backend)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"{backend} {n}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("argument", ["heads", "head_dim"])
def test_constructor_rejects_bad_sizes(name: str, argument: str) -> None:
    cls = generated_class(name)
    for value in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=argument):
            cls(**{argument: value})
    # sizes no model has, refused at once rather than built for minutes or gigabytes
    with pytest.raises(ValueError, match=f"^{argument} must be at most 4,096, got 268,435,456$"):
        cls(**{argument: 2**28})
    with pytest.raises(ValueError, match="heads \\* head_dim must be at most 131,072"):
        cls(heads=64, head_dim=4096)


def test_other_sizes_are_bounded_too() -> None:
    with pytest.raises(ValueError, match="^model_dim must be at most 65,536, got 1,048,576$"):
        generated_class("learned_absolute")(model_dim=2**20)
    with pytest.raises(ValueError, match="^value_dim must be at most 4,096, got 1,048,576$"):
        generated_class("shaw")(value_dim=2**20)
    grid = generated_class("rope_axial_2d").grid_positions
    with pytest.raises(ValueError, match="height \\* width must be at most 2,147,483,648"):
        grid(2**40, 2**40)
    assert grid(2, 3).tolist() == [[[0, 1, 2, 0, 1, 2]], [[0, 0, 0, 1, 1, 1]]]


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_holds_only_trained_weights(name: str) -> None:
    """Caches and fixed tables are non-persistent: nothing but parameters is saved."""
    pe = make(name, heads=2, head_dim=8)
    q, k, v = qkv(pe)
    pe(q, k, v)  # fill caches
    parameter_names = {name for name, _ in pe.named_parameters()}
    assert set(pe.state_dict()) == parameter_names
