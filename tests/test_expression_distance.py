"""Expression biases unchanged when i and j shift together (functions of j - i) are
biases of the relative position: they render ``_distance_bias`` and take the
per-distance paths (the strided view, the directional gradients of their parameters,
shifted positions), while the eager oracle keeps evaluating the expression per pair."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from posgen.codegen.expr_cost import per_head_pair_work
from posgen.spec.expr import ExprError, ParamInfo, parse_expr
from tests.conftest import (
    assert_sdpa_matches_eager,
    runtime_modules,
    set_runtime,
    spec_variant,
    spy_calls,
    spy_method,
    spy_query_shapes,
)

PARAMS = {"a": ParamInfo(per_head=False), "c": ParamInfo(per_head=True)}


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("-abs(i - j)", True),
        ("-c[h] * log1p(a * abs(j - i))", True),
        ("-(i - j) ** 2 + (j - i) * a", True),
        ("where(j - i > 0, -a * (j - i), 0.0)", True),
        ("c[h] * h", True),  # no position at all
        ("-abs((i + 1) - j)", True),  # i + 1 - j: the shift cancels
        ("2 * i - 2 * j", True),
        ("0.5 * (i + 3) - j / 2", True),
        ("-abs(i - j) + 0 * i", True),  # 0 * i is 0
        ("-abs(i - i)", True),  # no position after all
        ("minimum(i, j) - j", True),  # min(i - j, 0)
        ("where(i < j, i, j + 1) - i", True),
        ("-abs(i) + j", False),
        ("-abs(i - j) / maximum(i, 1.0)", False),
        ("where(i < 5, 1.0, 0.0)", False),
        ("floor(i / 2) - floor(j / 2)", False),  # changes with an odd shift
        ("minimum(i, 1.0) - j", False),
        ("0.5 * i - j / 3", False),
        ("a * i - a * j", False),  # true, but a parameter's value is not known here
    ],
)
def test_an_expression_reads_the_difference_where_a_common_shift_cancels(
    expr: str, want: bool
) -> None:
    assert parse_expr(expr, PARAMS).of_difference is want


def _expressions() -> st.SearchStrategy[str]:
    """Random expression texts over i, j, h, a, c[h] and small numbers."""
    leaves = st.sampled_from(
        ["i", "j", "(i - j)", "(j - i)", "h", "a", "c[h]", "1", "2", "0.5", "3"]
    )

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.builds("-({})".format, inner),
            st.builds("({}) + ({})".format, inner, inner),
            st.builds("({}) - ({})".format, inner, inner),
            st.builds("({}) * ({})".format, inner, inner),
            st.builds("({}) / ({})".format, inner, inner),
            st.builds("({}) ** 2".format, inner),
            st.builds("abs({})".format, inner),
            st.builds("sin({})".format, inner),
            st.builds("floor({})".format, inner),
            st.builds("minimum({}, {})".format, inner, inner),
            st.builds("where(({}) < ({}), {}, {})".format, inner, inner, inner, inner),
        )

    return st.recursive(leaves, grow, max_leaves=8)


def _value(expr: str, i: int, j: int) -> float:
    """The expression in float64 by Python's own arithmetic (a = 0.7, c = [0.3, -1.2],
    h = 1), independent of posgen's rendering."""
    names = {
        "i": float(i),
        "j": float(j),
        "h": 1,
        "a": 0.7,
        "c": [0.3, -1.2],
        "abs": abs,
        "sin": math.sin,
        "floor": math.floor,
        "minimum": min,
        "where": lambda condition, yes, no: yes if condition else no,
    }
    return float(eval(expr, {"__builtins__": {}}, names))  # noqa: S307 - texts built above


