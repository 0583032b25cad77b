"""``posgen check --weights``: a learned encoding is judged at trained values."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

from posgen.cli import main
from tests.conftest import SPECS, generated_class

T5_SPEC = str(SPECS / "t5.yaml")


def _decaying_t5_weights(path: Path) -> Path:
    """T5's defaults with a bias that falls with the bucket index in both directions."""
    state = generated_class("t5")().state_dict()
    table = state["relative_attention_bias.weight"]  # [32 buckets, heads]
    per_direction = table.shape[0] // 2
    falling = -torch.arange(per_direction, dtype=table.dtype)[:, None].expand(-1, table.shape[1])
    state["relative_attention_bias.weight"] = torch.cat((falling, falling)).clone()
    torch.save(state, path)
    return path


def test_trained_weights_change_the_verdict(tmp_path: Path) -> None:
    """t5.yaml claims decay: false, true at random init; a trained, decaying table refutes it."""
    runner = CliRunner()
    args = ["check", T5_SPEC, "--only", "decay", "--max-examples", "20"]
    at_init = runner.invoke(main, args)
    assert at_init.exit_code == 0, at_init.output
    weights = _decaying_t5_weights(tmp_path / "t5.pt")
    trained = runner.invoke(main, [*args, "--weights", str(weights)])
    assert trained.exit_code == 1, trained.output
    assert "REFUTED" in trained.output


def test_weights_that_do_not_fit_are_a_usage_error(tmp_path: Path) -> None:
    runner = CliRunner()
    state = generated_class("t5")().state_dict()
    wrong_shape = {"relative_attention_bias.weight": torch.zeros(16, 8)}
    extra = {**state, "other.weight": torch.zeros(1)}
    state_one = torch.zeros(1)
    cases = {
        "shape.pt": (wrong_shape, "is [16, 8], the module's is [32, 8]"),
        "extra.pt": (extra, "unexpected other.weight"),
        "empty.pt": ({}, "missing relative_attention_bias.weight"),
        "not_a_dict.pt": (torch.zeros(3), "expected a state_dict"),
        # a whole layer's state_dict: the encoding's keys under "pe."
        "layer.pt": (
            {**{f"pe.{key}": value for key, value in state.items()}, "proj.weight": state_one},
            "every key the module has is there under the prefix 'pe.': save "
            "{k.removeprefix('pe.'): v for k, v in state.items() if k.startswith('pe.')}",
        ),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        torch.save(content, path)
        result = runner.invoke(main, ["check", T5_SPEC, "--weights", str(path)])
        assert result.exit_code == 2 and message in result.output, (name, result.output)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    result = runner.invoke(main, ["check", T5_SPEC, "--weights", str(garbage)])
    assert result.exit_code == 2 and "cannot read weights" in result.output
    # one line of posgen's, without torch's advice to load with weights_only=False
    error_line = result.stderr.strip().splitlines()[-1]
    assert "not a file of tensors that torch.save wrote (UnpicklingError: " in error_line
    assert "weights_only" not in result.stderr
    # a whole module pickled: torch's advice (allow-list the class) is for code; the
    # command takes its state_dict
    whole = tmp_path / "module.pt"
    torch.save(generated_class("t5")(), whole)
    result = runner.invoke(main, ["check", T5_SPEC, "--weights", str(whole)])
    assert result.exit_code == 2, result.output
    assert "save module.state_dict(), not the module" in result.stderr
    assert "add_safe_globals" not in result.stderr
    two = runner.invoke(
        main, ["check", T5_SPEC, str(SPECS / "alibi.yaml"), "--weights", str(garbage)]
    )
    assert two.exit_code == 2 and "one spec" in two.output


def test_float8_weights_are_judged_not_a_traceback(tmp_path: Path) -> None:
    """torch has no isfinite for float8_e4m3fn: weights in it gave NotImplementedError
    and a traceback. Finite ones are judged; a NaN (e4m3fn has no inf) is named."""
    runner = CliRunner()
    state = generated_class("t5")().state_dict()
    table = state["relative_attention_bias.weight"].clamp(-8, 8)  # within float8's range
    args = ["check", T5_SPEC, "--only", "decay", "--max-examples", "5", "--weights"]
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        path = tmp_path / f"{dtype}.pt"
        torch.save({"relative_attention_bias.weight": table.to(dtype)}, path)
        result = runner.invoke(main, [*args, str(path)])
        assert result.exit_code == 0, (dtype, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
        poisoned = table.clone()
        poisoned[3, 1] = float("nan")
        torch.save({"relative_attention_bias.weight": poisoned.to(dtype)}, path)
        result = runner.invoke(main, [*args, str(path)])
        assert result.exit_code == 2, (dtype, result.output)
        assert "has 1 non-finite value (NaN or ±inf)" in result.output
