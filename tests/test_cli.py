"""The CLI's read-only commands: list, explain, schema, and help texts."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from posgen.cli import main
from posgen.spec.model import Spec
from tests.conftest import ROOT, SPECS, generated_class, spec_names


@pytest.fixture()
def run(monkeypatch):
    monkeypatch.chdir(ROOT)
    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(main, list(args))
        assert result.exception is None or isinstance(result.exception, SystemExit), result.output
        return result

    return invoke


def test_list_shows_every_encoding_with_terms_and_models(run) -> None:
    result = run("list")
    assert result.exit_code == 0
    for name in spec_names():
        assert any(line.startswith(name + " ") for line in result.output.splitlines())
    t5_line = next(line for line in result.output.splitlines() if line.startswith("t5 "))
    assert t5_line.split()[1:5] == ["keep", "drop", "drop", "bias"]
    assert "used by: BLOOM, MPT" in result.output


def test_list_columns_line_up_whatever_the_longest_word(run) -> None:
    lines = run("list").output.splitlines()
    header, rows = lines[0], [line for line in lines[2:] if not line.startswith(" ")]
    starts = [header.index(f" {word} ") + 1 for word in ("cc", "cp", "pc", "pp", "values")]
    starts.append(header.index("title"))
    cope = next(row for row in rows if row.startswith("cope "))
    assert "contextual" in cope.split()  # the longest term word of the catalogue
    for row in rows:
        for start in starts:  # each cell starts at its column, after a space
            assert row[start - 1] == " " and row[start] != " ", (row, start)
    used_by = [line for line in lines[2:] if line.lstrip().startswith("used by:")]
    assert used_by and {len(line) - len(line.lstrip()) for line in used_by} == {starts[-1]}


def test_a_spec_looked_up_in_a_missing_folder_says_the_folder_is_missing(
    run, tmp_path: Path
) -> None:
    result = run("explain", "alibi", "--specs", str(tmp_path / "nowhere"))
    assert result.exit_code == 2
    assert f"--specs {tmp_path / 'nowhere'}: no such folder (to look up spec 'alibi')" in (
        result.output
    )


def test_list_by_model(run) -> None:
    result = run("list", "--models")
    assert result.exit_code == 0
    rows = {line.split("  ")[0].strip(): line for line in result.output.splitlines()}
    assert rows["BLOOM"].endswith("alibi")
    assert rows["GPT-2"].endswith("learned_absolute")


@pytest.mark.parametrize("name", spec_names())
def test_explain_renders_the_decomposition(run, name: str) -> None:
    result = run("explain", name)
    assert result.exit_code == 0
    for term in ("content_content", "content_position", "position_content", "position_position"):
        assert term in result.output
    assert "scale:" in result.output and "references:" in result.output
    assert run("explain", f"specs/{name}.yaml").output == result.output


@pytest.mark.parametrize("argument", ["./nosuch", "nosuch/", "./missing.yaml"])
def test_explain_names_a_missing_file_as_given(run, tmp_path, monkeypatch, argument) -> None:
    """A path argument that is not there is a usage error naming it as typed: pathlib
    printed ``./nosuch`` as ``nosuch``, in a loader error that read as a spec error."""
    monkeypatch.chdir(tmp_path)
    result = run("explain", argument)
    assert result.exit_code == 2
    assert f"no such spec file: {argument}" in result.output, result.output


def test_explain_t5_in_words(run) -> None:
    output = run("explain", "t5").output
    assert "table[bucket(j - i), h], t5 log buckets: 32 bidirectional, max_distance 128" in output
    assert "scale: none" in output


def test_explain_says_where_a_bias_meets_the_scale(run, tmp_path) -> None:
    """A bias inside the 1/sqrt(d) scale and one after it give logits sqrt(d) apart in the
    bias; explain (and the docstring, which quotes it) said the same words for both."""
    after = run("explain", "alibi").output
    assert "-slope_h * |i - j|, slopes: alibi_geometric (after the scale)" in after
    text = (SPECS / "alibi.yaml").read_text(encoding="utf-8")
    inside = text.replace("name: alibi\n", "name: alibi_inside\n")
    inside = inside.replace("placement: after_scale", "placement: before_scale")
    assert inside.count("before_scale") == 1
    path = tmp_path / "alibi_inside.yaml"
    path.write_text(inside, encoding="utf-8")
    output = run("explain", str(path)).output
    assert "-slope_h * |i - j|, slopes: alibi_geometric (inside the scale)" in output


def test_explain_states_a_query_scale(run) -> None:
    """Llama 4's temperature tuning and log-length scaling in words, with where tau is 1;
    an encoding without a query scale prints no such line."""
    llama4 = run("explain", "nope_llama4").output
    assert (
        "queries: q_i * tau(i) before any term reads it, tau(i) = 1 + 0.1 ln(1 + floor((i + "
        "1) / 8192)) (1 below position 8191)"
    ) in llama4
    logn = run("explain", "rope_logn").output
    assert "tau(i) = max(1, ln(i + 1) / ln(8192)) (1 up to position 8191)" in logn
    assert "queries:" not in run("explain", "rope").output


def test_explain_axial_rope_states_each_axis_share_of_the_pairs(run) -> None:
    """Axial RoPE turns d_rot / 4 pairs per axis over theta_k = base^(-2k/(d_rot/2)),
    k < d_rot/4 (RoPE-ViT's recipe, as the module computes it), not base^(-2k/d_rot)."""
    output = " ".join(run("explain", "rope_axial_2d").output.split())
    assert "theta_k = 100^(-2k/(d_rot/2))" in output
    assert (
        "axial over 2 position axes (positions [2, ..., N]): the pairs in 2 equal shares, "
        "share a (theta_k, k < d_rot/4) turning with axis a" in output
    )


def test_only_bert_layout_tables_claim_berts_checkpoint() -> None:
    """The docstring says Hugging Face BERT's distance_embedding copies in only where the
    table is read as BERT reads it (i - j, clipped, no value term): not Shaw's, whose
    [33, head_dim] table is read at j - i."""
    claim = "BertSelfAttention.distance_embedding.weight`` copies in directly"
    claiming = {
        name
        for name in spec_names()
        if claim in (ROOT / "generated" / f"{name}.py").read_text(encoding="utf-8")
    }
    assert claiming == {"bert_relative_key", "bert_relative_key_query"}


@pytest.mark.parametrize("command", ["generate", "validate", "list", "explain", "schema"])
def test_every_command_help_has_an_example(run, command: str) -> None:
    result = run(command, "--help")
    assert result.exit_code == 0
    assert "Example:" in result.output and f"posgen {command}" in result.output


def test_schema_is_the_spec_models_json_schema(run, tmp_path) -> None:
    result = run("schema")
    assert json.loads(result.output) == Spec.model_json_schema()
    committed = json.loads((ROOT / "specs" / "schema.json").read_text())
    assert committed == Spec.model_json_schema(), "run `posgen schema --out specs/schema.json`"


def test_paths_with_terminal_controls_are_escaped_in_every_command(tmp_path) -> None:
    """A folder name holding an OSC sequence and a bidi override is shown escaped."""
    import shutil

    from tests.conftest import SPECS

    hostile = tmp_path / "out\x1b]0;pwned\x07\u202edir"
    specs = tmp_path / "specs\x1b[31m"
    specs.mkdir()
    shutil.copy(SPECS / "alibi.yaml", specs / "alibi.yaml")
    runner = CliRunner()
    calls = [
        ["generate", str(specs), "--out", str(hostile)],
        ["generate", str(specs), "--out", str(hostile), "--check"],
        ["generate", str(specs), "--standalone", "alibi", "--out", str(hostile / "a.py")],
        ["validate", str(specs / "alibi.yaml")],
        ["explain", str(specs / "alibi.yaml")],
        ["list", "--specs", str(specs)],
        ["generate", str(specs / "missing.yaml")],
    ]
    for args in calls:
        result = runner.invoke(main, args)
        shown = result.output + (result.stderr if result.stderr_bytes else "")
        assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown, args
        assert "Traceback" not in shown, args


# --------------------------------------------------------------------------- others' files


def _precious(tmp_path):
    """A file outside the output folder that a link in it points to."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    return precious


def test_plot_refuses_a_link_or_a_file_it_did_not_write(run, tmp_path) -> None:
    """Checked before anything is drawn: no matplotlib is needed to refuse."""
    precious = _precious(tmp_path)
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "alibi_scores.png").symlink_to(precious)
    (plots / "alibi_decay.png").write_text("mine\n")
    result = run("plot", "specs/alibi.yaml", "--out", str(plots))
    assert result.exit_code == 2
    assert "alibi_scores.png is a symbolic link" in result.stderr
    (plots / "alibi_scores.png").unlink()
    result = run("plot", "specs/alibi.yaml", "--out", str(plots))
    assert result.exit_code == 2
    assert "alibi_decay.png exists and is not a PNG with posgen plot's mark" in result.stderr
    assert precious.read_text() == "keep me\n"
    assert sorted(p.name for p in plots.iterdir()) == ["alibi_decay.png"]
    assert (plots / "alibi_decay.png").read_text() == "mine\n"


def test_plot_marks_its_pngs_and_replaces_only_those_atomically(run, tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from posgen.check.plot import is_posgen_png
    from posgen.codegen import writing

    renamed: list[str] = []
    real_replace = writing.os.replace

    def record(source, target) -> None:
        renamed.append(Path(target).name)
        real_replace(source, target)

    monkeypatch.setattr(writing.os, "replace", record)
    plots = tmp_path / "plots"
    args = ("plot", "specs/alibi.yaml", "--out", str(plots), "--span", "8", "--distance", "8")
    for _ in range(2):  # the second run replaces the PNGs the first wrote
        result = run(*args)
        assert result.exit_code == 0, result.output
    assert renamed == ["alibi_scores.png", "alibi_decay.png"] * 2
    files = sorted(plots.iterdir())  # no temporary file left behind
    assert [p.name for p in files] == ["alibi_decay.png", "alibi_scores.png"]
    assert all(is_posgen_png(p) for p in files)
    unmarked = files[0].read_bytes().replace(b"posgen plot", b"someone's!!")
    files[0].write_bytes(unmarked)  # a PNG, but not posgen's
    result = run(*args)
    assert result.exit_code == 2 and "not a PNG with posgen plot's mark" in result.stderr
    assert files[0].read_bytes() == unmarked


def test_schema_replaces_only_a_spec_schema(run, tmp_path) -> None:
    precious = _precious(tmp_path)
    link = tmp_path / "link.json"
    link.symlink_to(precious)
    theirs = tmp_path / "theirs.json"
    theirs.write_text('{"title": "Theirs"}\n')
    deep = tmp_path / "deep.json"  # past json's recursion limit: a RecursionError before
    deep.write_text("[" * 200_000)
    cases = ((link, "is a symbolic link"), (theirs, "exists and is not"), (deep, "is not"))
    for target, problem in cases:
        result = run("schema", "--out", str(target))
        assert result.exit_code == 2 and problem in result.stderr, result.output
        assert len(result.stderr.splitlines()) == 1
    assert precious.read_text() == "keep me\n"
    assert theirs.read_text() == '{"title": "Theirs"}\n'
    # an older schema of the spec format (here, one without a field) is posgen's
    older = json.loads((ROOT / "specs" / "schema.json").read_text())
    del older["properties"]["values"]
    ours = tmp_path / "schema.json"
    ours.write_text(json.dumps(older))
    assert run("schema", "--out", str(ours)).exit_code == 0
    assert ours.read_text() == run("schema").stdout
    # up to date: not written again (its inode and time stay)
    os.utime(ours, (1_000_000_000, 1_000_000_000))
    before = ours.stat()
    assert run("schema", "--out", str(ours)).exit_code == 0
    after = ours.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_schema_help_says_what_it_replaces(run) -> None:
    shown = " ".join(run("schema", "--help").output.split())
    assert "replaced as a whole" not in shown
    assert "replaced only when it already holds a JSON Schema of posgen's spec format" in shown


@pytest.mark.parametrize(
    ("file_name", "says"),
    [
        ("torch.py", "would shadow the standard-library module of that name, or the one"),
        ("json.py", "would shadow the standard-library module of that name, or the one"),
        ("t5-attention.py", "is not a name Python can import"),
        ("class.py", "is not a name Python can import"),
        # modules torch and posgen import: beside the user's code the file would be
        # imported in their place (torch itself then fails to import)
        ("typing_extensions.py", "the one torch or posgen imports"),
        ("yaml.py", "the one torch or posgen imports"),
        ("pydantic.py", "the one torch or posgen imports"),
        # any other installed module: shadowing it may break the user's own imports
        ("pytest.py", "a module named 'pytest' is installed"),
        ("matplotlib.py", "a module named 'matplotlib' is installed"),
    ],
)
def test_standalone_refuses_a_file_that_cannot_be_imported_as_itself(
    run, tmp_path, file_name: str, says: str
) -> None:
    """The standalone file is imported by its name: one that would shadow a module or
    that ``import`` cannot name is a usage error (exit 2), and nothing is written."""
    out = tmp_path / file_name
    result = run("generate", "--standalone", "alibi", "--out", str(out))
    assert result.exit_code == 2
    assert says in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_standalone_into_another_folder_beside_the_users_own_copy(
    run, tmp_path, monkeypatch
) -> None:
    """The user's own files are no installed module: a copy of the same name in the
    working directory does not block writing another into a subfolder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m posgen` puts the cwd first
    assert run("generate", "--standalone", "alibi", "--out", "alibi_attention.py").exit_code == 0
    (tmp_path / "vendor").mkdir()
    result = run("generate", "--standalone", "alibi", "--out", "vendor/alibi_attention.py")
    assert result.exit_code == 0, result.output


def test_standalone_diff_prints_the_unified_diff(run, tmp_path) -> None:
    out = tmp_path / "alibi_attention.py"
    assert run("generate", "--standalone", "alibi", "--out", str(out)).exit_code == 0
    text = out.read_text()
    out.write_text(text.replace("import math\n", "import  math\n", 1))
    result = run("generate", "--standalone", "alibi", "--out", str(out), "--diff")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert (
        f"--- a/{tmp_path.name}/{out.name}" in lines
        and f"+++ b/{tmp_path.name}/{out.name}" in lines
    )
    assert "-import  math" in lines and "+import math" in lines
    assert lines[-1] == f"{out}: out of date."
    out.write_text(text)
    clean = run("generate", "--standalone", "alibi", "--out", str(out), "--diff")
    assert clean.exit_code == 0 and clean.stdout == f"{out}: up to date.\n"


def test_a_reader_that_stops_early_ends_the_diff_quietly(tmp_path: Path) -> None:
    """``posgen generate --diff | head``: the closed pipe ends the run with exit 1 and
    nothing on stderr (it printed "Error: Broken pipe" and exited 2)."""
    command = [sys.executable, "-m", "posgen", "generate", "--diff", "--out", str(tmp_path)]
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().startswith(b"--- a/")
        process.stdout.close()  # the reader stops; the diff is megabytes, past any buffer
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=120) == 1
    assert stderr == ""


def test_explain_states_the_value_term_index_and_the_backend_auto_takes(run) -> None:
    """Shaw's value term reads R^V at the key term's clipped index, and auto takes sdpa on
    the CPU (``_auto_backend``), not eager as the line once said."""
    output = " ".join(run("explain", "shaw").output.split())
    assert "R^V[clip(j - i, -16, 16)]" in output and "index(" not in output
    docstring = " ".join((importlib.import_module("generated.shaw").__doc__ or "").split())
    assert "backend auto takes sdpa on the CPU" in docstring
    shaw = generated_class("shaw")(heads=2, head_dim=8)
    q = torch.randn(1, 2, 3, 8)
    assert shaw._auto_backend(q) == "sdpa"


def test_a_gain_table_does_not_claim_an_additive_checkpoint() -> None:
    """A table that multiplies x is a gain: copying GPT-2's additive wpe into it would
    scale the tokens by ~0.02, so its docstring names no such checkpoint."""
    gain = importlib.import_module("generated.multiplicative_learned").__doc__ or ""
    added = importlib.import_module("generated.learned_absolute").__doc__ or ""
    assert "copy GPT-2" in added and "copy GPT-2" not in gain and "a gain per position" in gain


def test_validate_takes_spec_names_as_the_other_commands_do(run) -> None:
    """``validate alibi`` looks the name up as check and explain do (it said "no such
    spec file"); a name that is no spec is a usage error naming it."""
    result = run("validate", "alibi", "specs/rope.yaml")
    assert result.exit_code == 0, result.output
    assert "ok  specs/alibi.yaml" in result.output and "ok  specs/rope.yaml" in result.output
    missing = run("validate", "no_such_encoding")
    assert missing.exit_code == 2 and "no spec named 'no_such_encoding'" in missing.output


def test_explain_says_how_each_expression_parameter_is_read(run) -> None:
    """A positive parameter is read through softplus and a bounded one clamped: the
    formula alone (-r1[h] * ...) hid both."""
    output = " ".join(run("explain", "tests/specs/expr/kerple_log_expr.yaml").output.split())
    assert (
        "trained parameters: r1 (softplus of the stored value), r2 (softplus of the stored "
        "value, clamped to [0.01, 10])" in output
    )
