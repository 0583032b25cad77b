"""Randomized positional encodings (Ruoss et al. 2023): training draws sorted random
positions from a larger range, seedably; evaluation uses the plain range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from posgen.cli import main
from tests.conftest import SPECS, generated_class, spec_variant

RANGE = 4096


def _seeded(pe: torch.nn.Module, seed: int) -> torch.nn.Module:
    pe.position_generator = torch.Generator().manual_seed(seed)
    return pe


def test_training_positions_are_a_sorted_seeded_subset_of_the_range() -> None:
    pe = generated_class("rope_randomized")(heads=2, head_dim=8).train()
    first = _seeded(pe, 0)._sampled_positions(100, torch.device("cpu"))
    again = _seeded(pe, 0)._sampled_positions(100, torch.device("cpu"))
    other = _seeded(pe, 1)._sampled_positions(100, torch.device("cpu"))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == (100,) and first.dtype == torch.int64
    assert bool((first[1:] > first[:-1]).all())  # sorted and distinct
    assert 0 <= int(first.min()) and int(first.max()) < RANGE
    assert int(first.max()) > 100  # drawn from the whole range, not 0 .. 99
    assert pe.eval()._sampled_positions(100, torch.device("cpu")) is None


def test_training_forward_equals_the_drawn_explicit_positions() -> None:
    pe = generated_class("rope_randomized")(heads=2, head_dim=8)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    drawn = _seeded(pe.train(), 3)._sampled_positions(6, torch.device("cpu"))
    trained = _seeded(pe, 3)(q, k, v, causal=True)
    explicit = pe(q, k, v, causal=True, q_positions=drawn, k_positions=drawn)
    torch.testing.assert_close(trained, explicit, rtol=0, atol=0)
    # fewer queries than keys (a chunk of a prefill): the queries are the last keys
    # and take the last of the drawn positions, as default positions do
    fewer = _seeded(pe, 3)(q[:, :, 4:], k, v, causal=True)
    explicit = pe(q[:, :, 4:], k, v, causal=True, q_positions=drawn[4:], k_positions=drawn)
    torch.testing.assert_close(fewer, explicit, rtol=0, atol=0)
    plain = generated_class("rope")(heads=2, head_dim=8)
    torch.testing.assert_close(pe.eval()(q, k, v, causal=True), plain(q, k, v, causal=True))


def test_an_input_table_draws_its_training_positions_too() -> None:
    cls = spec_variant(
        "sinusoidal",
        ("claims:", "positions: {kind: randomized, max_positions: 512}\nclaims:"),
        name="sinusoidal_randomized",
    )
    pe = cls(model_dim=8).train()
    pe.position_generator = torch.Generator().manual_seed(5)
    x = torch.zeros(1, 10, 8)
    drawn = cls(model_dim=8).train()
    drawn.position_generator = torch.Generator().manual_seed(5)
    positions = drawn._sampled_positions(10, torch.device("cpu"))
    torch.testing.assert_close(pe.embed(x), pe.eval().embed(x, positions))
    with pytest.raises(ValueError, match="randomized range of 512"):
        pe.train().embed(torch.zeros(1, 513, 8))


def test_a_range_past_a_learned_table_is_a_spec_error(tmp_path: Path) -> None:
    text = (SPECS / "learned_absolute.yaml").read_text(encoding="utf-8")
    path = tmp_path / "learned_absolute.yaml"
    path.write_text(
        text.replace("claims:", "positions: {kind: randomized, max_positions: 4096}\nclaims:"),
        encoding="utf-8",
    )
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "positions.max_positions" in result.output
