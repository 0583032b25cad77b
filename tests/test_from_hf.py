"""posgen from-hf: a Hugging Face config becomes the spec of the encoding that model uses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from posgen.check.deadline import hard_deadline
from posgen.cli import main
from posgen.codegen.inmemory import encoding_class, module_from_spec
from posgen.hf import use_posgen_attention
from posgen.spec.loader import load_spec

transformers = pytest.importorskip("transformers")


def _from_hf(config: object, tmp_path: Path, name: str) -> Path:
    config_file = tmp_path / f"{name}.json"
    config_file.write_text(json.dumps(config.to_dict()), encoding="utf-8")  # type: ignore[attr-defined]
    out = tmp_path / f"{name}.yaml"
    result = CliRunner().invoke(
        main, ["from-hf", str(config_file), "--name", name, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out


def test_a_llama_config_gives_a_spec_whose_module_reproduces_the_model(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=123456.0,
        attn_implementation="eager",
    )  # fmt: skip
    spec_path = _from_hf(config, tmp_path, "tiny_llama_positions")
    rotate = load_spec(spec_path).spec.terms.content_content.rotate  # type: ignore[union-attr]
    assert rotate.base == 123456.0 and rotate.pairing == "half"
    cls = encoding_class(module_from_spec(spec_path))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, lambda layer: cls())  # the spec's defaults: 4 heads of 12
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_partial_rotary_alibi_and_t5_configs(tmp_path: Path) -> None:
    neox = load_spec(_from_hf(transformers.GPTNeoXConfig(), tmp_path, "neox_positions")).spec
    assert neox.rotation is not None and neox.rotation.rotary_dims.fraction == 0.25
    assert neox.claims.decay is None  # measured, not claimed, for a partial rotation
    bloom = _from_hf(transformers.BloomConfig(n_head=16, hidden_size=1024), tmp_path, "bloom_pos")
    assert load_spec(bloom).spec.defaults.heads == 16
    t5_config = transformers.T5Config(relative_attention_num_buckets=64, num_heads=6, d_kv=32)
    t5 = load_spec(_from_hf(t5_config, tmp_path, "t5_positions")).spec
    assert t5.bias is not None and t5.bias.index.buckets == 64  # type: ignore[union-attr]
    assert (t5.defaults.heads, t5.defaults.head_dim) == (6, 32)


def test_settings_the_spec_language_cannot_state_are_named(tmp_path: Path) -> None:
    scaled = transformers.LlamaConfig().to_dict()
    scaled["rope_scaling"] = {"rope_type": "wobbly", "factor": 4.0}
    no_factor = transformers.LlamaConfig().to_dict()
    no_factor["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    mpt = {"model_type": "mpt", "n_heads": 12, "d_model": 768, "attn_config": {"alibi": True}}
    bias_max = {**mpt, "attn_config": {"alibi_bias_max": 16}}
    cases = [
        (scaled, "rope_scaling type 'wobbly'"),
        (no_factor, "rope_scaling.low_freq_factor: missing; it must be a finite positive"),
        (bias_max, "attn_config.alibi_bias_max 16: MosaicML's MPT then has slopes"),
        ({**mpt, "attn_config": {"alibi": False}}, "attn_config.alibi is false"),
    ]
    cases.append(({"model_type": "bert"}, "no position settings"))
    for index, (config, message) in enumerate(cases):
        path = tmp_path / f"c{index}.json"
        path.write_text(json.dumps(config), encoding="utf-8")
        result = CliRunner().invoke(main, ["from-hf", str(path)])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output


LLAMA = {"model_type": "llama", "num_attention_heads": 8, "hidden_size": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
MALFORMED = [
    ({"model_type": "llama", "num_attention_heads": 8}, "no hidden size (hidden_size / n_embd)"),
    ({**LLAMA, "rope_theta": "abc"}, 'rope_theta: must be a finite positive number, got "abc"'),
    ({**LLAMA, "rope_theta": float("inf")}, "rope_theta: must be a finite positive number"),
    ({**LLAMA, "rope_scaling": "x"}, "rope_scaling: must be a mapping"),
    ({**LLAMA, "num_attention_heads": 0}, "num_attention_heads: must be a positive integer"),
    ({**LLAMA, "num_attention_heads": 8.0}, "num_attention_heads: must be a positive integer"),
    ({**LLAMA, "head_dim": True}, "head_dim: must be a positive integer (not a boolean), got true"),
    ({**LLAMA, "partial_rotary_factor": "half"}, "partial_rotary_factor: must be a finite"),
    ({**LLAMA, "rope_scaling": {"rope_type": 4}}, "rope_scaling.rope_type: must be a string"),
    ({**LLAMA, "rope_scaling": {"type": "linear"}}, "rope_scaling.factor: missing"),
    ({**LLAMA, "rope_scaling": {**YARN, "factor": True}}, "rope_scaling.factor: must be a finite"),
    ({**LLAMA, "rope_scaling": {**YARN, "truncate": "no"}}, "rope_scaling.truncate: must be true"),
    ({**LLAMA, "rope_scaling": {**YARN, "mscale": -1}}, "rope_scaling.mscale: must be a finite"),
    (
        {**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "max_position_embeddings: missing; it must be a positive integer",
    ),
    (
        {**LLAMA, "max_position_embeddings": 4096,
         "rope_scaling": {"type": "longrope", "short_factor": ["a"], "long_factor": [1]}},
        "rope_scaling.short_factor: must be a non-empty list of finite numbers",
    ),
    (
        {**LLAMA, "rope_scaling": {"rope_type": "default", "mrope_section": [16, 0]}},
        "rope_scaling.mrope_section: must",
    ),
    (
        {"model_type": "t5", "relative_attention_num_buckets": "x"},
        "relative_attention_num_buckets: must be a positive",
    ),
    (
        {"model_type": "t5", "relative_attention_num_buckets": 32, "num_heads": 8, "d_kv": -1},
        "d_kv: must be a",
    ),
    ({"model_type": "mpt", "n_heads": 8, "d_model": 64, "attn_config": "yes"}, "attn_config: must"),
    (
        {"model_type": "mpt", "n_heads": 8, "d_model": 64, "attn_config": {"alibi": 1}},
        "attn_config.alibi: must be true or false, got 1",
    ),
    ({"model_type": "bloom", "n_head": True, "hidden_size": 64}, "n_head: must be a positive"),
    ({"model_type": "bloom", "n_head": 8, "hidden_size": 4}, "hidden_size 4 is smaller than"),
    ({"model_type": ["llama"]}, "model_type: must be a string"),
    ({"model_type": "x y"}, "invalid NAME 'x y_positions'"),
    # numbers whose arithmetic overflowed or divided by an underflowed 0, a false type
    (
        {"model_type": "mpt", "n_heads": 8, "d_model": 64,
         "attn_config": {"alibi": True, "softmax_scale": 1e-170}},
        "attn_config.softmax_scale: 1e-170 gives the logit scale 1/sqrt(inf * head_dim)",
    ),
    (
        {"model_type": "granite", "num_attention_heads": 8, "hidden_size": 64,
         "attention_multiplier": 1e-170},
        "attention_multiplier: gives the logit scale 1/sqrt(inf * head_dim)",
    ),
    (
        {**LLAMA, "partial_rotary_factor": 1e308},
        "partial_rotary_factor: must be a fraction of head_dim in (0, 1], got 1e+308",
    ),
    (
        {**LLAMA, "rope_scaling": {"rope_type": "", "factor": 2.0}},
        "rope_scaling.rope_type: must name a schedule, got ''",
    ),
    # a layer count whose per-layer list would never finish
    (
        {"model_type": "llama4_text", "num_attention_heads": 8, "hidden_size": 512,
         "head_dim": 64, "num_hidden_layers": 100000000, "no_rope_layers": []},
        "num_hidden_layers: must be a positive integer of at most 4,096 (not a boolean), "
        "got 100000000",
    ),
    (
        {"model_type": "gemma3_text", "num_attention_heads": 8, "hidden_size": 512,
         "num_hidden_layers": 10**11},
        "num_hidden_layers: must be a positive integer of at most 4,096",
    ),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(MALFORMED)))
def test_a_malformed_setting_is_named_with_what_it_allows(index: int, tmp_path: Path) -> None:
    """Exit 2 and one message naming the key, never a traceback or a silent coercion."""
    config, message = MALFORMED[index]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    result = CliRunner().invoke(main, ["from-hf", str(path)])
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert result.stdout == ""


SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 1024}),
    "yarn": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5},
        {},
    ),
    # null is falsy where Hugging Face reads truncate (.get("truncate", True)): no
    # rounding of the correction range, not the default's
    "yarn_truncate_null": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
         "truncate": None},
        {},
    ),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_theta": 500000.0},
    ),
    "longrope": (
        {"rope_type": "longrope", "short_factor": [1.0 + k / 10 for k in range(8)],
         "long_factor": [2.0 + k for k in range(8)]},
        {"max_position_embeddings": 65536, "original_max_position_embeddings": 4096},
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_scaling_configs_give_hugging_faces_frequencies(kind: str, tmp_path: Path) -> None:
    """from-hf's spec rotates with the inverse frequencies and attention factor that
    ROPE_INIT_FUNCTIONS computes for the same config (head_dim 16, partial 0.5 for yarn)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, extra = SCALINGS[kind]
    partial = {"partial_rotary_factor": 0.5} if kind.startswith("yarn") else {}
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_scaling=scaling, **extra, **partial
    )
    cls = encoding_class(module_from_spec(_from_hf(config, tmp_path, f"scaled_{kind}")))
    module = __import__("sys").modules[cls.__module__]
    rotary_dim = 8 if kind.startswith("yarn") else 16
    for length in (100, 5000, 70000):
        initial = ROPE_INIT_FUNCTIONS[scaling["rope_type"]]
        expected, attention = initial(config, "cpu", seq_len=length)
        got = module._inverse_frequencies(rotary_dim, torch.tensor(length), torch.device("cpu"))
        torch.testing.assert_close(got, expected.double(), rtol=2e-6, atol=0)
        pe = cls().double()
        ones = torch.ones(1, 1, 1, 16, dtype=torch.float64)
        zero = torch.zeros(1, dtype=torch.long)
        q, _ = pe.rotate(ones, ones, zero, zero)
        assert float(q[0, 0, 0, 0]) == pytest.approx(attention, rel=1e-12)


