"""Hostile and out-of-range specs: a ``file:line:col`` diagnostic and exit 2, from every
command that reads specs, quickly, with nothing written and no traceback (issue 11).

Items: 3 (names that shadow generated code), 5 (hostile YAML: size, nesting, long
numbers, non-regular files, long values, ambiguous number forms), 6 (bounds of numeric
fields), 12 (terminal control sequences), 15 (the same file named twice), 23 (claims,
the rotary fraction in ``explain``, ``models`` entries true of their spec).
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from pydantic import BaseModel
from pydantic_core import PydanticCustomError

from posgen.cli import main
from posgen.spec import model as spec_model
from posgen.spec.diagnostics import MAX_ECHO, Diagnostic, SpecError, printable, quoted
from posgen.spec.loader import MAX_NESTING, MAX_SPEC_BYTES, load_spec, load_specs
from posgen.spec.names import generated_names
from posgen.spec.yaml_source import YamlError, load_yaml
from tests.conftest import ROOT, SPECS

NOPE = (SPECS / "nope.yaml").read_text(encoding="utf-8")


def spec_text(base: str, name: str, *replacements: tuple[str, str]) -> str:
    """``specs/<base>.yaml`` renamed to ``name`` with text replacements (each must apply)."""
    text = (SPECS / f"{base}.yaml").read_text(encoding="utf-8")
    for old, new in ((f"name: {base}\n", f"name: {name}\n"), *replacements):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def position(text: str, fragment: str) -> tuple[int, int]:
    """1-based (line, col) of the first occurrence of ``fragment`` in ``text``."""
    offset = text.index(fragment)
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


def command_lines(path: Path, out: Path) -> dict[str, list[str]]:
    """Every CLI command that reads specs, run on ``path`` (relative to the cwd)."""
    return {
        "validate": ["validate", str(path)],
        "generate": ["generate", str(path), "--out", str(out)],
        "generate --check": ["generate", "--check", str(path), "--out", str(out)],
        "explain": ["explain", str(path)],
        "check": ["check", str(path)],
    }


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def refused_everywhere(path: Path, tmp_path: Path) -> str:
    """Run every command on ``path``: exit 2, one diagnostic first, nothing written.

    Returns that first diagnostic line (the same from every command).
    """
    out = tmp_path / "out"
    firsts = set()
    for command, args in command_lines(path, out).items():
        started = time.perf_counter()
        result = invoke(*args)
        assert result.exit_code == 2, (command, result.output)
        assert "Traceback" not in result.output, command
        assert result.stderr.splitlines()[-1].endswith("nothing written."), command
        assert not out.exists(), f"{command} wrote {out}"
        assert time.perf_counter() - started < 10, f"{command} took too long"
        firsts.add(result.stderr.splitlines()[0])
    assert len(firsts) == 1, firsts
    return firsts.pop()


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- item 3: names


@pytest.mark.parametrize(
    ("name", "class_name"),
    [
        ("f", "F"),
        ("tensor", "Tensor"),
        ("positional_attention", "PositionalAttention"),
        ("b_a_c_k_e_n_d_s", "BACKENDS"),
        ("e_n_c_o_d_i_n_g_s", "ENCODINGS"),  # the registry's dict
        ("b_u_c_k_e_t_s", "BUCKETS"),  # a block helper's constant
        ("none", "None"),  # a keyword as class name (was a traceback)
        ("assertion_error", "AssertionError"),  # a builtin as class name
    ],
)
def test_names_that_shadow_generated_code_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, class_name: str
) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", name)
    line, col = position(text, f"name: {name}\n")
    first = refused_everywhere(write(Path("."), name, text), tmp_path)
    assert first.startswith(f"{name}.yaml:{line}:{col + 6}: name: '{name}' would give class ")
    assert f"'{class_name}'" in first and "choose another name" in first


def test_module_names_that_generated_code_uses_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first = refused_everywhere(write(Path("."), "nn", spec_text("nope", "nn")), tmp_path)
    assert first.startswith("nn.yaml:2:7: name: 'nn' is a name generated code already uses")


def test_the_reserved_names_are_computed_from_the_templates() -> None:
    from posgen.codegen.imports import FIXED, defined_names
    from posgen.codegen.render import RUNTIME_SOURCE, runtime_sources, templates_dir
    from posgen.spec import names

    reserved = generated_names()
    assert names.templates_dir() == templates_dir()
    assert names.RUNTIME_SOURCE == RUNTIME_SOURCE
    assert {item.name for item in FIXED} <= set(reserved)
    for file_name, source in runtime_sources().items():
        assert set(defined_names(source)) <= set(reserved), file_name
        assert file_name.removesuffix(".py") in reserved
    assert {"SPEC_FILE", "SPEC_SHA256", "__all__", "ENCODINGS", "_attention", "_masks"} <= set(
        reserved
    )
    assert "torch.nn.functional" not in reserved and "F" in reserved
    # nothing from a docstring or a class body: every catalogue name is still free
    for path in SPECS.glob("*.yaml"):
        assert names.reserved_name_problem(path.stem) is None, path.stem


def test_the_spec_layer_never_imports_codegen() -> None:
    for path in [*(ROOT / "posgen" / "spec").glob("*.py"), ROOT / "posgen" / "describe.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("posgen.codegen"), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("posgen.codegen") for a in node.names), path


# --------------------------------------------------------------------------- item 5: hostile YAML


def test_a_huge_integer_is_a_diagnostic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "huge_int", ("heads: 8", "heads: " + "9" * 5000))
    line, col = position(text, "9999")
    first = refused_everywhere(write(Path("."), "huge_int", text), tmp_path)
    assert first.startswith(f"huge_int.yaml:{line}:{col}: defaults.heads: number literal is ")
    assert "5,000 characters" in first and len(first) < 300


def test_deep_nesting_is_a_diagnostic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "deep") + "extra: " + "[" * 600 + "]" * 600 + "\n"
    first = refused_everywhere(write(Path("."), "deep", text), tmp_path)
    line, col = position(text, "extra: [")
    # the root mapping is level 1, so the 32nd '[' opens level 33
    assert first.startswith(f"deep.yaml:{line}:{col + 7 + MAX_NESTING - 1}: <document>: ")
    assert f"more than {MAX_NESTING} levels" in first


def test_nesting_up_to_the_limit_is_plain_yaml() -> None:
    inner = MAX_NESTING - 1  # below the root mapping
    loaded = load_yaml("a: " + "[" * inner + "1" + "]" * inner + "\n", "ok.yaml")
    assert loaded.data is not None
    with pytest.raises(YamlError, match="levels"):
        load_yaml("a: " + "[" * (inner + 1) + "1" + "]" * (inner + 1) + "\n", "deep.yaml")


@pytest.mark.parametrize("size", [MAX_SPEC_BYTES + 1, 5 * 1024 * 1024])
def test_a_large_file_is_refused_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "large")
    text += "#" * (size - len(text.encode()) - 1) + "\n"
    first = refused_everywhere(write(Path("."), "large", text), tmp_path)
    assert first == (
        f"large.yaml:1:1: <file>: file too large ({size:,} bytes): a spec file holds at most "
        f"{MAX_SPEC_BYTES:,} bytes (256 KiB)"
    )


def test_a_file_at_the_size_limit_is_read(tmp_path: Path) -> None:
    text = spec_text("nope", "at_limit")
    text += "#" * (MAX_SPEC_BYTES - len(text.encode()) - 1) + "\n"
    path = write(tmp_path, "at_limit", text)
    assert path.stat().st_size == MAX_SPEC_BYTES
    assert load_spec(path).spec.name == "at_limit"


def _run_posgen(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "posgen", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.yaml")
    write(tmp_path, "nope", NOPE)
    expected = (
        "pipe.yaml:1:1: <file>: not a regular file (a named pipe): a spec is a plain YAML file"
    )
    for command, args in command_lines(Path("pipe.yaml"), tmp_path / "out").items():
        result = _run_posgen(args, tmp_path)  # blocking would hit the timeout
        assert result.returncode == 2, (command, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout
        assert result.stderr.splitlines()[0] == expected, command
    assert not (tmp_path / "out").exists()
    folder = _run_posgen(["validate", "."], tmp_path)  # found through a folder
    assert folder.returncode == 2 and folder.stderr.splitlines()[0] == expected


def test_a_directory_named_like_a_spec_is_refused(tmp_path: Path) -> None:
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(SpecError) as caught:
        load_spec(tmp_path / "folder.yaml")
    assert "not a regular file (a directory)" in caught.value.diagnostics[0].message


def test_a_huge_value_in_an_enum_field_gives_a_short_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    value = "x" * 200_000
    text = spec_text("nope", "long_enum", ("scale: inv_sqrt_head_dim", f"scale: {value}"))
    line, col = position(text, value)
    first = refused_everywhere(write(Path("."), "long_enum", text), tmp_path)
    assert first.startswith(f"long_enum.yaml:{line}:{col}: scale: got 'xxxx")
    assert "(200,000 characters); allowed: 'none' or 'inv_sqrt_head_dim'" in first
    assert len(first) < 250


def test_a_huge_unknown_key_gives_a_short_line(tmp_path: Path) -> None:
    key = "k" * 100_000
    text = spec_text("nope", "long_key") + f"? {key}\n: 1\n"  # past the 1024 of a simple key
    path = write(tmp_path, "long_key", text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    rendered = caught.value.diagnostics[0].render()
    assert "unknown field 'kkkk" in rendered and "(100,000 characters)" in rendered
    assert len(rendered) < len(str(path)) + 350


def test_quoted_values_are_capped() -> None:
    text = quoted("y" * 1_000_000)
    assert text.startswith("'yyy") and text.endswith("...' (1,000,000 characters)")
    assert len(text) < MAX_ECHO + 40
    assert quoted("short") == "'short'"


@pytest.mark.parametrize(
    ("written", "words"),
    [
        ("010", ["leading zero in '010'", "octal 8", "write 10"]),
        ("0o10", ["octal form '0o10'", "write 8"]),
        ("0x10", ["hexadecimal form '0x10'", "write 16"]),
        ("0b11", ["binary form '0b11'", "write 3"]),
        ("1_000", ["digit separators in '1_000'", "write 1000"]),
        ("1:20", ["sexagesimal (base 60) form '1:20'", "YAML 1.1 reads 80"]),
        (".inf", ["non-finite number '.inf'"]),
        (".nan", ["non-finite number '.nan'"]),
    ],
)
def test_ambiguous_number_forms_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str, words: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "ambiguous", ("heads: 8", f"heads: {written}"))
    line, col = position(text, f"heads: {written}")
    first = refused_everywhere(write(Path("."), "ambiguous", text), tmp_path)
    assert first.startswith(f"ambiguous.yaml:{line}:{col + 7}: defaults.heads: ")
    for word in words:
        assert word in first


def test_ambiguous_float_forms_are_refused_and_quoted_text_is_kept(tmp_path: Path) -> None:
    for written in ("01.5", "1_0.5", "1:20.5"):
        text = spec_text("deberta", "floats", ("factor: 3}", f"factor: {written}}}"))
        with pytest.raises(SpecError) as caught:
            load_spec(write(tmp_path, "floats", text))
        assert caught.value.diagnostics[0].field == "scale.factor", written
    old_title = "title: No positional encoding (NoPE), the baseline"
    title = spec_text("nope", "quoted", (old_title, 'title: "010"'))
    assert load_spec(write(tmp_path, "quoted", title)).spec.title == "010"


# --------------------------------------------------------------------------- item 6: bounds


def _numeric_fields(model: type[BaseModel], seen: set[type[BaseModel]]) -> list[tuple]:
    """(model, field name, number type, field info) of every int or float field."""
    found: list[tuple] = []
    if model in seen:
        return found
    seen.add(model)
    hints = typing.get_type_hints(model, include_extras=True)
    for name, info in model.model_fields.items():
        for kind in _leaf_types(hints[name]):
            if kind in (int, float):
                found.append((model, name, kind, info))
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                found.extend(_numeric_fields(kind, seen))
    return found


def _leaf_types(annotation: object) -> list[object]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list):
        return [leaf for arg in typing.get_args(annotation) for leaf in _leaf_types(arg)]
    return [annotation]


NUMERIC_FIELDS = _numeric_fields(spec_model.Spec, set())


def _without_none(annotation: object) -> object:
    """X for X | None (a list of numbers that may be omitted)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def test_every_numeric_field_is_bounded_and_says_why() -> None:
    assert len(NUMERIC_FIELDS) > 30
    for model, name, _kind, info in NUMERIC_FIELDS:
        bounds = {type(item).__name__ for item in info.metadata}
        where = f"{model.__name__}.{name}"
        if typing.get_origin(_without_none(info.annotation)) is list:  # bounded items
            item = typing.get_args(_without_none(info.annotation))[0]
            bounds = {type(m).__name__ for arg in typing.get_args(item)[1:] for m in arg.metadata}
        assert bounds & {"Gt", "Ge"} and bounds & {"Lt", "Le"}, where
        assert info.description and any(c.isdigit() for c in info.description), where


