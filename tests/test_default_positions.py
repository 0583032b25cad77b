"""Positions given that equal the defaults (queries M - N .. M - 1, keys 0 .. M - 1, as
Hugging Face-style position ids for a plain sequence or a KV cache are) take the paths
for default positions in eager mode (``positions_are_default``): the same outputs as
leaving them out, through the per-distance view rather than a bias per pair."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import generated_class, head_dim_for, spec_names

inputs_module = importlib.import_module("generated._inputs")
sdpa_backend = importlib.import_module("generated._sdpa_backend")

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
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, n, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(2, 4, m, head_dim, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 4, m, 8, generator=generator, dtype=torch.float64)
    for backend in ("sdpa", "eager"):
        for causal in (False, True):
            want = pe(q, k, v, causal=causal, backend=backend)
            got = pe(q, k, v, causal=causal, backend=backend, **positions(n, m))
            assert torch.equal(got, want), (backend, causal)


def test_a_bias_of_distance_takes_the_per_distance_view(monkeypatch) -> None:
    """ALiBi with position ids 0 .. N - 1 given: the sdpa backend's per-distance path
    runs; with positions one further along (not the defaults) it does not, and the
    output still equals the eager oracle's."""
    calls: list[int] = []
    cls = generated_class("alibi")
    original = cls._sdpa_by_distance

    def spy(self, q, *args, **kwargs):
        calls.append(q.shape[2])
        return original(self, q, *args, **kwargs)

    monkeypatch.setattr(cls, "_sdpa_by_distance", spy)
    pe = cls(heads=4, head_dim=8).double()
    q, k, v = (torch.randn(1, 4, 5, 8, dtype=torch.float64) for _ in "qkv")
    pe(q, k, v, backend="sdpa", q_positions=torch.arange(5), k_positions=torch.arange(5))
    assert calls == [5]
    shifted = {"q_positions": torch.arange(1, 6), "k_positions": torch.arange(1, 6)}
    got = pe(q, k, v, backend="sdpa", **shifted)
    assert calls == [5]
    torch.testing.assert_close(got, pe(q, k, v, backend="eager", **shifted))


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
def test_positions_are_default_compares_every_row(q_positions, k_positions, n, m, want) -> None:
    assert inputs_module.positions_are_default(q_positions, k_positions, n, m) is want


def test_positions_are_left_as_given_while_compiling(monkeypatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not inputs_module.positions_are_default(torch.arange(3), torch.arange(3), 3, 3)