def test_a_phi3_config_without_its_original_length_takes_phi3s_default(tmp_path: Path) -> None:
    """Phi3Config sets original_max_position_embeddings 4096 where config.json leaves it
    out, so LongRoPE switches to the long factors past 4096 and scales by
    sqrt(1 + ln(16384 / 4096) / ln 4096); from-hf took max_position_embeddings as the
    original length and factor 1 (scores 0.14 apart at short positions, 1.15 at long
    ones). Phi3RotaryEmbedding and apply_rotary_pos_emb, float64."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    scaling = {"type": "longrope", "short_factor": [1.0 + k / 10 for k in range(8)],
               "long_factor": [2.0 + k for k in range(8)]}  # fmt: skip
    config = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
              "max_position_embeddings": 16384, "rope_scaling": scaling}  # fmt: skip
    path = tmp_path / "phi3.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    out = tmp_path / "phi3_positions.yaml"
    result = CliRunner().invoke(main, ["from-hf", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    pe = encoding_class(module_from_spec(out))().double()
    hf_config = transformers.Phi3Config(**{**config, "rope_scaling": dict(scaling)})
    rotary = Phi3RotaryEmbedding(hf_config).double()
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 6, 16, dtype=torch.float64, generator=generator) for _ in "qk")
    for start in (0, 4100):  # the short factors, then the long ones
        positions = torch.arange(start, start + 6)
        cos, sin = rotary(q, positions[None])
        rotated_q, rotated_k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        expected = rotated_q @ rotated_k.transpose(-1, -2) / 4
        got = pe.scores(q, k, q_positions=positions, k_positions=positions)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_mrope_config_gives_m_rope_axes(tmp_path: Path) -> None:
    config = transformers.Qwen2VLConfig(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    )  # fmt: skip
    rotate = load_spec(_from_hf(config, tmp_path, "qwen2_vl_positions")).spec.rotation
    assert rotate is not None and rotate.axes is not None
    assert rotate.axes.sections == [16, 24, 24] and rotate.frequencies.kind == "standard"


def test_a_qwen3_vl_config_gives_interleaved_m_rope_axes(tmp_path: Path) -> None:
    """Qwen3-VL's multimodal config: from-hf reads its text_config (family
    qwen3_vl_text, base 5e6 by default) and deals the sections out in turn, the
    family's own sections (24, 20, 20) where rope_scaling leaves them out, as
    Qwen3VLTextRotaryEmbedding does."""
    text = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2}
    config = transformers.Qwen3VLConfig(
        text_config={**text, "rope_scaling": {"rope_type": "default"}}
    )
    spec = load_spec(_from_hf(config, tmp_path, "qwen3_vl_positions")).spec
    rotate = spec.rotation
    assert rotate is not None and rotate.axes is not None and rotate.base == 5e6
    assert rotate.axes.sections == [24, 20, 20] and rotate.axes.layout == "interleaved"
    scaling = {"rope_type": "default", "mrope_section": [32, 16, 16], "mrope_interleaved": True}
    config = transformers.Qwen3VLConfig(text_config={**text, "rope_scaling": scaling})
    rotate = load_spec(_from_hf(config, tmp_path, "qwen3_vl_sections")).spec.rotation
    assert rotate is not None and rotate.axes is not None
    assert rotate.axes.sections == [32, 16, 16] and rotate.axes.layout == "interleaved"


def test_an_unknown_family_lays_m_rope_sections_out_as_its_config_says(
    tmp_path: Path,
) -> None:
    """A model_type from-hf does not know (the user states the pairing) follows
    rope_scaling.mrope_interleaved, which vLLM reads the same way; without it, runs."""
    layouts = []
    for index, flag in enumerate((True, False, None)):
        scaling: dict[str, object] = {"rope_type": "default", "mrope_section": [16, 8, 8]}
        if flag is not None:
            scaling["mrope_interleaved"] = flag
        config = transformers.LlamaConfig(
            hidden_size=256, num_attention_heads=4, rope_scaling=scaling
        ).to_dict()
        config["model_type"] = "newlm"
        config_file = tmp_path / f"newlm{index}.json"
        config_file.write_text(json.dumps(config), encoding="utf-8")
        out = tmp_path / f"newlm{index}.yaml"
        result = CliRunner().invoke(
            main,
            [
                "from-hf",
                str(config_file),
                "--pairing",
                "half",
                "--name",
                f"newlm{index}",
                "--out",
                str(out),
            ],
        )
        assert result.exit_code == 0, result.output
        rotate = load_spec(out).spec.rotation
        assert rotate is not None and rotate.axes is not None
        layouts.append(rotate.axes.layout)
    assert layouts == ["interleaved", "consecutive", "consecutive"]


@pytest.mark.parametrize("kind", ["llama3", "yarn", "dynamic"])
def test_a_scaled_llama_reproduces_its_logits_through_its_from_hf_spec(
    kind: str, tmp_path: Path
) -> None:
    """End to end: a tiny Llama with rope_scaling, its from-hf spec, and posgen.hf give
    the model's own logits (dynamic NTK at a length past the original)."""
    scaling, extra = SCALINGS[kind]
    if kind == "dynamic":
        extra = {"max_position_embeddings": 8}
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_scaling=scaling,
        attn_implementation="eager", **extra,
    )  # fmt: skip
    cls = encoding_class(module_from_spec(_from_hf(config, tmp_path, f"llama_{kind}")))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        use_posgen_attention(model, lambda layer: cls())
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_config_nested_past_the_json_reader_is_a_usage_error(tmp_path: Path) -> None:
    """A config nested 200,000 deep: exit 2 naming the file, no RecursionError traceback."""
    config = tmp_path / "config.json"
    config.write_text("[" * 200_000)
    result = CliRunner().invoke(main, ["from-hf", str(config), "--out", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "cannot read a JSON config" in result.output
    assert not (tmp_path / "x.yaml").exists()


def _refused_config(config: Path, tmp_path: Path) -> str:
    """from-hf on ``config`` (stopped by OutOfTime after 20 s where the command would
    block for ever): exit 2, no traceback, nothing written; the message."""
    out = tmp_path / "x.yaml"
    with hard_deadline(20):
        result = CliRunner().invoke(main, ["from-hf", str(config), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "cannot read a JSON config" in result.output and not out.exists()
    return result.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_config_that_is_a_named_pipe_or_a_device_is_refused_unread(tmp_path: Path) -> None:
    """/dev/zero was read until memory ran out, and a named pipe blocked for ever."""
    os.mkfifo(tmp_path / "config.json")
    assert "not a regular file (a named pipe)" in _refused_config(
        tmp_path / "config.json", tmp_path
    )
    assert "a character device" in _refused_config(Path("/dev/zero"), tmp_path)


def test_an_integer_past_pythons_digit_limit_is_a_usage_error(tmp_path: Path) -> None:
    """json.loads raises ValueError for an integer of more than 4300 digits, even in a
    key from-hf never reads: that was a traceback, exit 1."""
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "unused": ' + "9" * 4301 + "}")
    assert "Exceeds the limit" in _refused_config(config, tmp_path)


def test_a_config_over_16_mib_is_refused_before_it_is_read(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    with config.open("wb") as handle:  # a sparse file: 17 MiB of zeros, no disk used
        handle.truncate(17 * 1024**2)
    assert "file too large (17,825,792 bytes)" in _refused_config(config, tmp_path)
    assert "at most 16,777,216 bytes (16 MiB)" in _refused_config(config, tmp_path)


@pytest.mark.parametrize("name", ["lambda", "class", "len"])
def test_a_name_that_would_shadow_python_is_refused_before_anything_is_written(
    name: str, tmp_path: Path
) -> None:
    """--name lambda: exit 2 with the usage error of any bad NAME (it named a file
    that was never written), and nothing written."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "rope_theta": 10000.0}), encoding="utf-8")
    out = tmp_path / f"{name}.yaml"
    result = CliRunner().invoke(main, ["from-hf", str(path), "--name", name, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert f"invalid NAME '{name}': '{name}' is a Python" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def _run(config: dict[str, object], tmp_path: Path, *options: str) -> Any:
    """from-hf on ``config`` (written as tmp_path/config.json) with ``options``."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return CliRunner().invoke(main, ["from-hf", str(path), *options])


def _refused(config: dict[str, object], tmp_path: Path, *options: str) -> str:
    """from-hf's refusal of ``config``: exit 2, no traceback, nothing printed on stdout
    and nothing written beside the config; its stderr."""
    result = _run(config, tmp_path, *options)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.stdout == "" and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json"]
    return str(result.stderr)


@pytest.mark.parametrize("out", ["specs/my_llama.yaml", "llama4_nope.yml"])
def test_out_names_the_spec_after_its_file(out: str, tmp_path: Path) -> None:
    """--out without --name: the spec takes the file's name (a spec's name is its file's
    name), as the README's `--out specs/my_llama.yaml` needs; it was named
    MODEL_TYPE_positions, which the file name then contradicted (exit 2)."""
    result = _run(LLAMA, tmp_path, "--out", str(tmp_path / out))
    assert result.exit_code == 0, result.output
    spec = load_spec(tmp_path / out).spec
    assert spec.name == Path(out).stem


BAD_OUT = [
    (("--out", "llama.txt"), "--out {out}: a spec file is NAME.yaml or NAME.yml"),
    (("--out", "specs"), "--out {out}: a spec file is NAME.yaml or NAME.yml"),
    (("--out", "My-Llama.yaml"), "--out {out}: invalid NAME 'My-Llama'"),
    (("--out", "class.yaml"), "'class' is a Python keyword (the spec is named after the file"),
    (("--name", "foo", "--out", "bar.yaml"), "spec 'foo' goes in a file named foo.yaml"),
]


@pytest.mark.parametrize("index", range(len(BAD_OUT)))
def test_an_out_that_cannot_take_the_spec_is_refused_by_name(index: int, tmp_path: Path) -> None:
    """A suffix other than .yaml/.yml, a file name that is no spec name (no --name helps:
    the name must be the file's) and a --name the file name contradicts: exit 2 before
    the config is read, naming --out; nothing written."""
    options, message = BAD_OUT[index]
    out = str(tmp_path / options[-1])
    stderr = _refused(LLAMA, tmp_path, *options[:-1], out)
    assert message.format(out=out) in stderr


def test_an_existing_out_file_is_kept_and_the_message_names_from_hf(tmp_path: Path) -> None:
    """It said `posgen new never overwrites a file`; the file (even a dangling link) is
    left as it was."""
    out = tmp_path / "my_llama.yaml"
    out.write_text("mine\n", encoding="utf-8")
    result = _run(LLAMA, tmp_path, "--out", str(out))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"--out {out}: the file exists; posgen from-hf never overwrites a file" in (
        result.stderr
    )
    assert out.read_text(encoding="utf-8") == "mine\n"
    link = tmp_path / "linked.yaml"
    link.symlink_to(tmp_path / "nowhere.yaml")
    result = _run(LLAMA, tmp_path, "--out", str(link))
    assert result.exit_code == 2 and "posgen from-hf never overwrites" in result.stderr
    assert not (tmp_path / "nowhere.yaml").exists()


def test_rope_type_and_type_that_disagree_are_refused(tmp_path: Path) -> None:
    """LlamaConfig copies type over rope_type (the model runs linear) and GemmaConfig
    keeps rope_type (dynamic): from-hf wrote dynamic_ntk for either; it now names both
    keys. Keys that agree, or one alone, keep their reading."""
    both = {"type": "linear", "rope_type": "dynamic", "factor": 4.0}
    assert transformers.LlamaConfig(rope_scaling=dict(both)).rope_scaling["rope_type"] == "linear"
    assert transformers.GemmaConfig(rope_scaling=dict(both)).rope_scaling["rope_type"] == "dynamic"
    for model_type in ("llama", "gemma"):
        config = {**LLAMA, "model_type": model_type, "max_position_embeddings": 2048}
        stderr = _refused({**config, "rope_scaling": both}, tmp_path)
        assert "rope_scaling.type 'linear' and rope_scaling.rope_type 'dynamic' disagree" in (
            stderr
        )
    for scaling in ({**both, "type": "dynamic"}, {"type": "linear", "factor": 4.0}):
        out = tmp_path / f"agree_{len(scaling)}.yaml"
        config = {**LLAMA, "max_position_embeddings": 2048, "rope_scaling": scaling}
        result = _run(config, tmp_path, "--out", str(out))
        assert result.exit_code == 0, result.output
        rotation = load_spec(out).spec.rotation
        assert rotation is not None and rotation.frequencies.kind == scaling["type"].replace(
            "dynamic", "dynamic_ntk"
        )


@pytest.mark.parametrize("scaling", [{}, {"factor": 2.0}])
def test_a_rope_scaling_without_a_type_is_refused(
    scaling: dict[str, object], tmp_path: Path
) -> None:
    """Hugging Face looks the type up and raises KeyError (LlamaConfig at once, Gemma's
    rotary embedding when the model is built); from-hf wrote plain RoPE. Llama 4, which
    scales with llama3 whenever rope_scaling is set, needs its factor."""
    with pytest.raises(KeyError):
        transformers.LlamaConfig(rope_scaling=dict(scaling))
    assert "rope_scaling: states neither rope_type nor type" in _refused(
        {**LLAMA, "rope_scaling": scaling}, tmp_path
    )
    llama4 = {**LLAMA, "model_type": "llama4_text", "num_hidden_layers": 1, "rope_scaling": {}}
    assert "rope_scaling.factor: missing" in _refused(llama4, tmp_path)


T5_SIZES = {"num_heads": 4, "d_kv": 8, "relative_attention_num_buckets": 32}


@pytest.mark.parametrize("model_type", ["t5", "mt5", "umt5", "switch_transformers", "pop2piano"])
def test_t5_family_specs_say_they_are_the_encoders_self_attention(
    model_type: str, tmp_path: Path
) -> None:
    """The spec is the encoder's (bidirectional buckets): its title says so, and the
    notes above it give the decoder's one-sided buckets (t5_decoder) and how the
    family's layers hold the table."""
    out = tmp_path / "t5_like.yaml"
    result = _run({"model_type": model_type, **T5_SIZES}, tmp_path, "--out", str(out))
    assert result.exit_code == 0, result.output
    spec = load_spec(out).spec
    assert spec.title.endswith(f"({model_type} config, encoder self-attention)")
    assert spec.bias is not None and spec.bias.index.bidirectional  # type: ignore[union-attr]
    notes = " ".join(line.lstrip("# ") for line in out.read_text("utf-8").splitlines()[:8])
    assert "this spec is the encoder's self-attention" in notes
    assert "posgen new NAME --from t5_decoder, then set buckets: 32 and max_distance: 128" in (
        notes
    )
    assert ("its own: one module per layer" in notes) == (model_type == "umt5")


def test_a_umt5_spec_gives_umt5s_encoder_bias(tmp_path: Path) -> None:
    """UMT5 writes T5's bucket formula in steps of its own and gives every layer a table:
    the from-hf spec's bias, with a layer's table copied in, is UMT5Attention's."""
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    config = transformers.UMT5Config(
        d_model=32, num_heads=4, d_kv=8, relative_attention_num_buckets=16,
        relative_attention_max_distance=40, is_decoder=False,
    )  # fmt: skip
    cls = encoding_class(module_from_spec(_from_hf(config, tmp_path, "umt5_positions")))
    torch.manual_seed(0)
    reference = UMT5Attention(config, has_relative_attention_bias=True, layer_idx=0).double()
    pe = cls().double()
    with torch.no_grad():
        pe.relative_attention_bias.weight.copy_(reference.relative_attention_bias.weight)
        positions = torch.arange(90)
        torch.testing.assert_close(
            pe.score_bias(positions, positions), reference.compute_bias(90, 90)[0]
        )


@pytest.mark.parametrize(
    ("heads", "attn_config"),
    [
        (6, {}),  # no attn_config: alibi true
        (8, {"attn_pdrop": 0.0}),  # alibi left out: true
        (12, {"softmax_scale": 0.3}),
        (4, {"alibi": True, "alibi_bias_max": 8, "softmax_scale": 0.3}),
    ],
)
def test_an_mpt_spec_gives_mpt_attention(
    heads: int, attn_config: dict[str, Any], tmp_path: Path
) -> None:
    """MPT's slopes (build_mpt_alibi_tensor: the odd, then the even slopes of the next
    power of two) are ALiBi's for any head count; attn_config.alibi defaults to true
    and softmax_scale, where set, is the logit scale: MptAttention's weights, float64
    (it takes its softmax in float32)."""
    from transformers.models.mpt.modeling_mpt import MptAttention, build_mpt_alibi_tensor

    config = {"model_type": "mpt", "n_heads": heads, "d_model": 8 * heads, "max_seq_len": 16}
    if attn_config:
        config["attn_config"] = attn_config
    cls = encoding_class(module_from_spec(_from_hf(_Dict(config), tmp_path, "mpt_positions")))
    pe = cls().double()
    hf_config = transformers.MptConfig(**config)
    torch.manual_seed(0)
    layer = MptAttention(hf_config).double().eval()
    hidden = torch.randn(2, 9, 8 * heads, dtype=torch.float64)
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        _, expected = layer(hidden, build_mpt_alibi_tensor(heads, 16), attention_mask=causal)
        q, k, _ = layer.Wqkv(hidden).view(2, 9, 3, heads, 8).permute(2, 0, 3, 1, 4)
        scores = pe.scores(q, k).masked_fill(causal, float("-inf"))
    torch.testing.assert_close(scores.softmax(-1), expected.double(), rtol=1e-5, atol=1e-6)


class _Dict(dict):  # type: ignore[type-arg]
    """A hand-written config.json (``to_dict`` gives it as it is)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self)


T5_REFUSED = [
    ({"model_type": "longt5", **T5_SIZES}, "LongT5's encoder attends locally"),
    (
        {"model_type": "longt5", **T5_SIZES, "encoder_attention_type": "transient-global"},
        "model_type 'longt5': LongT5's encoder",
    ),
    (
        {"model_type": "mpnet", "relative_attention_num_buckets": 32,
         "num_attention_heads": 12, "hidden_size": 768},
        "relative_attention_num_buckets: model_type 'mpnet' sets it, and from-hf reads T5's",
    ),
    (T5_SIZES, "relative_attention_num_buckets: a config without model_type sets it"),
    (
        {"model_type": "t5", **T5_SIZES, "relative_attention_num_buckets": 31},
        "relative_attention_num_buckets: 31 is odd; T5's encoder splits its buckets",
    ),
    (
        {"model_type": "t5", **T5_SIZES, "relative_attention_num_buckets": 2},
        "relative_attention_num_buckets: 2; T5's encoder gives each direction half",
    ),
    (
        {"model_type": "t5", **T5_SIZES, "relative_attention_max_distance": 8},
        "relative_attention_max_distance: 8; the log-spaced buckets run from the exact "
        "range (8 distances",
    ),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(T5_REFUSED)))
def test_t5_buckets_from_hf_cannot_state_are_refused_by_name(index: int, tmp_path: Path) -> None:
    """LongT5 (local or transient-global encoder attention), a family whose code from-hf
    has not read (MPNet, or no model_type: it was a T5 spec), and buckets posgen's
    bidirectional recipe cannot hold (the spec's own check named a spec file that was
    never written): exit 2 naming the config key."""
    config, message = T5_REFUSED[index]
    stderr = _refused(config, tmp_path)
    assert message in stderr and "positions.yaml" not in stderr


PHI3 = {
    "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
}  # fmt: skip
SPEC_REFUSED = [
    (
        {**PHI3, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 10,
                                  "long_factor": [1.0] * 48}},
        "rope_scaling.short_factor: has 10 entries; longrope needs one per rotated pair: "
        "48 (96 rotated features / 2)",
    ),
    (
        {**PHI3, "partial_rotary_factor": 0.5, "rope_scaling": {
            "type": "longrope", "short_factor": [1.0] * 24, "long_factor": [1.0] * 48}},
        "rope_scaling.long_factor: has 48 entries; longrope needs one per rotated pair: "
        "24 (48 rotated features of head_dim 96 / 2)",
    ),
    (
        {**PHI3, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 47 + [0.0],
                                  "long_factor": [1.0] * 48}},
        "rope_scaling.short_factor: must be a non-empty list of finite numbers > 0",
    ),
    (
        {**LLAMA, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 2]}},
        "rope_scaling.mrope_section: [2, 1, 2] sums to 5; the sections split the rotated "
        "pairs, so they must sum to 4 (8 rotated features / 2)",
    ),
    (
        {**LLAMA, "model_type": "qwen3_vl_text", "head_dim": 64},
        "rope_scaling.mrope_section: left out, so the family's default [24, 20, 20], sums "
        "to 64; the sections split the rotated pairs, so they must sum to 32",
    ),
    # a value only the spec language bounds: reported as the config's, no spec position
    (
        {**LLAMA, "rope_theta": 1e300},
        "config.json: a setting of this config gives a spec posgen refuses (the spec's "
        "terms.content_content.rotate.base): got 1e+300",
    ),
]  # fmt: skip


@pytest.mark.parametrize("older", ["su", "yarn"])
def test_phi3_reads_its_older_type_names_as_longrope(older: str, tmp_path: Path) -> None:
    """Phi3Config rewrites rope_scaling.type "su" and "yarn" to "longrope" before its
    rotary embedding reads it; from-hf wrote a YaRN schedule for "yarn" (refused for
    want of its factor) where the model runs LongRoPE."""
    scaling = {"type": older, "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}
    assert transformers.Phi3Config(**PHI3, rope_scaling=dict(scaling)).rope_scaling["type"] == (
        "longrope"
    )
    out = tmp_path / "phi3_older.yaml"
    result = _run({**PHI3, "rope_scaling": scaling}, tmp_path, "--out", str(out))
    assert result.exit_code == 0, result.output
    rotation = load_spec(out).spec.rotation
    assert rotation is not None and rotation.frequencies.kind == "longrope"
    llama = {
        **LLAMA,
        "max_position_embeddings": 2048,
        "rope_scaling": {"type": "yarn", "factor": 4.0},
    }
    result = _run(llama, tmp_path, "--out", str(tmp_path / "llama_yarn.yaml"))
    assert result.exit_code == 0, result.output
    rotation = load_spec(tmp_path / "llama_yarn.yaml").spec.rotation
    assert rotation is not None and rotation.frequencies.kind == "yarn"


@pytest.mark.parametrize("index", range(len(SPEC_REFUSED)))
def test_config_values_the_spec_refuses_are_reported_as_the_configs(
    index: int, tmp_path: Path
) -> None:
    """These were the generated spec's diagnostics, citing a file that was never written
    (phi3_positions.yaml:19:9) and the spec's field; from-hf checks them first and names
    the config key, and what only the spec checks is said to come from the config."""
    config, message = SPEC_REFUSED[index]
    stderr = _refused(config, tmp_path, "--out", str(tmp_path / "out.yaml"))
    assert message in " ".join(stderr.split()), stderr
    assert ".yaml:" not in stderr
