"""Positions given that equal the defaults (queries M - N .. M - 1, keys 0 .. M - 1, as
Hugging Face-style position ids for a plain sequence or a KV cache are) take the paths
for default positions in eager mode (``position_verdict``): the same outputs as
leaving them out, through the per-distance view rather than a bias per pair. So do the
defaults plus a constant per batch row, for an encoding that reads positions only as
key minus query (``shift_invariant``)."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import generated_class, head_dim_for, spec_names, spy_calls, spy_method

inputs_module = importlib.import_module("generated._inputs")
defaults_module = importlib.import_module("generated._position_defaults")
sdpa_backend = importlib.import_module("generated._sdpa_backend")


def _qkv(n: int, m: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [2, 4, n, head_dim], k [2, 4, m, head_dim] and v [2, 4, m, 8], float64."""
    generator = torch.Generator().manual_seed(seed)
    shapes = ((n, head_dim), (m, head_dim), (m, 8))
    return tuple(
        torch.randn(2, 4, rows, width, generator=generator, dtype=torch.float64)
        for rows, width in shapes
    )


GIVEN = {  # (n, m) -> position keywords equal to the defaults
    "both, 1-D": (
        6,
        6,
        lambda n, m: {"q_positions": torch.arange(n), "k_positions": torch.arange(m)},
    ),
    "both, batched": (
        4,
        9,
        lambda n, m: {
            "q_positions": torch.arange(m - n, m).expand(2, n),
            "k_positions": torch.arange(m).expand(2, m),
        },
    ),
    "keys only": (3, 8, lambda n, m: {"k_positions": torch.arange(m)}),
    "queries only": (2, 7, lambda n, m: {"q_positions": torch.arange(m - n, m)}),
}


@pytest.mark.parametrize("name", spec_names())
@pytest.mark.parametrize("case", sorted(GIVEN))
def test_default_positions_given_equal_leaving_them_out(name: str, case: str) -> None:
    """Every encoding, on sdpa and eager, causal and not: the same outputs, bit for bit,
    with the default positions given as without them."""
    n, m, positions = GIVEN[case]
    torch.manual_seed(0)
    head_dim = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=head_dim).double().eval()
    q, k, v = _qkv(n, m, head_dim, seed=1)
    for backend in ("sdpa", "eager"):
        for causal in (False, True):
            want = pe(q, k, v, causal=causal, backend=backend)
            got = pe(q, k, v, causal=causal, backend=backend, **positions(n, m))
            assert torch.equal(got, want), (backend, causal)


def test_a_bias_of_distance_takes_the_per_distance_view(monkeypatch) -> None:
    """ALiBi with position ids 0 .. N - 1 given, or 1 .. N: the sdpa backend's
    per-distance path runs; with keys one further along than the queries (not the
    defaults shifted) it does not, and the output still equals the eager oracle's."""
    cls = generated_class("alibi")
    calls = spy_method(monkeypatch, cls, "_sdpa_by_distance", lambda q, *_, **__: q.shape[2])
    pe = cls(heads=4, head_dim=8).double()
    q, k, v = (torch.randn(1, 4, 5, 8, dtype=torch.float64) for _ in "qkv")
    pe(q, k, v, backend="sdpa", q_positions=torch.arange(5), k_positions=torch.arange(5))
    assert calls == [5]
    pe(q, k, v, backend="sdpa", q_positions=torch.arange(1, 6), k_positions=torch.arange(1, 6))
    assert calls == [5, 5]
    apart = {"q_positions": torch.arange(5), "k_positions": torch.arange(1, 6)}
    got = pe(q, k, v, backend="sdpa", **apart)
    assert calls == [5, 5]
    torch.testing.assert_close(got, pe(q, k, v, backend="eager", **apart))


def _shifted_rows(n: int, m: int, shifts: tuple[int, int] = (3, 250)) -> dict[str, torch.Tensor]:
    """The defaults plus shifts[0] in batch row 0 and shifts[1] in row 1: [2, N], [2, M]."""
    column = torch.tensor(shifts)[:, None]  # [2, 1]
    return {
        "q_positions": torch.arange(m - n, m) + column,
        "k_positions": torch.arange(m) + column,
    }