def test_the_schema_shows_why_a_field_is_bounded() -> None:
    schema = spec_model.Spec.model_json_schema()
    # scale is a keyword or a mapping: the bounds are in the mapping's schema
    (mapping,) = [form for form in schema["$defs"]["Scale"]["anyOf"] if form["type"] == "object"]
    scale = mapping["properties"]["factor"]
    assert scale["minimum"] == 1e-3 and scale["maximum"] == 1e3
    assert "NaN" in scale["description"]
    learned = schema["$defs"]["LearnedTable"]["properties"]
    assert learned["max_positions"]["maximum"] == 2**21
    assert "(0, 10]" in learned["init_std"]["description"]


@pytest.mark.parametrize(
    ("base", "old", "new", "field"),
    [
        ("deberta", "factor: 3}", "factor: 1e-308}", "scale.factor"),
        ("deberta", "factor: 3}", "factor: 1e308}", "scale.factor"),
        ("learned_absolute", "init_std: 0.02", "init_std: 1e300", "input.table.init_std"),
        ("learned_absolute", "init_std: 0.02", "init_std: 11", "input.table.init_std"),
        ("multiplicative_learned", "init_mean: 1.0", "init_mean: 1e6", "input.table.init_mean"),
        (
            "learned_absolute",
            "max_positions: 1024",
            "max_positions: 2097153",
            "input.table.max_positions",
        ),
        ("rope", "base: 10000", "base: 1e300", "terms.content_content.rotate.base"),
        ("sinusoidal", "base: 10000", "base: 1e10", "input.table.base"),
        ("transformer_xl", "base: 10000", "base: 1e10", "relative.table.base"),
        ("complex_order", "frequency_base: 10000", "frequency_base: 1e12", "input.frequency_base"),
        ("deberta", "eps: 1.0e-7", "eps: 1.0e-300", "relative.table.norm.eps"),
        ("floater", "position_step: 0.1", "position_step: 1e6", "input.table.position_step"),
        ("hierarchical_absolute", "init_std: 0.02", "init_std: 1e300", "input.table.init_std"),
        ("shaw", "init_std: 0.02", "init_std: 1e300", "relative.table.init_std"),
        ("convolutional", "kernel_size: 3", "kernel_size: 4095", "input.table.kernel_size"),
        ("convolutional_grid", "kernel_size: 3", "kernel_size: 65", "input.table.kernel_size"),
        ("nope", "heads: 8", "heads: 4096", "defaults.heads"),
        ("nope", "head_dim: 64", "head_dim: 65536", "defaults.head_dim"),
        ("sinusoidal", "model_dim: 512", "model_dim: 1048576", "defaults.model_dim"),
    ],
)
def test_out_of_range_numbers_are_refused(
    tmp_path: Path, base: str, old: str, new: str, field: str
) -> None:
    text = spec_text(base, "bounded", (old, new))
    with pytest.raises(SpecError) as caught:
        load_spec(write(tmp_path, "bounded", text))
    (diagnostic,) = caught.value.diagnostics
    assert diagnostic.field == field
    assert (diagnostic.line, diagnostic.col) == position(text, new.split(": ")[1].rstrip("}"))


