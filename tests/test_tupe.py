"""Untied absolute positions (TUPE, Ke, He and Liu 2021, arXiv:2006.15595).

The generated tupe_a / tupe_r modules, and in-memory variants for the other conventions
(no LayerNorm and no projection offsets, as the printed formula; a bias inside the scale),
against the independent float64 loops in tests/reference/tupe.py, themselves pinned here to
hand-computed values.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import generated_class, spec_variant, spy_method
from tests.reference import tupe as ref
from tests.reference.formulas import t5_relative_bucket

F64 = torch.float64
HEADS, HEAD_DIM, MODEL_DIM = 2, 4, 6


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.to(F64), expected, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------ the reference, by hand


def test_reference_untied_term_by_hand() -> None:
    # p0 = [1, 0], p1 = [0, 1]; U_q = I, U_k = diag(2, 1); one head of dim 2, scale 1/2:
    # (p_i U_q) . (p_j U_k) = [[2, 0], [0, 1]], halved.
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
    eye, u_k = torch.eye(2, dtype=F64), torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=F64)
    scores = ref.tupe_position_scores(table, eye, u_k, 1, 2, [0, 1], [0, 1], scale=0.5)
    _close(scores, torch.tensor([[[1.0, 0.0], [0.0, 0.5]]], dtype=F64))
    # content q = k = I adds 1/2 on the diagonal
    logits = ref.tupe_logits(eye[None], eye[None], scores, scale=0.5)
    _close(logits, torch.tensor([[[1.5, 0.0], [0.0, 1.0]]], dtype=F64))


def test_reference_layer_norm_and_offsets_by_hand() -> None:
    # LayerNorm (eps 0) of [1, 0] is [1, -1] and of [0, 1] is [-1, 1]. U_q = U_k = I,
    # b_q = [1, 0]: p_0 U_q + b_q = [2, -1], p_1 U_q + b_q = [0, 1]; keys [1, -1], [-1, 1].
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
    eye = torch.eye(2, dtype=F64)
    norm = (torch.ones(2, dtype=F64), torch.zeros(2, dtype=F64), 0.0)
    scores = ref.tupe_position_scores(
        table,
        eye,
        eye,
        1,
        2,
        [0, 1],
        [0, 1],
        scale=1.0,
        q_bias=torch.tensor([1.0, 0.0], dtype=F64),
        norm=norm,
    )
    _close(scores, torch.tensor([[[3.0, -3.0], [-1.0, 1.0]]], dtype=F64))
    assert ref.layer_norm_row([1.0, 3.0], [2.0, 1.0], [0.5, 0.0], 0.0) == [-1.5, 1.0]


def test_reference_relative_bias_by_hand() -> None:
    # T5 buckets (bidirectional, 32): j - i = 0 -> 0, +1 -> 17, -1 -> 1; table[b] = b / 100.
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=F64)
    eye, u_k = torch.eye(2, dtype=F64), torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=F64)
    relative = (torch.arange(32, dtype=F64) / 100).unsqueeze(1)  # [buckets, heads = 1]
    after = ref.tupe_position_scores(
        table, eye, u_k, 1, 2, [0, 1], [0, 1], scale=0.5, relative_table=relative
    )
    _close(after, torch.tensor([[[1.0, 0.17], [0.01, 0.5]]], dtype=F64))
    inside = ref.tupe_position_scores(
        table,
        eye,
        u_k,
        1,
        2,
        [0, 1],
        [0, 1],
        scale=0.5,
        relative_table=relative,
        bias_inside_scale=True,
    )
    _close(inside, torch.tensor([[[1.0, 0.085], [0.005, 0.5]]], dtype=F64))


def test_reference_first_token_reset_by_hand() -> None:
    # rows r0 = [1, 0] (the first-token slot), r1 = [0, 1] (position 0), r2 = [1, 1]
    # (position 1); U_q = I, U_k = diag(2, 3), scale 1. Query 0 -> r0 U_k r0 = 2 for every
    # key; key 0 (other queries) -> r1 U_k r1 = 3; (1, 1) -> r2 U_k r2 = 5. The bias
    # table b / 100 adds bucket 16 (query 0), 32 (key 0) and bucket(0) = 0.
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=F64)
    eye, u_k = torch.eye(2, dtype=F64), torch.tensor([[2.0, 0.0], [0.0, 3.0]], dtype=F64)
    relative = (torch.arange(33, dtype=F64) / 100).unsqueeze(1)
    scores = ref.tupe_position_scores(
        table,
        eye,
        u_k,
        1,
        2,
        [0, 1],
        [0, 1],
        scale=1.0,
        relative_table=relative,
        first_token_reset=True,
    )
    _close(scores, torch.tensor([[[2.16, 2.16], [3.32, 5.0]]], dtype=F64))
    with pytest.raises(ValueError):  # position 2 would need row 3
        ref.tupe_position_scores(table, eye, u_k, 1, 2, [2], [0], scale=1.0, first_token_reset=True)


def test_reference_rejects_positions_past_the_table() -> None:
    table = torch.zeros(3, 2, dtype=F64)
    eye = torch.eye(2, dtype=F64)
    with pytest.raises(ValueError):
        ref.tupe_position_scores(table, eye, eye, 1, 2, [0, 3], [0, 1], scale=1.0)


# ------------------------------------------------------------------ generated vs reference


def _randomised(cls, seed: int = 0, **sizes) -> torch.nn.Module:
    pe = cls(heads=HEADS, head_dim=HEAD_DIM, model_dim=MODEL_DIM, **sizes).double().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in pe.named_parameters():
            std = 1.0 if name.startswith(("position_embeddings", "relative")) else 0.4
            noise = torch.randn(parameter.shape, generator=generator, dtype=F64) * std
            if name == "position_norm.weight":
                noise = 1.0 + noise  # a gain around 1
            parameter.copy_(noise)
    return pe


def _reset(pe) -> bool:
    """The first-token reset shows in the layout: one more table row than positions."""
    return pe.position_embeddings.weight.shape[0] == pe.max_positions + 1


def _reference_scores(pe, q_positions, k_positions, bias_inside_scale=False) -> torch.Tensor:
    norm = None
    if hasattr(pe, "position_norm"):
        norm = (pe.position_norm.weight, pe.position_norm.bias, pe.position_norm.eps)
    relative = getattr(pe, "relative_attention_bias", None)
    return ref.tupe_position_scores(
        pe.position_embeddings.weight,
        pe.position_query.weight,
        pe.position_key.weight,
        HEADS,
        HEAD_DIM,
        list(q_positions),
        list(k_positions),
        scale=1.0 / math.sqrt(2 * HEAD_DIM),  # the paper's 1/sqrt(2d)
        q_bias=pe.position_query.bias,
        k_bias=pe.position_key.bias,
        norm=norm,
        relative_table=None if relative is None else relative.weight,
        bias_inside_scale=bias_inside_scale,
        first_token_reset=_reset(pe),
    )


def _reference_rows(pe, q, k, v, q_positions, k_positions, causal, bias_inside_scale=False):
    """Per batch row: (logits [B, H, N, M], output [B, H, N, dv]) from the reference."""
    scale = 1.0 / math.sqrt(2 * HEAD_DIM)
    logits, outputs = [], []
    for b in range(q.shape[0]):
        qp = q_positions[b] if q_positions.dim() == 2 else q_positions
        kp = k_positions[b] if k_positions.dim() == 2 else k_positions
        qp, kp = qp.tolist(), kp.tolist()
        position = _reference_scores(pe, qp, kp, bias_inside_scale)
        logits.append(ref.tupe_logits(q[b], k[b], position, scale))
        causal_positions = (qp, kp) if causal else (None, None)
        outputs.append(
            ref.tupe_attention(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], position, scale, *causal_positions
            )[0]
        )
    return torch.stack(logits), torch.stack(outputs)


def _qkv(batch=2, n=3, m=7):
    return (
        torch.randn(batch, HEADS, n, HEAD_DIM, dtype=F64),
        torch.randn(batch, HEADS, m, HEAD_DIM, dtype=F64),
        torch.randn(batch, HEADS, m, 5, dtype=F64),
    )


POSITION_CASES = {
    # name: (q_positions, k_positions) or None for the defaults (queries = last N keys)
    "default_offset": None,
    "explicit": (torch.tensor([40, 0, 300]), torch.tensor([0, 3, 7, 40, 41, 299, 511])),
    "batched": (
        torch.tensor([[0, 5, 6], [100, 101, 102]]),
        torch.tensor([[0, 1, 2, 3, 4, 5, 6], [96, 97, 98, 99, 100, 101, 102]]),
    ),
}


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
@pytest.mark.parametrize("case", sorted(POSITION_CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_generated_matches_reference(name: str, case: str, causal: bool) -> None:
    pe = _randomised(generated_class(name))
    assert pe.scale == pytest.approx(1.0 / math.sqrt(2 * HEAD_DIM), rel=1e-15)
    q, k, v = _qkv()
    positions = POSITION_CASES[case]
    if positions is None:
        kwargs, q_pos, k_pos = {}, torch.arange(4, 7), torch.arange(7)
    else:
        q_pos, k_pos = positions
        kwargs = {"q_positions": q_pos, "k_positions": k_pos}
    logits, outputs = _reference_rows(pe, q, k, v, q_pos, k_pos, causal)
    _close(pe.scores(q, k, **kwargs), logits)
    for backend in ("eager", "sdpa"):
        _close(pe(q, k, v, causal=causal, backend=backend, **kwargs), outputs)
        with torch.no_grad():  # the projected rows kept, read as slices at the defaults
            _close(pe(q, k, v, causal=causal, backend=backend, **kwargs), outputs)
    if q_pos.dim() == 1:
        _close(pe.score_bias(q_pos, k_pos), _reference_scores(pe, q_pos.tolist(), k_pos.tolist()))


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
@pytest.mark.parametrize("fold", [False, True])
def test_a_decoding_loop_projects_the_table_once_and_sees_edits(
    name: str, fold: bool, monkeypatch
) -> None:
    """Without gradients the U_q and U_k projections of every table row are kept while
    the parameters are unchanged: a decoding loop projects them once (rather than its M
    keys every step), each step equals the float64 reference (with the bias and folded
    into q and k), and an edit through ``.data`` (an EMA update, which moves no version
    counter) is seen at the next step, as is an optimizer-style in-place update. With
    gradients into the parameters every call projects afresh."""
    pe = _randomised(generated_class(name))
    pe.fold_bias = fold
    rows = pe.position_embeddings.weight.shape[0]
    made = spy_method(monkeypatch, type(pe), "_untied_rows", lambda index, projection: index.shape)
    q, k, v = _qkv(batch=1, n=1, m=12)

    def step(m: int) -> None:
        query = q[:, :, :1] * (1 + m / 10)  # a new query each step, at position m - 1
        with torch.no_grad():
            got = pe(query, k[:, :, :m], v[:, :, :m], causal=True, backend="sdpa")
        positions = torch.arange(m)
        _, want = _reference_rows(
            pe, query, k[:, :, :m], v[:, :, :m], positions[-1:], positions, True
        )
        _close(got, want)

    for m in range(3, 13):
        step(m)
    assert made == [torch.Size([rows])] * 2  # once for U_q and once for U_k
    pe.position_key.weight.data.mul_(1.5)
    step(12)
    with torch.no_grad():
        pe.position_query.weight.add_(0.25)
    step(12)
    assert made == [torch.Size([rows])] * 6
    pe(q, k, v)  # gradients into the parameters: nothing kept, rows projected per call
    assert len(made) > 6 and torch.Size([rows]) not in made[6:]


@pytest.mark.parametrize("base", ["tupe_a", "tupe_r"])
def test_printed_formula_variant_matches_reference(base: str) -> None:
    """norm: none, projection_bias: false, first_token: shared: (p_i U_q)(p_j U_k)^T / sqrt(2d)
    (+ the bias for tupe_r)."""
    cls = spec_variant(
        base,
        ("norm: layer_norm ", "norm: none "),
        ("first_token: reset ", "first_token: shared "),
        ("projection_bias: true ", "projection_bias: false "),
        ("max_positions: 512", "max_positions: 16"),
        name="untied_plain",
    )
    pe = _randomised(cls)
    assert not hasattr(pe, "position_norm") and pe.position_query.bias is None
    assert pe.position_embeddings.weight.shape == (16, MODEL_DIM)
    q, k, v = _qkv(n=4, m=4)
    q_pos, k_pos = torch.tensor([9, 10, 11, 15]), torch.tensor([0, 9, 10, 15])
    logits, outputs = _reference_rows(pe, q, k, v, q_pos, k_pos, causal=True)
    _close(pe.scores(q, k, q_positions=q_pos, k_positions=k_pos), logits)
    for backend in ("eager", "sdpa"):
        out = pe(q, k, v, q_positions=q_pos, k_positions=k_pos, causal=True, backend=backend)
        _close(out, outputs)
    defaults = torch.arange(4)  # kept rows without gradients, read as slices at the defaults
    _, want = _reference_rows(pe, q[:, :, 1:], k, v, defaults[1:], defaults, causal=True)
    with torch.no_grad():
        for backend in ("eager", "sdpa"):
            _close(pe(q[:, :, 1:], k, v, causal=True, backend=backend), want)
        pe.fold_bias = True  # the untied term as extra features of q and k (tupe_a)
        _close(pe(q[:, :, 1:], k, v, causal=True, backend="sdpa"), want)


def test_bias_inside_the_scale_variant() -> None:
    """A bias placed before_scale is scaled together with the untied term (with the reset)."""
    bias = (
        "      first_token: reset         # the [CLS] reset: position t reads row t + 1; "
        "row 0 is the [CLS] slot\n"
    )
    cls = spec_variant(
        "tupe_a",
        (
            bias,
            bias
            + (
                "    bias:\n      kind: learned_table\n"
                "      index: {kind: log_buckets, recipe: t5, buckets: 16, max_distance: 40,\n"
                "              bidirectional: true, sign: key_minus_query}\n"
                "      placement: before_scale\n"
            ),
        ),
        name="untied_inside",
    )
    pe = _randomised(cls)
    assert pe.relative_attention_bias.weight.shape == (17, HEADS)
    q, k, v = _qkv()
    scale = 1.0 / math.sqrt(2 * HEAD_DIM)
    for q_pos, k_pos in (
        (torch.arange(4, 7), torch.arange(7)),
        (torch.tensor([0, 3, 60]), torch.tensor([0, 1, 2, 3, 30, 59, 60])),
    ):
        expected_bias = _reference_scores_buckets(pe, q_pos, k_pos, buckets=16, max_distance=40)
        _close(pe.score_bias(q_pos, k_pos), expected_bias)
        expected = ref.tupe_attention(q, k, v, expected_bias, scale)
        for backend in ("eager", "sdpa"):
            out = pe(q, k, v, q_positions=q_pos, k_positions=k_pos, backend=backend)
            _close(out, expected)


def _reference_scores_buckets(pe, q_pos, k_pos, buckets, max_distance) -> torch.Tensor:
    return ref.tupe_position_scores(
        pe.position_embeddings.weight,
        pe.position_query.weight,
        pe.position_key.weight,
        HEADS,
        HEAD_DIM,
        q_pos.tolist(),
        k_pos.tolist(),
        scale=1.0 / math.sqrt(2 * HEAD_DIM),
        q_bias=pe.position_query.bias,
        k_bias=pe.position_key.bias,
        norm=(pe.position_norm.weight, pe.position_norm.bias, pe.position_norm.eps),
        relative_table=pe.relative_attention_bias.weight,
        num_buckets=buckets,
        max_distance=max_distance,
        bias_inside_scale=True,
        first_token_reset=_reset(pe),
    )


# ------------------------------------------------------------------ module behaviour


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
def test_positions_past_the_table_raise(name: str) -> None:
    pe = generated_class(name)(heads=HEADS, head_dim=HEAD_DIM, model_dim=MODEL_DIM)
    q = torch.randn(1, HEADS, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="cannot extrapolate"):
        pe(q, q, q, q_positions=torch.tensor([510, 512]), k_positions=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="512"):
        pe.score_bias(torch.tensor([0]), torch.tensor([512]))
    long_k = torch.randn(1, HEADS, 513, HEAD_DIM)
    for backend in ("eager", "sdpa"):
        with pytest.raises(ValueError, match="out of range"):
            pe(q, long_k, long_k, backend=backend)
    pe(q, long_k[:, :, :512], long_k[:, :, :512])  # the last row is still fine


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
def test_positions_past_the_table_name_the_argument(name: str) -> None:
    """Every ValueError for bad input names its argument: a position past the untied
    table says whether q_positions or k_positions (or, at default positions, which
    default) held it, on every backend and in ``score_bias``; the message once began
    "position 100004 is out of range" with no argument named."""
    pe = generated_class(name)(heads=HEADS, head_dim=HEAD_DIM, model_dim=MODEL_DIM)
    q = torch.randn(1, HEADS, 2, HEAD_DIM)
    near, far = torch.tensor([0, 1]), torch.tensor([3, 100004])
    for backend in ("eager", "sdpa"):
        with pytest.raises(ValueError, match=r"^k_positions: position 100004 is out of range"):
            pe(q, q, q, backend=backend, q_positions=near, k_positions=far)
        with pytest.raises(ValueError, match=r"^q_positions: position 100004 is out of range"):
            pe(q, q, q, backend=backend, q_positions=far, k_positions=near)
        long_k = torch.randn(1, HEADS, 513, HEAD_DIM)
        with pytest.raises(ValueError, match=r"^q_positions \(the default, from 513 keys\)"):
            pe(q, long_k, long_k, backend=backend)
    with pytest.raises(ValueError, match=r"^k_positions: position 100004"):
        pe.score_bias(near, far)


def test_parameters_are_named_for_checkpoints_and_trained() -> None:
    pe = generated_class("tupe_r")(heads=HEADS, head_dim=HEAD_DIM, model_dim=MODEL_DIM)
    shapes = {name: tuple(p.shape) for name, p in pe.named_parameters()}
    assert shapes == {
        "relative_attention_bias.weight": (33, HEADS),  # + the spare first-token row
        "position_embeddings.weight": (513, MODEL_DIM),  # + the first-token slot
        "position_norm.weight": (MODEL_DIM,),
        "position_norm.bias": (MODEL_DIM,),
        "position_query.weight": (HEADS * HEAD_DIM, MODEL_DIM),
        "position_query.bias": (HEADS * HEAD_DIM,),
        "position_key.weight": (HEADS * HEAD_DIM, MODEL_DIM),
        "position_key.bias": (HEADS * HEAD_DIM,),
    }
    q, k, v = _qkv()
    pe(q.float(), k.float(), v.float(), causal=True).square().sum().backward()
    for name, parameter in pe.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_model_dim_is_a_constructor_argument() -> None:
    cls = generated_class("tupe_a")
    assert cls().position_embeddings.weight.shape == (513, 768)
    with pytest.raises(ValueError, match="model_dim"):
        cls(model_dim=0)


def test_explain_states_the_untied_term_and_its_conventions() -> None:
    from click.testing import CliRunner

    from posgen.cli import main

    output = CliRunner().invoke(main, ["explain", "tupe_r"]).output
    assert "scale: 1/sqrt(2 * head_dim)" in output
    untied = "position_position  untied    scale * (LN(p_i) U_q + b_q) . (LN(p_j) U_k + b_k)"
    assert untied in output
    assert "plus, after the scale, table[bucket(j - i), h]" in output
    assert "content_position   drop" in output


def test_weights_in_the_authors_layout_copy_in() -> None:
    """The documented mapping from the authors' fairseq layout (guolinke/TUPE).

    Their encoder keeps pos [max_len + 1, d] (row 0 the [CLS] slot), pos_ln, one
    pos_proj: d -> 2d whose outputs reshape to (2, heads, head_dim) (queries first), and
    relative_attention_bias [bins + 1, heads]. For a sequence of L tokens it forms
    P = pos_proj(pos_ln(pos[:L + 1])), the scaled [heads, L + 1, L + 1] products, keeps
    [1:, 1:], overwrites column 0 with the (1, 1) product and row 0 with the (0, 0) one,
    and adds the bias of buckets whose column 0 is bins and row 0 is bins / 2.
    """
    heads, head_dim, bins, length = HEADS, HEAD_DIM, 32, 9
    d = heads * head_dim  # their pos_proj maps d -> 2d, so model_dim = heads * head_dim
    g = torch.Generator().manual_seed(5)
    pos = torch.randn(512 + 1, d, generator=g, dtype=F64)
    ln_gain = 1 + 0.3 * torch.randn(d, generator=g, dtype=F64)
    ln_shift = torch.randn(d, generator=g, dtype=F64)
    proj_w = 0.4 * torch.randn(2 * d, d, generator=g, dtype=F64)
    proj_b = torch.randn(2 * d, generator=g, dtype=F64)
    rel_table = torch.randn(bins + 1, heads, generator=g, dtype=F64)

    # their computation, in their layout
    normed = torch.nn.functional.layer_norm(pos[: length + 1], (d,), ln_gain, ln_shift, 1e-5)
    projected = (normed @ proj_w.T + proj_b).reshape(length + 1, 2, heads, head_dim)
    pos_q = projected[:, 0].permute(1, 0, 2) / math.sqrt(2 * head_dim)  # [heads, L + 1, D]
    pos_k = projected[:, 1].permute(1, 0, 2)
    full = torch.einsum("hid,hjd->hij", pos_q, pos_k)
    expected = full[:, 1:, 1:].clone()
    expected[:, :, 0] = full[:, 1, 1].unsqueeze(-1)
    expected[:, 0, :] = full[:, 0, 0].unsqueeze(-1)
    buckets = torch.tensor(
        [[t5_relative_bucket(j - i, True, bins, 128) for j in range(length)] for i in range(length)]
    )
    buckets[:, 0] = bins
    buckets[0, :] = bins // 2
    expected = expected + rel_table[buckets].permute(2, 0, 1)

    pe = generated_class("tupe_r")(heads=heads, head_dim=head_dim, model_dim=d).double()
    with torch.no_grad():
        pe.position_embeddings.weight.copy_(pos)
        pe.position_norm.weight.copy_(ln_gain)
        pe.position_norm.bias.copy_(ln_shift)
        pe.position_query.weight.copy_(proj_w[:d])
        pe.position_query.bias.copy_(proj_b[:d])
        pe.position_key.weight.copy_(proj_w[d:])
        pe.position_key.bias.copy_(proj_b[d:])
        pe.relative_attention_bias.weight.copy_(rel_table)
    positions = torch.arange(length)
    _close(pe.score_bias(positions, positions), expected)


def test_tupe_a_folds_its_untied_term_into_q_and_k_for_sdpa(monkeypatch) -> None:
    """sdpa gets no bias tensor: (p_i U_q).(p_j U_k), with the first-token reset, rides in
    extra features of q and k, and the output equals eager's (explicit and batched
    positions that include position 0, GQA, causal and not)."""
    import generated._sdpa_backend as runtime

    pe = generated_class("tupe_a")(heads=4, head_dim=8, model_dim=16).double()
    pe.fold_bias = True  # the default folds on CUDA only (measured slower on CPU)
    masks = []
    plain = runtime.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attn_mask"))
        return plain(*args, **kwargs)

    monkeypatch.setattr(runtime.F, "scaled_dot_product_attention", spy)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 7, 8, dtype=torch.float64),
        torch.randn(2, 2, 7, 8, dtype=torch.float64),
    )
    batched = {
        "q_positions": torch.tensor([[2, 3, 4, 5, 6], [0, 1, 2, 3, 4]]),
        "k_positions": torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 2, 3, 4]]),
    }
    for positions in ({}, batched):
        for causal in (False, True):
            eager = pe(q, k, v, causal=causal, backend="eager", **positions)
            sdpa = pe(q, k, v, causal=causal, backend="sdpa", **positions)
            torch.testing.assert_close(sdpa, eager, rtol=1e-10, atol=1e-10)
    assert masks[0] is None  # default positions, not causal: no mask at all


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
@pytest.mark.parametrize(("n", "m"), [(5, 5), (1, 1), (1, 6)])
def test_kept_rows_at_default_positions_take_both_slots(name: str, n: int, m: int) -> None:
    """Without gradients the kept rows at default positions are read as slices and the
    first-token slots written into their product: key 0 always sits at position 0, and
    where N = M so does query 0, whose slot takes its whole row (its entry with key 0
    too). Logits and outputs against the float64 reference, kept rows read."""
    pe = _randomised(generated_class(name))
    q, k, v = _qkv(batch=2, n=n, m=m)
    q_pos, k_pos = torch.arange(m - n, m), torch.arange(m)
    logits, outputs = _reference_rows(pe, q, k, v, q_pos, k_pos, causal=True)
    with torch.no_grad():
        _close(pe.scores(q, k), logits)
        for backend in ("eager", "sdpa"):
            _close(pe(q, k, v, causal=True, backend=backend), outputs)
        assert pe._kept_untied_rows(q.device) is not None