SHIFT_INVARIANT = [name for name in spec_names() if generated_class(name).shift_invariant]


def test_the_shift_invariant_encodings_are_those_of_differences_alone() -> None:
    """The plan's flag, for the catalogue: biases and relative terms of j - i, and the
    encodings whose attention reads no position; not rotations, absolute or contextual
    terms in the logits, FIRE (which reads the query position) or expression biases."""
    assert set(SHIFT_INVARIANT) == {
        *("alibi", "alibi_learned", "kerple_log", "kerple_power", "sandwich", "t5"),
        *("t5_decoder", "shaw", "bert_relative_key", "bert_relative_key_query"),
        *("deberta", "deberta_absolute_input", "transformer_xl", "nope", "sinusoidal"),
        *("learned_absolute", "hierarchical_absolute", "floater", "complex_order"),
        *("convolutional", "convolutional_grid", "multiplicative_learned"),
        "multiplicative_sinusoidal",
    }


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
def test_shift_invariant_encodings_give_the_same_attention_at_shifted_positions(name) -> None:
    """What the flag promises, checked on the eager oracle's literal terms (float64),
    below the shortcut: every term, mask and value term at the defaults plus a
    constant per batch row equals those at the defaults, causal or not, with a
    window or without."""
    n, m = 5, 9
    head_dim = head_dim_for(name, 8)
    pe = generated_class(name)(heads=4, head_dim=head_dim).double().eval()
    q, k, v = _qkv(n, m, head_dim, seed=2)
    given = _shifted_rows(n, m)
    q_positions, k_positions = inputs_module.check_position_pair(
        given["q_positions"], given["k_positions"], n, m, 2, q.device
    )
    for causal, window in ((False, None), (True, None), (True, 3), (False, 4)):
        want = pe._eager_attention(q, k, v, None, None, causal, None, window=window)
        got = pe._eager_attention(q, k, v, q_positions, k_positions, causal, None, window=window)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=str((causal, window)))
    # packed documents whose positions restart at each one (pairs across them masked)
    documents, restarted = _restarting_documents(m)
    for causal in (False, True):
        kwargs = {"window": None, "document_ids": documents}
        want = pe._eager_attention(q, k, v, None, None, causal, None, **kwargs)
        at = (restarted[:, m - n :], restarted)  # [2, N], [2, M]
        got = pe._eager_attention(q, k, v, *at, causal, None, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"documents {causal}")