def test_out_of_range_is_exit_2_everywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("deberta", "tiny_factor", ("factor: 3}", "factor: 1e-308}"))
    first = refused_everywhere(write(Path("."), "tiny_factor", text), tmp_path)
    assert "scale.factor: got 1e-308; input should be greater than or equal to 0.001" in first


def _finite_outputs(path: Path, model_dim: int | None = None) -> bool:
    from posgen.codegen.inmemory import encoding_class, module_from_spec

    torch.manual_seed(0)
    pe = encoding_class(module_from_spec(path))()
    q, k, v = (torch.randn(1, pe.heads, 16, pe.head_dim) for _ in range(3))
    outputs = [pe(q, k, v, backend="eager"), pe(q, k, v, causal=True, backend="eager")]
    if model_dim is not None:
        outputs.append(pe.embed(torch.randn(1, 16, model_dim)))
    return all(bool(torch.isfinite(out).all()) for out in outputs)


@pytest.mark.parametrize(
    ("base", "replacements", "model_dim"),
    [
        ("deberta", [("factor: 3}", "factor: 0.001}")], 768),
        ("deberta", [("factor: 3}", "factor: 1000}")], 768),
        ("rope", [("base: 10000", "base: 1e9")], None),
        ("rope", [("base: 10000", "base: 1.0001")], None),
        (
            "multiplicative_learned",
            [("init_mean: 1.0", "init_mean: 10"), ("init_std: 0.02", "init_std: 10")],
            768,
        ),
        ("deberta", [("eps: 1.0e-7", "eps: 1.0e-12")], 768),
        ("transformer_xl", [("base: 10000", "base: 1e9")], 512),
    ],
)
def test_values_at_the_bounds_give_finite_modules(
    tmp_path: Path, base: str, replacements: list[tuple[str, str]], model_dim: int | None
) -> None:
    path = write(tmp_path, "at_bound", spec_text(base, "at_bound", *replacements))
    assert _finite_outputs(path, model_dim)