# most drawn expressions read i or j alone and are filtered out by design
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(
    expr=_expressions(),
    points=st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(-500, 500)),
        min_size=3,
        max_size=3,
    ),
)
def test_an_expression_marked_as_of_the_difference_is_unchanged_by_a_common_shift(
    expr: str, points: list[tuple[int, int, int]]
) -> None:
    """Soundness: wherever ``of_difference`` is set, f(i + s, j + s) = f(i, j) in float64."""
    try:
        parsed = parse_expr(expr, PARAMS)
    except ExprError:  # a call of constants, for one
        assume(False)
        return
    assume(parsed.of_difference)
    for i, j, shift in points:
        try:
            before, after = _value(expr, i, j), _value(expr, i + shift, j + shift)
        except (ZeroDivisionError, OverflowError, ValueError):
            continue
        if math.isfinite(before) and math.isfinite(after):
            assert math.isclose(before, after, rel_tol=1e-9, abs_tol=1e-9), (i, j, shift)


def _expression_module(expr: str, params: str) -> type[torch.nn.Module]:
    """KERPLE's spec with its bias replaced by ``expr`` and its ``params`` (YAML)."""
    old = (
        "      kind: kerple               # bias[h, i, j] = -r1_h * log(1 + r2_h * |i - j|)\n"
        "      variant: log\n"
    )
    return spec_variant(
        "kerple_log",
        (old, f'      kind: expr\n      expr: "{expr}"\n      params: {params}\n'),
        name="expression_bias",
    )


KERPLE_LOG = (
    "-r1[h] * log1p(r2[h] * abs(i - j))",
    "{r1: {shape: [heads], init: 1.0, positive: true},"
    " r2: {shape: [heads], init: 0.5, positive: true, bounds: [0.01, 10]}}",
)
# a shared scalar, and a per-head one whose direction changes sign with the distance
# (and the bias with it: no symmetry in j - i)
MIXED = (
    "-a * abs(j - i) + c[h] * sin(0.3 * (j - i))",
    "{a: {shape: [], init: 0.2}, c: {shape: [heads], init: 0.7}}",
)
OF_QUERY = ("-abs(i - j) / maximum(i, 1.0)", "{}")
# a shift that cancels without i - j written out: -a |i + 1 - j| + min(i - j, 0)
SHIFTED = ("-a * abs((i + 1) - j) + minimum(i, j) - j", "{a: {shape: [], init: 0.3}}")


@pytest.fixture(scope="module")
def kerple_expression() -> type[torch.nn.Module]:
    return _expression_module(*KERPLE_LOG)


def test_flags_of_an_expression_of_the_difference(kerple_expression) -> None:
    assert kerple_expression.bias_by_distance and kerple_expression.shift_invariant
    assert kerple_expression.distance_bias_parameters == ("expr_r1", "expr_r2")
    of_query = _expression_module(*OF_QUERY)
    assert not (of_query.bias_by_distance or of_query.shift_invariant)
    assert of_query.distance_bias_parameters == ()


def test_the_per_distance_vector_is_the_formula(kerple_expression) -> None:
    """Entry t of ``_distance_bias`` at r = t - (M - 1): -r1_h log(1 + r2_h |r|), with
    r1 = softplus(raw r1) and r2 = clamp(softplus(raw r2), 0.01, 10), in float64."""
    pe = kerple_expression(heads=4, head_dim=8).double()
    with torch.no_grad():
        pe.expr_r1.copy_(torch.tensor([0.3, -1.0, 2.0, 0.0]))
        pe.expr_r2.copy_(torch.tensor([-6.0, 0.1, 1.0, 12.0]))
    n, m = 5, 9
    r = torch.arange(-(m - 1), n, dtype=torch.float64)  # key minus query
    r1 = F.softplus(pe.expr_r1.detach())[:, None]
    r2 = F.softplus(pe.expr_r2.detach()).clamp(0.01, 10)[:, None]
    want = -r1 * torch.log1p(r2 * r.abs())
    torch.testing.assert_close(pe._distance_bias(n, m, torch.device("cpu")), want)