def _restarting_documents(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids [2, M] (row 0: three documents; row 1: document 0 in two runs with
    document 1 between them) and positions [2, M] that count from 0 in each document
    (row 1's document 0 counts on across the gap: its keys are at their indices)."""
    documents = torch.tensor([[0] * 3 + [1] * 4 + [2] * (m - 7), [0] * 2 + [1] * 3 + [0] * (m - 5)])
    restarted = torch.tensor(
        [
            [*range(3), *range(4), *range(m - 7)],
            [0, 1, *range(3), *range(5, 5 + m - 5)],
        ]
    )
    return documents, restarted


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log", "deberta", "transformer_xl"])
def test_shifted_positions_take_the_default_paths(name) -> None:
    """Positions shifted per batch row give, bit for bit, the output of the defaults on
    sdpa and eager (the shortcut ran), and the same gradients."""
    n, m = 6, 10
    pe = generated_class(name)(heads=4, head_dim=8).double()
    q, k, v = _qkv(n, m, 8, seed=3)
    for backend in ("sdpa", "eager"):
        for causal in (False, True):
            want = pe(q, k, v, causal=causal, backend=backend)
            got = pe(q, k, v, causal=causal, backend=backend, **_shifted_rows(n, m))
            assert torch.equal(got, want), (backend, causal)


@pytest.mark.parametrize("shift", [2**20, 2**45])
def test_a_far_shift_costs_what_a_near_one_does(shift: int) -> None:
    """A rolling cache's keys at the defaults plus a large constant (positions reach
    2^53) are told to be shifted defaults by comparisons of M entries: the same output
    as the defaults, and no kept range grows with the shift (one up to 2^45 would be
    2^49 bytes: the call failed to allocate it)."""
    n, m = 1, 10
    pe = generated_class("alibi")(heads=4, head_dim=8).double()
    q, k, v = _qkv(n, m, 8, seed=3)
    keys = torch.arange(m) + shift
    kept = vars(defaults_module)["_KEPT_RANGES"]
    kept.clear()
    got = pe(q, k, v, causal=True, q_positions=keys[m - n :], k_positions=keys)
    assert torch.equal(got, pe(q, k, v, causal=True))
    widest = max(
        (value[1].numel() for value in kept.values() if isinstance(value, tuple)), default=0
    )
    assert widest <= 2 * 16 + 1  # -R .. R for R = 16, the power of two covering M - 1


@pytest.mark.parametrize("name", ["alibi", "t5", "shaw", "transformer_xl"])
def test_positions_restarting_per_document_take_the_default_paths(name) -> None:
    """Packed documents whose positions restart at each one: bit for bit the output of
    default positions with the same documents (the shortcut ran), causal or not."""
    n, m = 6, 10
    pe = generated_class(name)(heads=4, head_dim=8).double()
    q, k, v = _qkv(n, m, 8, seed=5)
    documents, restarted = _restarting_documents(m)
    given = {"q_positions": restarted[:, m - n :], "k_positions": restarted}
    for backend in ("sdpa", "eager"):
        for causal in (False, True):
            want = pe(q, k, v, causal=causal, backend=backend, document_ids=documents)
            got = pe(q, k, v, causal=causal, backend=backend, document_ids=documents, **given)
            assert torch.equal(got, want), (backend, causal)


def test_shifts_change_what_reads_positions_themselves() -> None:
    """FIRE divides by the query position (max(i, L), L = 512): positions shifted past L
    are kept as given, so its output moves, and sdpa still matches the oracle there."""
    pe = generated_class("fire")(heads=4, head_dim=8).double()
    assert not pe.shift_invariant
    q, k, v = _qkv(6, 6, 8, seed=4)
    shifted = _shifted_rows(6, 6, shifts=(600, 2000))
    got = pe(q, k, v, backend="sdpa", causal=True, **shifted)
    torch.testing.assert_close(got, pe(q, k, v, backend="eager", causal=True, **shifted))
    assert not torch.allclose(got, pe(q, k, v, backend="sdpa", causal=True), atol=1e-3)


def test_randomized_positions_are_not_drawn_when_positions_are_given() -> None:
    """A randomized encoding in training mode draws positions only when none are given:
    the default positions given are used as they are, call after call."""
    pe = generated_class("rope_randomized")(heads=4, head_dim=8).double().train()
    q, k, v = (torch.randn(1, 4, 6, 8, dtype=torch.float64) for _ in "qkv")
    given = {"q_positions": torch.arange(6), "k_positions": torch.arange(6)}
    first = pe(q, k, v, backend="sdpa", **given)
    assert torch.equal(first, pe(q, k, v, backend="sdpa", **given))
    assert torch.equal(first, pe.eval()(q, k, v, backend="sdpa"))


@pytest.mark.parametrize(
    ("q_positions", "k_positions", "n", "m", "want"),
    [
        (torch.arange(2, 5), torch.arange(5), 3, 5, True),
        (torch.arange(2, 5), None, 3, 5, True),
        (None, torch.arange(5), 3, 5, True),
        (torch.arange(3), torch.arange(5), 3, 5, False),  # not the last N keys
        (torch.tensor([[2, 3, 4], [2, 3, 5]]), torch.arange(5), 3, 5, False),  # one row differs
        (torch.arange(2, 5), torch.arange(1, 6), 3, 5, False),
    ],
)
def test_the_default_verdict_compares_every_row(q_positions, k_positions, n, m, want) -> None:
    assert defaults_module.position_verdict(q_positions, k_positions, n, m).default is want


@pytest.mark.parametrize(
    ("q_positions", "k_positions", "n", "m", "want"),
    [
        (torch.arange(2, 5), torch.arange(5), 3, 5, True),  # the defaults
        (torch.arange(9, 12), torch.arange(7, 12), 3, 5, True),  # plus 7
        (torch.arange(9, 12), None, 3, 5, False),  # keys default to 0 .. 4
        (None, torch.arange(7, 12), 3, 5, False),  # queries default to 2 .. 4
        (torch.tensor([[3, 4, 5], [12, 13, 14]]), torch.arange(5), 3, 5, False),
        (
            torch.tensor([[3, 4, 5], [12, 13, 14]]),
            torch.tensor([[1, 2, 3, 4, 5], [10, 11, 12, 13, 14]]),
            3,
            5,
            True,  # a constant per batch row
        ),
        (
            torch.tensor([[3, 4, 5], [12, 13, 14]]),
            torch.tensor([[1, 2, 3, 4, 5], [10, 11, 12, 13, 15]]),
            3,
            5,
            False,  # one key off
        ),
        (torch.arange(5, 8), torch.arange(4, 9), 3, 5, False),  # keys one further along
        (torch.arange(4, 8), torch.arange(5, 8), 4, 3, False),  # N > M, else a shift of 5
        (torch.arange(0), torch.arange(4, 8), 0, 4, True),  # no queries
    ],
)
def test_shifted_defaults_are_one_constant_per_row(q_positions, k_positions, n, m, want) -> None:
    got = defaults_module.position_verdict(q_positions, k_positions, n, m, shifted=True).default
    assert got is want


DOCUMENTS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])  # keys 0-2, 3-4, 5-7