def test_catalogue_limits_are_still_allowed(tmp_path: Path) -> None:
    """Documented maxima still validate (a 2^21-row table of width 64, a 63 x 63 kernel)."""
    narrow = ("model_dim: 768", "model_dim: 64")  # 2^21 x 64 = 2^27 floats: at the limit
    load_spec(
        write(
            tmp_path,
            "maxima",
            spec_text(
                "learned_absolute",
                "maxima",
                ("max_positions: 1024", "max_positions: 2097152"),
                narrow,
            ),
        )
    )
    for base, old, new in [
        ("convolutional_grid", "kernel_size: 3", "kernel_size: 63"),
        ("convolutional", "kernel_size: 3", "kernel_size: 1023"),
        ("t5", "max_distance: 128", "max_distance: 3000000"),
        ("learned_absolute", "init_std: 0.02", "init_std: 1.0e-13"),
    ]:
        load_spec(write(tmp_path, "maxima", spec_text(base, "maxima", (old, new))))


# --------------------------------------------------------------------------- item 12: control


OSC = "\x1b]0;pwned\x07"


def test_an_osc_sequence_in_a_name_is_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "osc_name", ("name: osc_name\n", 'name: "\\e]0;pwned\\a"\n'))
    first = refused_everywhere(write(Path("."), "osc_name", text), tmp_path)
    assert first.startswith("osc_name.yaml:2:7: name: got '\\x1b]0;pwned\\x07'; ")
    assert "\x1b" not in first and "\x07" not in first