@pytest.mark.parametrize(
    "case", [KERPLE_LOG, MIXED, SHIFTED, OF_QUERY], ids=["kerple", "mixed", "shifted", "query"]
)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_the_oracle(case, causal: bool, monkeypatch) -> None:
    """Outputs and gradients (the expression's parameters included) equal the eager
    oracle's, with grouped-query heads; an expression of the difference goes through
    the per-distance view."""
    cls = _expression_module(*case)
    route = spy_method(monkeypatch, cls, "_sdpa_by_distance", lambda q, *_, **__: q.shape[2])
    pe = cls(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, 12, 20, 2, causal=causal)
    assert bool(route) is (case is not OF_QUERY)


@pytest.mark.parametrize("case", [KERPLE_LOG, MIXED], ids=["kerple", "mixed"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_parameters_train_through_the_directional_path(case, causal, monkeypatch) -> None:
    """From 64 keys here: the parameters' gradients from flash forwards, one per
    parameter (two where a direction changes sign), equal the oracle's."""
    pe = _expression_module(*case)(heads=4, head_dim=8).double()
    set_runtime(monkeypatch, "DIRECTIONAL_BIAS_MIN_KEYS", {False: 64, True: 64}, pe)
    route = spy_query_shapes(monkeypatch, pe, "directional_bias_attention")
    assert_sdpa_matches_eager(pe, 70, 70, 2, causal=causal)
    assert route == [(2, 4, 70, 8)]


def test_a_parameter_named_reference_is_not_the_modules_own_buffer() -> None:
    """``reference`` becomes ``expr_reference``; the module's dtype and device buffer is
    ``_expr_reference``, a name no parameter's attribute can take."""
    pe = _expression_module("-abs(i - j) * reference", "{reference: {shape: [], init: 2.0}}")(
        heads=2, head_dim=8
    )
    assert [name for name, _ in pe.named_parameters()] == ["expr_reference"]
    assert [name for name, _ in pe.named_buffers()] == ["_expr_reference"]
    assert list(pe.state_dict()) == ["expr_reference"]
    positions = torch.arange(4)
    want = -2.0 * (positions[:, None] - positions[None, :]).abs().float()
    torch.testing.assert_close(pe.score_bias(positions, positions), want.expand(2, 4, 4))


def test_an_expression_without_parameters_follows_the_modules_dtype() -> None:
    """A vector kept from a float32 call is not served after ``.double()``: with no
    parameters, nothing else in the module changes. Against -2^(-(h + 1) / 2) |j - i|
    in float64."""
    pe = _expression_module("-(2 ** (-(h + 1) / 2)) * abs(i - j)", "{}")(heads=4, head_dim=8)
    n, m, cpu = 3, 7, torch.device("cpu")
    assert pe._distance_bias(n, m, cpu).dtype == torch.float32
    pe.double()
    r = torch.arange(-(m - 1), n, dtype=torch.float64)  # key minus query
    slopes = 2.0 ** (-(torch.arange(4, dtype=torch.float64) + 1) / 2)
    want = -slopes[:, None] * r.abs()
    torch.testing.assert_close(pe._distance_bias(n, m, cpu), want, rtol=1e-15, atol=0)


def test_an_expression_may_read_the_head_count() -> None:
    """ALiBi's geometric slopes for any power-of-two head count, written once:
    -2^(-8 (h + 1) / heads) |i - j|, against that formula in float64; the per-distance
    vector, sdpa and flex agree with the oracle."""
    cls = _expression_module("-(2 ** (-8 * (h + 1) / heads)) * abs(i - j)", "{}")
    positions = torch.arange(6)
    distance = (positions[:, None] - positions[None, :]).abs().double()  # [6, 6]
    for heads in (4, 8, 16):
        pe = cls(heads=heads, head_dim=8).double()
        slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads)
        want = -slopes[:, None, None] * distance
        torch.testing.assert_close(pe.score_bias(positions, positions), want, rtol=1e-15, atol=0)
        r = torch.arange(-4, 2, dtype=torch.float64)  # key minus query: N = 2, M = 5
        vector = pe._distance_bias(2, 5, torch.device("cpu"))
        torch.testing.assert_close(vector, -slopes[:, None] * r.abs(), rtol=1e-15, atol=0)
    pe = cls(heads=4, head_dim=8).double()
    assert_sdpa_matches_eager(pe, 5, 9, 2, causal=True)
    q, k, v = (torch.randn(1, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        pe(q, k, v, causal=True, backend="flex"), pe(q, k, v, causal=True, backend="eager")
    )


def test_an_expression_of_one_position_broadcasts_over_the_other_and_the_batch() -> None:
    """``-0.1 * i`` assigns no j (ruff-clean), and its bias still spans every key and
    each batch row of either side's positions."""
    pe = _expression_module("-0.1 * i", "{}")(heads=2, head_dim=8).double()
    q_positions = torch.tensor([3, 5])
    k_positions = torch.arange(12).view(3, 4)  # [batch 3, M 4]
    bias = pe.score_bias(q_positions, k_positions)
    want = (-0.1 * q_positions.double())[None, None, :, None].expand(3, 2, 2, 4)
    torch.testing.assert_close(bias, want)


def test_a_costly_expression_of_the_query_position_is_read_per_pair() -> None:
    """KERPLE-log divided by log(2 + i) costs a per-distance vector's work, but is no
    function of j - i: at explicit positions it is computed per pair (a plan that read it
    per distance had no per-distance form to read: AttributeError)."""
    params = (
        "{r1: {shape: [heads], init: 1.0, positive: true}, "
        "r2: {shape: [heads], init: 0.5, positive: true}}"
    )
    pe = _expression_module("-r1[h] * log1p(r2[h] * abs(i - j)) / log(2 + i)", params)(
        heads=2, head_dim=8
    ).double()
    q_positions, k_positions = torch.tensor([10, 20, 30]), torch.tensor([0, 5, 10, 15, 20, 25])
    i, j = q_positions.double()[:, None], k_positions.double()[None, :]
    # the trained values, read through softplus (positive: true): about 1 and 0.5
    r1, r2 = (F.softplus(raw.detach())[:, None, None] for raw in (pe.expr_r1, pe.expr_r2))
    want = -r1 * torch.log1p(r2 * (i - j).abs()) / torch.log(2 + i)  # [heads, N, M]
    got = pe.score_bias(q_positions, k_positions)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_expression_of_the_head_alone_gives_its_distance_vector() -> None:
    """``c[h] * h`` reads neither i nor j: a bias of the difference, constant per head."""
    pe = _expression_module("c[h] * h", "{c: {shape: [heads], init: 0.5}}")(
        heads=4, head_dim=8
    ).double()
    vector = pe._distance_bias(2, 3, torch.device("cpu"))
    want = (0.5 * torch.arange(4, dtype=torch.float64))[:, None].expand(4, 4)
    torch.testing.assert_close(vector, want)
    assert_sdpa_matches_eager(pe, 3, 5, 2, causal=True)


@pytest.mark.parametrize(
    ("expr", "work"),
    [
        ("-a * abs(j - i)", 0),  # no head: [N, M] work, shared by the heads
        ("-a * log1p(abs(j - i))", 0),
        ("c[h] * h", 0),  # no position
        ("-c[h] * abs(j - i)", 1),  # ALiBi: one product per head and pair
        ("-abs(i - j) * h", 1),
        ("-c[h] * abs(j - i) + 1.0", 2),
        ("-a * abs(j - i) + c[h] * sin(0.3 * (j - i))", 2),  # the sine is per pair alone
        ("c[h] * (j - i) ** 2", 1),  # the power reads no head
        ("(c[h] * (j - i)) ** 2", 5),
        ("-r1[h] * log1p(r2[h] * abs(i - j))", 6),  # KERPLE: product, log1p, product
    ],
)
def test_per_head_work_per_pair(expr: str, work: int) -> None:
    parsed = parse_expr(expr, {**PARAMS, "r1": PARAMS["c"], "r2": PARAMS["c"]})
    assert per_head_pair_work(parsed.tree.body, frozenset({"c", "r1", "r2"})) == work


def _kerple_reference(pe: torch.nn.Module, r: torch.Tensor) -> tuple[torch.Tensor, list]:
    """-r1_h log(1 + r2_h |r|) in float64 with r1 = softplus(raw), r2 = clamp(softplus(raw),
    0.01, 10), and the leaves its gradients are taken for."""
    r1, r2 = (t.detach().clone().requires_grad_() for t in (pe.expr_r1, pe.expr_r2))
    p = F.softplus(r1)[:, None, None]
    q = F.softplus(r2).clamp(0.01, 10)[:, None, None]
    return -p * torch.log1p(q * r.abs()), [r1, r2]


def _mixed_reference(pe: torch.nn.Module, r: torch.Tensor) -> tuple[torch.Tensor, list]:
    """-a |r| + c_h sin(0.3 r) in float64, and its leaves."""
    a, c = (t.detach().clone().requires_grad_() for t in (pe.expr_a, pe.expr_c))
    return -a * r.abs() + c[:, None, None] * torch.sin(0.3 * r), [a, c]


@pytest.mark.parametrize("spread", [1, 40], ids=["near", "far"])
@pytest.mark.parametrize("case", ["kerple", "mixed"])
def test_the_bias_and_its_gradients_at_explicit_positions(
    case: str, spread: int, monkeypatch
) -> None:
    """Batched explicit positions close together and far apart: the bias and its
    parameters' gradients equal autograd through the formula in float64, written
    independently. KERPLE's expression, with much work per head and pair, is made once
    per distance and read per pair (``bias_read_per_distance``) where the distances are
    few (near); the mixed one, whose sine reads no head, is computed per pair."""
    pe = _expression_module(*(KERPLE_LOG if case == "kerple" else MIXED))(heads=3, head_dim=8)
    pe = pe.double()
    leaves = [pe.expr_r1, pe.expr_r2] if case == "kerple" else [pe.expr_a, pe.expr_c]
    with torch.no_grad():
        leaves[0].copy_(torch.tensor(0.4) if case == "mixed" else torch.tensor([0.3, -1.0, 2.0]))
        leaves[1].copy_(torch.tensor([0.7, -1.1, 0.2]))
    reads = spy_calls(monkeypatch, runtime_modules(pe), "bias_at_entries", lambda v, e: v.shape)
    q_pos = torch.tensor([[3, 4, 9, 10, 12], [14, 6, 7, 0, 1]]) * spread  # [2, N]
    k_pos = torch.tensor([[0, 1, 2, 4, 7, 9, 11], [11, 9, 2, 0, 5, 3, 8]]) * spread  # [2, M]
    weights = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(3)).double()
    bias = pe.score_bias(q_pos, k_pos)  # [2, H, N, M]
    got = torch.autograd.grad((bias * weights).sum(), leaves)

    r = (k_pos[:, None, None, :] - q_pos[:, None, :, None]).double()  # [2, 1, N, M]
    reference = _kerple_reference if case == "kerple" else _mixed_reference
    want, want_leaves = reference(pe, r)
    want_grads = torch.autograd.grad((want * weights).sum(), want_leaves)
    torch.testing.assert_close(bias, want, rtol=1e-12, atol=1e-12)
    for grad, want_grad in zip(got, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    # near: one entry per distance -14 .. 11; far: 40 times as many, computed per pair
    assert reads == ([(3, 26)] if case == "kerple" and spread == 1 else [])


@pytest.mark.parametrize("causal", [False, True])
def test_a_head_whose_trained_bias_is_minus_infinity_gives_zeros(causal: bool) -> None:
    """log(a_h (1 + |i - j|)) with a_0 set to 0: head 0 reads no key (-inf on every
    pair) and is zeros on sdpa as on eager, while training (the parameters take
    gradients) and without autograd; the other heads and q's gradient are the oracle's."""
    cls = _expression_module("log(a[h] * (1 + abs(i - j)))", "{a: {shape: [heads], init: 1.0}}")
    pe = cls(heads=4, head_dim=8).double()
    with torch.no_grad():
        pe.expr_a[0] = 0.0
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    q.requires_grad_(True)
    want = pe(q, k, v, causal=causal, backend="eager")
    assert torch.equal(want[:, 0], torch.zeros_like(want[:, 0]))
    got = pe(q, k, v, causal=causal, backend="sdpa")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    (want_grad,) = torch.autograd.grad(want.square().sum(), q)
    (got_grad,) = torch.autograd.grad(got.square().sum(), q)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(pe(q, k, v, causal=causal, backend="sdpa"), want.detach())


@pytest.mark.parametrize(
    ("expr", "by_distance"),
    [("log(a * abs(i - j) + a)", True), ("log(maximum(i, 0.0) - i + a) + j", False)],
)
def test_an_expression_of_minus_infinity_gives_zero_rows_in_a_decode_step(
    monkeypatch: pytest.MonkeyPatch, expr: str, by_distance: bool
) -> None:
    """An expression may reach -inf at every key once trained (log of 0, here with a
    set to 0; a spec whose initial bias is not finite is refused): its bias is not
    flagged finite, so the few-query matmuls that run a decode step on the CPU keep the
    care for rows with every key masked, and the step gives zeros, as the eager oracle
    does (and SDPA would), for a bias of the distance (its per-distance vector) and one
    per pair."""
    cls = _expression_module(expr, "{a: {shape: [], init: 1.0}}")
    assert cls.bias_by_distance is by_distance and not cls.position_bias_finite
    pe = cls(heads=2, head_dim=8)
    with torch.no_grad():
        pe.expr_a.zero_()
    matmuls = runtime_modules(pe)
    calls = spy_calls(monkeypatch, matmuls, "grouped_query_attention", lambda *_, **__: 1)
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with torch.no_grad():
        out = pe(q, k, v, backend="sdpa")
        oracle = pe(q, k, v, backend="eager")
    assert calls, "the matmuls did not run"
    assert torch.equal(oracle, torch.zeros_like(oracle))
    assert torch.equal(out, torch.zeros_like(out))


FAR = 2**24 + 3  # float32 rounds it (to 2^24 + 4), and the keys just before it
FAR_KEYS = [0, 2**24 + 1, 2**24 + 2, 2**24 + 3, 2**40]


@pytest.mark.parametrize(
    ("expr", "formula"),
    [
        ("-abs(i - j)", lambda i, j: -(i - j).abs()),  # of j - i
        # of the query position too: the general [H, N, M] path
        ("-abs(i - j) * where(i > 5, 1, 2)", lambda i, j: -(i - j).abs() * (1 + (i <= 5))),
    ],
)
def test_positions_past_float32s_integers_are_exact(expr: str, formula) -> None:
    """At positions 2^24 and past (float32 integers end there), the expression sees the
    exact positions: distances 2 and 1 read as 4 and 2 when i and j were rounded to
    float32 before the expression. Bias, eager and sdpa against float64 by hand."""
    torch.manual_seed(0)
    pe = _expression_module(expr, "{}")(heads=2, head_dim=8)
    q_at = torch.tensor([FAR, 7, 2])
    k_at = torch.tensor(FAR_KEYS)
    i, j = q_at.double().view(-1, 1), k_at.double().view(1, -1)
    want_bias = formula(i, j).expand(2, -1, -1)  # [H, N, M], float64
    torch.testing.assert_close(pe.score_bias(q_at, k_at), want_bias.float(), rtol=0, atol=0)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (3, 5, 5))
    logits = q @ k.transpose(-1, -2) / math.sqrt(8) + want_bias
    want = torch.softmax(logits, dim=-1) @ v
    positions = {"q_positions": q_at, "k_positions": k_at}
    for backend in ("eager", "sdpa"):
        got = pe(q.float(), k.float(), v.float(), backend=backend, **positions)
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