@pytest.mark.parametrize(
    ("q_positions", "k_positions", "documents", "want"),
    [
        (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 0, 1, 0, 1, 2]), DOCUMENTS, True),
        (torch.tensor([7, 8, 9]), torch.tensor([4, 5, 6, 10, 11, 7, 8, 9]), DOCUMENTS, True),
        # a document whose positions skip one
        (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 0, 2, 0, 1, 2]), DOCUMENTS, False),
        # queries not at their own keys' positions
        (torch.tensor([0, 1, 3]), torch.tensor([0, 1, 2, 0, 1, 0, 1, 2]), DOCUMENTS, False),
        # restarts without documents to mask the pairs across them
        (torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 0, 1, 0, 1, 2]), None, False),
        # document 0 in two runs (ids 0, 1, 0): its positions count on across the gap
        (
            torch.tensor([5, 6, 7]),
            torch.tensor([0, 1, 0, 1, 2, 5, 6, 7]),
            torch.tensor([0, 0, 1, 1, 1, 0, 0, 0]),
            True,
        ),
        # or go on from 2 after it: keys 1 and 5 are 4 apart, their positions 2
        (
            torch.tensor([2, 3, 4]),
            torch.tensor([0, 1, 0, 1, 2, 2, 3, 4]),
            torch.tensor([0, 0, 1, 1, 1, 0, 0, 0]),
            False,
        ),
    ],
)
def test_shifted_defaults_with_documents_are_one_constant_per_document(
    q_positions, k_positions, documents, want
) -> None:
    got = defaults_module.position_verdict(
        q_positions, k_positions, 3, 8, shifted=True, document_ids=documents
    )
    assert got.default is want