def test_an_osc_sequence_in_an_unknown_key_is_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "osc_key") + '"\\e]0;pwned\\a": 1\n'
    first = refused_everywhere(write(Path("."), "osc_key", text), tmp_path)
    line = text.count("\n")
    assert first.startswith(
        f"osc_key.yaml:{line}:1: \\x1b]0;pwned\\x07: unknown field '\\x1b]0;pwned\\x07'"
    )


def test_an_osc_sequence_in_a_file_name_is_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(Path("."), f"spec{OSC}", NOPE)
    first = refused_everywhere(path, tmp_path)
    assert first.startswith("spec\\x1b]0;pwned\\x07.yaml:2:7: name: name 'nope' must match")
    assert "\x1b" not in first
    folder = Path(f"folder{OSC}")
    folder.mkdir()
    write(folder, "nope", NOPE)
    result = invoke("validate", str(folder))
    assert result.exit_code == 0 and "\x1b" not in result.output
    assert result.output == "ok  folder\\x1b]0;pwned\\x07/nope.yaml\n"


@pytest.mark.parametrize(
    ("character", "what"),
    [
        ("\\x9b", "a control character (U+009B)"),
        ("\\x85", "a control character (U+0085)"),
        ("\\e", "a control character (U+001B)"),
        ("\\u202e", "a bidirectional control (U+202E)"),
        ("\\u2066", "a bidirectional control (U+2066)"),
        ("\\u2028", "a line or paragraph separator (U+2028)"),
    ],
)
@pytest.mark.parametrize("field", ["title", "references", "models"])
def test_control_and_bidi_characters_in_free_text_are_refused(
    tmp_path: Path, character: str, what: str, field: str
) -> None:
    value = f'"abc {character}def"'
    old, new = {
        "title": ("title: No positional encoding (NoPE), the baseline", f"title: {value}"),
        "references": ('  - "Haviv', f'  - {value}\n  - "Haviv'),
        "models": ("models: [", f"models: [{value}, "),
    }[field]
    text = spec_text("nope", "free_text", (old, new))
    with pytest.raises(SpecError) as caught:
        load_spec(write(tmp_path, "free_text", text))
    (diagnostic,) = caught.value.diagnostics
    assert diagnostic.field == {"title": "title"}.get(field, f"{field}[0]")
    assert (diagnostic.line, diagnostic.col) == position(text, value)
    assert diagnostic.message.startswith(f"{what} at character 5: free text is one line")


