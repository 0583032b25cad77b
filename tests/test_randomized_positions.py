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
    first = _seeded(pe, 0).sample_positions(100, torch.device("cpu"))
    again = _seeded(pe, 0).sample_positions(100, torch.device("cpu"))
    other = _seeded(pe, 1).sample_positions(100, torch.device("cpu"))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == (100,) and first.dtype == torch.int64
    assert bool((first[1:] > first[:-1]).all())  # sorted and distinct
    assert 0 <= int(first.min()) and int(first.max()) < RANGE
    assert int(first.max()) > 100  # drawn from the whole range, not 0 .. 99
    assert pe.eval()._sampled_positions(100, torch.device("cpu")) is None  # forward: 0 .. M - 1
    assert torch.equal(_seeded(pe, 0).sample_positions(100), first)  # drawn in evaluation too


def test_training_forward_equals_the_drawn_explicit_positions() -> None:
    pe = generated_class("rope_randomized")(heads=2, head_dim=8)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    drawn = _seeded(pe.train(), 3).sample_positions(6, torch.device("cpu"))
    trained = _seeded(pe, 3)(q, k, v, causal=True)
    explicit = pe(q, k, v, causal=True, q_positions=drawn, k_positions=drawn)
    torch.testing.assert_close(trained, explicit, rtol=0, atol=0)
    # fewer queries than keys (a chunk of a prefill): the queries are the last keys
    # and take the last of the drawn positions, as default positions do
    fewer = _seeded(pe, 3)(q[:, :, 4:], k, v, causal=True)
    explicit = pe(q[:, :, 4:], k, v, causal=True, q_positions=drawn[4:], k_positions=drawn)
    torch.testing.assert_close(fewer, explicit, rtol=0, atol=0)
    plain = generated_class("rope_gptj")(heads=2, head_dim=8)  # interleaved, as Ruoss et al.
    torch.testing.assert_close(pe.eval()(q, k, v, causal=True), plain(q, k, v, causal=True))
    # evaluation with drawn positions (Ruoss et al.'s code draws there too)
    evaluated = pe(q, k, v, causal=True, q_positions=drawn, k_positions=drawn)
    torch.testing.assert_close(evaluated, _seeded(pe.train(), 3)(q, k, v, causal=True))


def _ruoss_rotation(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Ruoss et al.'s ``apply_rotary_encoding`` in float64: feature 2k pairs with 2k + 1,
    angle position * 10000^(-k / (d / 2)). x: [B, H, N, D]; positions: [N]."""
    d = x.shape[-1]
    inv_freq = (
        10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    ).repeat_interleave(2)
    angle = positions.double()[:, None] * inv_freq  # [N, D]
    swapped = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).reshape(x.shape)
    return x * angle.cos() + swapped * angle.sin()


def test_logits_and_scores_follow_the_reference_rotation_at_drawn_positions() -> None:
    pe = _seeded(generated_class("rope_randomized")(heads=2, head_dim=8).double(), 7)
    q, k = (
        torch.randn(1, 2, 5, 8, dtype=torch.float64),
        torch.randn(1, 2, 5, 8, dtype=torch.float64),
    )
    drawn = pe.sample_positions(5)
    want = _ruoss_rotation(q, drawn) @ _ruoss_rotation(k, drawn).transpose(-1, -2) / 8**0.5
    got = pe.scores(q, k, q_positions=drawn, k_positions=drawn)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="length must be an int >= 0"):
        pe.sample_positions(-1)
    with pytest.raises(ValueError, match="randomized range of 4096"):
        pe.sample_positions(4097)


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
    positions = drawn.sample_positions(10, torch.device("cpu"))
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