def test_positions_are_left_as_given_while_compiling(monkeypatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not defaults_module.position_verdict(torch.arange(3), torch.arange(3), 3, 3).default


LEFT_PADDING = (0, 3, 5)  # each batch row's padding, before its tokens


def _left_padded(m: int, hard: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions counting each row's kept tokens, padding at 0 (as generation with a
    left-padded batch gives them), [3, M], and the padding mask [3, 1, 1, M]: bool, or
    additive with 0 and -inf or Hugging Face's finfo.min."""
    kept = torch.arange(m)[None, :] >= torch.tensor(LEFT_PADDING)[:, None]  # [3, M]
    positions = (kept.cumsum(-1) - 1) * kept
    if hard == "bool":
        mask = kept
    else:
        low = float("-inf") if hard == "-inf" else torch.finfo(torch.float64).min
        mask = torch.zeros(kept.shape, dtype=torch.float64).masked_fill(~kept, low)
    return positions, mask[:, None, None, :]


@pytest.mark.parametrize("hard", ["bool", "-inf", "finfo.min"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_left_padded_batch_reads_the_defaults_on_the_keys_it_keeps(hard: str, n: int) -> None:
    """Keys the attn_mask masks for every query of their row are never read, so where
    every other key sits at the defaults shifted by the row's padding (and the queries
    too) the positions count as default for an encoding of differences alone; exactly
    the defaults (no shift) for any other. A row whose query reads no key, a kept key
    off the shift, and inner padding do not count."""
    m = 9
    positions, mask = _left_padded(m, hard)
    q_positions = positions[:, m - n :]

    def default(q_pos: torch.Tensor, k_pos: torch.Tensor, attn_mask: torch.Tensor, shifted: bool):
        verdict = defaults_module.position_verdict(
            q_pos, k_pos, n, m, shifted, None, True, attn_mask
        )
        return verdict.default

    assert default(q_positions, positions, mask, True)
    assert not default(q_positions, positions, mask, False)  # the rows are shifted
    assert not default(q_positions, positions, None, True)  # padding at 0 is read
    unpadded = torch.arange(m).expand(3, m)
    assert default(unpadded[:, m - n :], unpadded, mask, False)  # rows at the defaults
    off = positions.clone()
    off[2, 7] += 1  # a kept key off its row's shift
    assert not default(off[:, m - n :], off, mask, True)
    inner = positions.clone()
    inner[0, 4:] -= 1  # row 0 kept all along: a key counted as padding moves the rest
    assert not default(inner[:, m - n :], inner, mask, True)
    blind = mask.clone()
    blind[1] = False if hard == "bool" else float("-inf")  # row 1 reads nothing at all
    assert not default(q_positions, positions, blind, True)


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log", "transformer_xl", "rope"])
@pytest.mark.parametrize("hard", ["bool", "finfo.min"])
def test_a_left_padded_batch_equals_each_row_alone(monkeypatch, name: str, hard: str) -> None:
    """A left-padded batch of one decode query and of a prefill of the kept tokens, with
    positions counting each row's kept tokens (Hugging Face's generation): each row's
    output equals the row alone with its padding cut off at default positions, the
    paths for default positions serving (no positions reach the backend) where the
    encoding reads differences alone (every one here but rope, whose rows are shifted);
    causal, sdpa and eager."""
    m = 9
    pe = generated_class(name)(heads=4, head_dim=8).double()
    seen = spy_method(
        monkeypatch, type(pe), "_sdpa_attention", lambda q, k, v, qp, kp, *_, **__: qp
    )
    positions, mask = _left_padded(m, hard)
    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 4, m, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    for n in (1, 4):  # the newest token, then the last 4 (each row keeps at least 4)
        for backend in ("sdpa", "eager"):
            got = pe(
                q[:, :, m - n :],
                k,
                v,
                q_positions=positions[:, m - n :],
                k_positions=positions,
                attn_mask=mask,
                causal=True,
                backend=backend,
            )
            for row, pad in enumerate(LEFT_PADDING):
                alone = pe(
                    q[row : row + 1, :, m - n :],
                    k[row : row + 1, :, pad:],
                    v[row : row + 1, :, pad:],
                    causal=True,
                    backend=backend,
                )
                torch.testing.assert_close(got[row : row + 1], alone, rtol=1e-10, atol=1e-12)
    took_defaults = [qp is None for qp in seen]
    assert took_defaults and all(took_defaults) == pe.shift_invariant


def test_counted_positions_keep_a_left_padded_batch_as_given(monkeypatch) -> None:
    """CoPE's counted positions keep a left-padded batch's positions as given
    (``position_verdict`` reads no attn_mask for them; the keys the mask hides count 0,
    tests/test_cope_masks.py, so the defaults' paths are all this forgoes)."""
    pe = generated_class("cope")(heads=4, head_dim=8).double()
    seen = spy_method(
        monkeypatch, type(pe), "_sdpa_attention", lambda q, k, v, qp, kp, *_, **__: qp
    )
    positions, mask = _left_padded(9, "bool")
    generator = torch.Generator().manual_seed(8)
    q, k, v = (
        torch.randn(3, 4, rows, 8, generator=generator, dtype=torch.float64) for rows in (1, 9, 9)
    )
    pe(
        q,
        k,
        v,
        q_positions=positions[:, -1:],
        k_positions=positions,
        attn_mask=mask,
        backend="sdpa",
    )
    assert seen and all(qp is not None for qp in seen)


def _defaults_by_definition(
    q_rows: list[list[int]] | None, k_rows: list[list[int]] | None, n: int, m: int, shifted: bool
) -> bool:
    """The defaults written out: every row's keys 0 .. M - 1 and queries M - N .. M - 1,
    or, shifted with both given, the same plus one constant per row (rows broadcast)."""
    rows = max(len(q_rows or [[]]), len(k_rows or [[]]))
    for r in range(rows):
        keys = None if k_rows is None else k_rows[r % len(k_rows)]
        queries = None if q_rows is None else q_rows[r % len(q_rows)]
        shift = 0
        if shifted and keys is not None and queries is not None:
            shift = keys[0] if keys else queries[0] - (m - n)
        if keys is not None and keys != [shift + j for j in range(m)]:
            return False
        if queries is not None and queries != [shift + m - n + i for i in range(n)]:
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_range_screen_agrees_with_the_definition(data: st.DataObject) -> None:
    """``position_verdict`` (whose first test on the CPU is each row's smallest and
    largest position, ``_defaults_told_by_ranges``) against the defaults written out,
    on positions near the defaults: shifted per row, one entry moved, two swapped,
    spread two apart, queries or keys left out, each side 1-D or batched (rows
    broadcast); the values are checked in the same read."""
    n = data.draw(st.integers(1, 5))
    m = data.draw(st.integers(n, 8))
    shifted = data.draw(st.booleans())
    batch = data.draw(st.sampled_from([None, 1, 2, 3]))

    shifts = [data.draw(st.sampled_from([0, 3])) for _ in range(batch or 1)]  # per row

    def side(length: int, first: int) -> tuple[list[list[int]] | None, torch.Tensor | None]:
        if data.draw(st.booleans()) and data.draw(st.booleans()):
            return None, None  # left out (a quarter of the draws)
        flat = batch is None or data.draw(st.booleans())  # 1-D: one row for every batch row
        rows = []
        for row_shift in shifts[:1] if flat else shifts:
            shift = data.draw(st.sampled_from([row_shift, row_shift, row_shift, 5]))
            stride = data.draw(st.sampled_from([1, 1, 1, 2]))
            row = [shift + first + stride * i for i in range(length)]
            change = data.draw(st.sampled_from(["none", "none", "none", "move", "swap"]))
            if change == "move":
                row[data.draw(st.integers(0, length - 1))] += data.draw(st.sampled_from([-1, 1]))
            elif change == "swap" and length > 1:
                i = data.draw(st.integers(0, length - 2))
                row[i], row[i + 1] = row[i + 1], row[i]
            rows.append([max(p, 0) for p in row])
        return rows, torch.tensor(rows[0] if flat else rows)

    (k_rows, k_positions), (q_rows, q_positions) = side(m, 0), side(n, m - n)
    if k_rows is None and q_rows is None:
        return
    # the general test alone, as on a GPU (no bounds read first), or the CPU's order
    general = data.draw(st.booleans())
    want = _defaults_by_definition(q_rows, k_rows, n, m, shifted)
    with pytest.MonkeyPatch.context() as patch:
        if general:
            patch.setattr(defaults_module, "EXACT_DEFAULT_DEVICES", set())
        got = defaults_module.position_verdict(q_positions, k_positions, n, m, shifted, None, True)
    assert got.default is want
    # the same read tells whether no key comes after a query where queries are given:
    # the bounds' test where the positions are not exactly the defaults (which take the
    # defaults' paths), the general test where no shift is allowed
    key_rows = k_rows or [list(range(m))]
    rows = max(len(q_rows or [[]]), len(key_rows))
    after = q_rows is not None and all(
        min(q_rows[r % len(q_rows)]) >= max(key_rows[r % len(key_rows)]) for r in range(rows)
    )
    exact = _defaults_by_definition(q_rows, k_rows, n, m, False)
    assert got.queries_last is (after and (not shifted if general else not exact))


@pytest.mark.parametrize("name", spec_names())
def test_a_query_after_every_key_needs_no_causal_mask(name: str, monkeypatch) -> None:
    """A decode step at positions that are not the defaults (keys two apart, as in a
    cache with evicted keys): with the query at the last key's position or past it no
    key comes after it, so the sdpa backend runs without the causal mask; one key after
    it keeps the mask. Every output equals the eager oracle's, which keeps the mask."""
    head_dim = head_dim_for(name, 8)
    torch.manual_seed(0)
    pe = generated_class(name)(heads=4, head_dim=head_dim).double().eval()
    seen = spy_method(
        monkeypatch, type(pe), "_sdpa_attention", lambda q, k, v, qp, kp, causal, *_, **__: causal
    )
    m = 7
    keys = 3 + 2 * torch.arange(m)  # 3, 5, ..., 15
    q, k, v = _qkv(1, m, head_dim, seed=4)
    for query in (keys[-1:], keys[-1:] + 5, keys[-1:] - 1):  # at, past, before the last key
        positions = {"q_positions": query, "k_positions": keys}
        got = pe(q, k, v, causal=True, backend="sdpa", **positions)
        want = pe(q, k, v, causal=True, backend="eager", **positions)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert seen == [False, False, True]


@pytest.mark.parametrize("name", ["rope", "alibi", "cope", "transformer_xl"])
def test_a_left_padded_decode_step_needs_no_causal_mask(name: str, monkeypatch) -> None:
    """A left-padded batch's decode step (positions counting each row's kept tokens,
    padding at 0, and the padding as attn_mask) reads the padding's positions too, so
    the general test tells that no key comes after the query: the causal mask is
    dropped, as the eager oracle's output confirms; a query before its row's last key
    keeps it."""
    pe = generated_class(name)(heads=4, head_dim=8).double()
    seen = spy_method(
        monkeypatch, type(pe), "_sdpa_attention", lambda q, k, v, qp, kp, causal, *_, **__: causal
    )
    positions, mask = _left_padded(9, "bool")  # [3, 9], row 2's last key at 3
    generator = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(3, 4, rows, 8, generator=generator, dtype=torch.float64) for rows in (1, 9, 9)
    )
    for query in (positions[:, -1:], positions[:, -1:] - torch.tensor([[0], [0], [1]])):
        options = {"q_positions": query, "k_positions": positions, "attn_mask": mask}
        got = pe(q, k, v, causal=True, backend="sdpa", **options)
        want = pe(q, k, v, causal=True, backend="eager", **options)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert seen == [False, True]


def test_each_batch_row_needs_its_query_after_its_keys(monkeypatch) -> None:
    """Positions per batch row drop the causal mask only where in every row the query
    comes after the row's keys; a window stays (ALiBi, sdpa against eager)."""
    pe = generated_class("alibi")(heads=4, head_dim=8).double()
    seen = spy_method(
        monkeypatch, type(pe), "_sdpa_attention", lambda q, k, v, qp, kp, causal, *_, **__: causal
    )
    q, k, v = _qkv(1, 6, 8, seed=5)
    keys = torch.tensor([[0, 2, 4, 6, 8, 10], [1, 2, 3, 5, 8, 13]])
    for query in ([[10], [13]], [[12], [9]]):  # row 1's key 13 after its query 9
        for window in (None, 4):
            positions = {"q_positions": torch.tensor(query), "k_positions": keys}
            options = {"causal": True, "window": window, **positions}
            got = pe(q, k, v, backend="sdpa", **options)
            torch.testing.assert_close(got, pe(q, k, v, backend="eager", **options))
    assert seen == [False, False, True, True]


def test_positions_ruled_out_by_their_range_skip_the_general_test(monkeypatch) -> None:
    """A decode step's positions two apart (keys evicted from a cache) are told apart
    from the defaults by their range alone: no general test (``_default_flag``); and an
    out-of-range position in the same read still raises, naming its argument."""
    calls = spy_calls(monkeypatch, [defaults_module], "_default_flag", lambda *_: 1)
    keys = torch.arange(0, 1024, 2)
    assert not defaults_module.position_verdict(keys[-1:], keys, 1, 512, True, None, True).default
    assert calls == []
    bad = keys.clone()
    bad[7] = -1
    with pytest.raises(ValueError, match="k_positions must lie in"):
        defaults_module.position_verdict(bad[-1:], bad, 1, 512, True, None, True)