def test_the_schema_pattern_refuses_what_the_loader_refuses_below_u_ffff() -> None:
    """Every character of the Basic Multilingual Plane: the schema's text pattern (read
    with Python's re, whose syntax for it matches ECMA-262's) refuses exactly those the
    loader refuses; past U+FFFF only the tags differ (the pattern cannot name them)."""
    pattern = re.compile(spec_model.TEXT_PATTERN)
    refused_by_loader, refused_by_pattern = [], []
    for code in range(0x10000):
        if 0xD800 <= code <= 0xDFFF:
            continue  # surrogates: no character of their own
        text = f"a{chr(code)}b"
        try:
            spec_model.plain_text(text)
        except PydanticCustomError:
            refused_by_loader.append(code)
        if pattern.fullmatch(text) is None:
            refused_by_pattern.append(code)
    assert refused_by_pattern == refused_by_loader
    assert 0xFEFF in refused_by_pattern and 0x00AD in refused_by_pattern


def test_a_raw_control_character_is_one_located_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """YAML itself refuses a raw ESC: the diagnostic points at it and shows it escaped."""
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "raw_esc", ("the baseline", f"the baseline {OSC}"))
    line, col = position(text, OSC)
    first = refused_everywhere(write(Path("."), "raw_esc", text), tmp_path)
    assert first.startswith(f"raw_esc.yaml:{line}:{col}: <document>: invalid YAML: character ")
    assert "\\x1b (U+001B)" in first and "\x1b" not in first


def test_printable_escapes_what_a_terminal_would_obey() -> None:
    assert printable("plain, non-ASCII é ｆ and emoji \U0001f600") == (
        "plain, non-ASCII é ｆ and emoji \U0001f600"
    )
    assert printable(f"a{OSC}b\x9b31m\u202ec\u2066\x85") == (
        "a\\x1b]0;pwned\\x07b\\x9b31m\\u202ec\\u2066\\x85"
    )
    rendered = Diagnostic(f"x{OSC}.yaml", 1, 2, f"k{OSC}", f"m{OSC}").render()
    assert rendered == ("x\\x1b]0;pwned\\x07.yaml:1:2: k\\x1b]0;pwned\\x07: m\\x1b]0;pwned\\x07")


def test_explain_and_list_escape_what_they_print(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The echo points escape, whatever the lines hold (validation keeps them clean)."""
    import posgen.cli

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(posgen.cli, "explanation", lambda spec: [f"title {OSC}\u202e"])
    monkeypatch.setattr(posgen.cli, "encoding_rows", lambda specs: [f"row {OSC}"])
    monkeypatch.setattr(posgen.cli, "model_rows", lambda specs: ["model \x9b"])
    assert invoke("explain", "rope").output == "title \\x1b]0;pwned\\x07\\u202e\n"
    assert invoke("list").output == "row \\x1b]0;pwned\\x07\n"
    assert invoke("list", "--models").output == "model \\x9b\n"


# --------------------------------------------------------------------------- item 15: twice


def test_the_same_spec_named_twice_counts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    twice = invoke("validate", "specs/rope.yaml", "specs/rope.yaml", "./specs/../specs/rope.yaml")
    assert twice.exit_code == 0 and twice.output == "ok  specs/rope.yaml\n"
    folder_and_file = invoke("validate", "specs/rope.yaml", "specs")
    assert folder_and_file.exit_code == 0
    assert folder_and_file.output.count("ok  specs/rope.yaml") == 1
    assert len(folder_and_file.output.splitlines()) == len(list(SPECS.glob("*.yaml")))
    result = invoke("generate", "--check", "specs", "specs/rope.yaml")
    assert result.exit_code == 0, result.output
    assert len(load_specs([SPECS / "rope.yaml", Path("specs/rope.yaml").resolve()])) == 1


def test_two_different_files_with_one_name_still_collide(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    paths = [write(tmp_path / folder, "nope", NOPE) for folder in ("a", "b")]
    with pytest.raises(SpecError, match="duplicate spec name 'nope'"):
        load_specs(paths)


# --------------------------------------------------------------------------- item 23: claims


def test_missing_claims_say_what_to_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = spec_text("nope", "no_claims")
    text = text[: text.index("claims:")]
    first = refused_everywhere(write(Path("."), "no_claims", text), tmp_path)
    assert first == (
        "no_claims.yaml:2:1: claims: required: state unique, relative, decay, extrapolates "
        "(true/false), e.g. claims: {relative: true, decay: true}"
    )


def test_explain_states_a_partial_rotation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    quarter = "tests/specs/false_claims/false_decay_rope_quarter.yaml"
    output = invoke("explain", quarter).output
    assert "partial: rotates the leading 25% of each head (16 of 64 features" in output
    assert "partial" not in invoke("explain", "rope").output


# Models that rotate only part of each head (their configurations' rotary_pct / rotary_dim).
PARTIAL_ROTARY = {"GPT-NeoX": 0.25, "Pythia": 0.25, "GPT-J": 0.25, "Phi-2": 0.4}


def test_models_entries_are_true_of_their_spec_rotary_fraction() -> None:
    for path in SPECS.glob("*.yaml"):
        spec = load_spec(path).spec
        rotation = spec.rotation
        fraction = rotation.rotary_dims.fraction if rotation is not None else None
        for model in spec.models:
            for partial, share in PARTIAL_ROTARY.items():
                if model == partial or model.startswith(partial + " "):
                    assert fraction is not None and math.isclose(fraction, share), (
                        f"{path.name} lists {model}, which rotates {share:.0%} of each head"
                    )


@pytest.mark.parametrize(
    ("spec", "old", "new", "field"),
    [
        ("learned_absolute", "max_positions: 1024", "max_positions: 2097152", "max_positions"),
        ("tupe_a", "max_positions: 512", "max_positions: 2000000", "max_positions"),
        ("shaw", "max_distance: 16", "max_distance: 1048576", "relative.index"),
    ],
)
def test_a_trained_table_past_the_element_limit_is_refused(
    spec: str, old: str, new: str, field: str, tmp_path: Path
) -> None:
    """Rows and width are each bounded; their product is too (no multi-GB table)."""
    text = (SPECS / f"{spec}.yaml").read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / f"{spec}.yaml"
    path.write_text(text.replace(old, new), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert field in result.output and "2^27" in result.output
