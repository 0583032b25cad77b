"""The ``posgen`` command line.

Exit codes: 0 ok; 1 generated/ drifted from the specs (``check``: a claim or block fails);
2 invalid spec or usage error; 3 internal error (generated code failed its own gate).
Spec errors print ``path:line:col: field: message`` lines and never a traceback.
"""

from __future__ import annotations

import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from torch import Tensor

    from posgen.hf_families import Pairing

from posgen.catalogue import encoding_rows, model_rows
from posgen.check.deadline import GRACE_FACTOR, GRACE_SECONDS, MIN_SHARE_SECONDS
from posgen.cli_errors import file_error, reports_spec_errors
from posgen.cli_output import UsageError, say
from posgen.cli_paths import (
    DEFAULT_OUT,
    DEFAULT_SPECS,
    GivenPath,
    check_replaceable,
    find_spec,
    paths_or_names,
    spec_files,
    spec_path,
)
from posgen.cli_standalone import generate_standalone
from posgen.codegen.writing import (
    REGISTRY_FILE,
    NotOurs,
    OutputError,
    compare,
    is_generated,
    render_tree,
    unified_diff,
    write_atomically,
    write_tree,
)
from posgen.describe import explanation
from posgen.spec.diagnostics import SpecError
from posgen.spec.loader import LoadedSpec, load_specs
from posgen.spec.model import Spec


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="posgen")
def main() -> None:
    """posgen: positional encodings from declarative specs.

    \b
    Example:
        posgen generate --check      # is generated/ in sync with specs/?
        posgen list                  # the catalogue
    """


@main.command()
@click.argument("specs", nargs=-1, type=GivenPath())
@click.option(
    "--out",
    "out_dir",
    type=GivenPath(),
    default=DEFAULT_OUT,
    show_default=True,
    help="Directory of generated modules.",
)
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if OUT differs.")
@click.option("--diff", "show_diff", is_flag=True, help="Print the unified diff; write nothing.")
@click.option(
    "--standalone",
    metavar="NAME",
    default=None,
    help="Write spec NAME as one self-contained file (runtime inlined) to --out FILE.",
)
@reports_spec_errors
def generate(
    specs: tuple[Path, ...], out_dir: Path, check: bool, show_diff: bool, standalone: str | None
) -> None:
    """Render SPECS (spec files or folders; default ./specs) into modules in OUT.

    A full run (no SPECS, or only folders) writes every module, the runtime's
    modules (_attention.py, _masks.py, ...) and the registry __init__.py, and removes
    stale files that carry posgen's header. Naming spec files is a subset run: it
    writes those modules and the runtime only, never removes a file and leaves the
    registry as it is (run a full generate to refresh it); into a folder without a
    registry it writes one of those modules, so that the folder is a package (a full
    run, which writes what the specs folder holds, then removes modules of other
    specs). With no SPECS and no ./specs folder, it is a usage error (list, explain and
    check fall back to the built-in catalogue; generate does not write it into the
    current directory unasked). A spec named rather than given as a file (alibi, not
    specs/alibi.yaml), and --standalone NAME without SPECS, are looked up as explain
    looks them up: in ./specs, then in the catalogue.

    Only changed files are written, each in full to a temporary file and then renamed,
    the registry last; the modes are those ordinary file creation gives (the umask).
    A file without posgen's header is never overwritten or removed: if one is in the
    way, or a spec is invalid, nothing is written (exit 2).

    \b
    Example:
        posgen generate                      # specs/ -> generated/
        posgen generate --check              # CI: exit 1 on drift
        posgen generate specs/t5.yaml --out /tmp/gen --diff
        posgen generate --standalone t5 --out t5_attention.py
    """
    full = all(path.is_dir() for path in specs)
    if standalone is not None and not specs:  # looked up as explain looks it up
        named = [spec_path(standalone, DEFAULT_SPECS)]
        loaded = load_specs(named)
        standalone = loaded[0].spec.name
    else:
        loaded = load_specs(spec_files(paths_or_names(specs), catalogue=standalone is not None))
    try:
        if standalone is not None:
            generate_standalone(loaded, standalone, out_dir, check or show_diff, show_diff)
            return
        # a subset run into a folder without a registry writes one (of the modules it
        # writes), so that the folder is a package: a namespace folder loses to any
        # other ``generated`` package on sys.path (an editable install of posgen's own)
        registry = full or not (out_dir / REGISTRY_FILE).exists()
        tree = render_tree(loaded, with_registry=registry)
        if check or show_diff:
            _report_drift(out_dir, tree, full, show_diff, _generate_command(specs, out_dir))
        drift = write_tree(out_dir, tree, prune=full)
    except (OutputError, OSError) as error:
        file_error(error)
    for line in drift.lines():
        say(
            line.replace("changed:", "updated:")
            .replace("missing:", "created:")
            .replace("extra:  ", "removed:")
        )
    say(f"{out_dir}: {len(tree)} files, {len(drift.lines())} written or removed.")


def _generate_command(specs: tuple[Path, ...], out_dir: Path) -> str:
    """The ``posgen generate`` that brings ``out_dir`` up to date with ``specs``."""
    words = ["posgen", "generate", *(str(path) for path in specs)]
    if out_dir != DEFAULT_OUT:
        words += ["--out", str(out_dir)]
    return shlex.join(words)


def _report_drift(
    out_dir: Path, tree: dict[str, str], full: bool, show_diff: bool, command: str
) -> None:
    """``generate --check`` / ``--diff``: print the drift and exit (0 clean, 1 drifted).

    A file in the way that posgen did not write is no drift that ``posgen generate``
    would fix (it refuses to replace the file): that is an error, exit 2, as there.
    """
    drift = compare(out_dir, tree, prune=full)
    blocking = [name for name in drift.changed if not is_generated(out_dir / name)]
    if blocking:
        raise NotOurs(out_dir / blocking[0])
    if show_diff:
        say(unified_diff(out_dir, tree, drift), nl=False)
    if drift.clean:
        say(f"{out_dir}: {len(tree)} files up to date.")
        sys.exit(0)
    for line in drift.lines():
        say(line)
    say(f"{out_dir} is out of date: run `{command}`.", err=True)
    sys.exit(1)


@main.command()
@click.argument("specs", nargs=-1, required=True, type=GivenPath())
@reports_spec_errors
def validate(specs: tuple[Path, ...]) -> None:
    """Validate SPECS (files, directories, or names looked up as explain looks them up:
    in ./specs, then the catalogue) and report every error.

    \b
    Example:
        posgen validate specs/
        posgen validate my_idea.yaml
        posgen validate alibi
    """
    from posgen.spec.diagnostics import printable

    loaded = load_specs(spec_files(paths_or_names(specs)))
    for item in loaded:
        say(f"ok  {printable(item.display_path)}")


@main.command()
@click.argument("name")
@click.option(
    "--from",
    "source",
    default=None,
    metavar="EXISTING",
    help="Start from this spec (a spec name, or a path: ending in .yaml/.yml or holding a"
    " path separator) instead of the blank scaffold.",
)
@click.option(
    "--out",
    "out_file",
    type=GivenPath(),
    default=None,
    help="Where to write it (default: specs/NAME.yaml).",
)
@reports_spec_errors
def new(name: str, source: str | None, out_file: Path | None) -> None:
    """Write a new spec NAME: a commented scaffold, or a copy of an existing spec (its
    ``models`` list emptied: no model uses the new encoding yet).

    NAME must be a spec name (lower-case ASCII words of letters and digits joined by
    single underscores, starting with a letter, at most 64 characters, not a name that
    generated code or Python already uses). EXISTING is a file path when it ends in .yaml
    or .yml or holds a path separator, and otherwise a spec name (./specs, then the
    built-in catalogue). The text is validated first; an existing file is never
    overwritten. Where the spec's folder has no schema.json, the JSON Schema its first
    line names (``posgen schema``) is written there too, for editor completion.

    \b
    Example:
        posgen new my_bias
        posgen new alibi_half --from alibi
    """
    from posgen.scaffold import ScaffoldError, check_spec_name, write_scaffold

    try:
        check_spec_name(name)
    except ScaffoldError as error:
        raise UsageError(str(error)) from None
    out = out_file if out_file is not None else DEFAULT_SPECS / f"{name}.yaml"
    origin = Path(find_spec(source, DEFAULT_SPECS).path) if source is not None else None
    try:
        written = write_scaffold(name, out, origin)
    except (ScaffoldError, OSError) as error:
        raise UsageError(str(error)) from None
    say(f"wrote {written}: edit it, then `posgen validate {written}` and `posgen check {written}`")
    schema_file = written.parent / "schema.json"  # the file the spec's first line names
    if not schema_file.exists() and not schema_file.is_symlink():
        try:
            write_atomically(schema_file, _schema_text().encode("utf-8"))
        except OSError as error:
            raise UsageError(f"cannot write {schema_file}: {error}") from None
        say(f"wrote {schema_file}: the JSON Schema its first line names (editor completion)")


@main.command(name="from-hf")
@click.argument("config_file", type=GivenPath())
@click.option(
    "--name",
    default=None,
    help="Spec name (default: --out's file name, else MODEL_TYPE_positions).",
)
@click.option(
    "--out",
    "out_file",
    type=GivenPath(),
    default=None,
    help="Write the spec here, a NAME.yaml or NAME.yml file (validated; never over a "
    "file); default: print it.",
)
@click.option(
    "--layer",
    type=click.IntRange(min=0),
    default=None,
    help="The attention layer to describe, for models whose layers differ "
    "(Llama 4, SmolLM3, Gemma 3, Cohere 2).",
)
@click.option(
    "--pairing",
    type=click.Choice(["half", "interleaved"]),
    default=None,
    help="How a rotary model of a family from-hf does not know pairs its features.",
)
@reports_spec_errors
def from_hf(
    config_file: Path,
    name: str | None,
    out_file: Path | None,
    layer: int | None,
    pairing: Pairing | None,
) -> None:
    """Write the spec of the positional encoding a Hugging Face config.json describes.

    The spec is named --name, else after --out's file (a spec's name is its file's
    name), else MODEL_TYPE_positions.

    \b
    Example:
        posgen from-hf llama/config.json --out specs/my_llama.yaml
        posgen from-hf llama4/config.json --layer 3   # one of its NoPE layers
    """
    import json

    from posgen.codegen.render import catalogue_dir
    from posgen.from_hf import spec_from_config
    from posgen.hf_config import CONFIG_FILE, ConfigError
    from posgen.scaffold import ScaffoldError, validate_text, write_new_spec
    from posgen.spec.bounded_file import RefusedFile, read_bounded

    given = _from_hf_given_name(name, out_file)
    try:
        config = json.loads(read_bounded(config_file, CONFIG_FILE).decode("utf-8"))
    # ValueError: bad UTF-8, bad JSON, or an integer literal past Python's 4300 digits
    except (RefusedFile, ValueError, RecursionError) as error:
        raise UsageError(f"{config_file}: cannot read a JSON config: {error}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{config_file}: a config is a JSON object")
    try:
        name = given or _default_from_hf_name(config)
        text = spec_from_config(config, name, catalogue_dir(), layer=layer, pairing=pairing)
        validate_text(text, Path(f"{name}.yaml"))
    except (ConfigError, ScaffoldError) as error:
        raise UsageError(f"{config_file}: {error}") from None
    except SpecError as error:  # a value the spec language refuses: about the config
        raise UsageError(_from_hf_spec_error(config_file, error)) from None
    if out_file is None:
        say(text, nl=False)
        return
    try:
        write_new_spec(text, out_file)
    except ScaffoldError as error:  # a twin NAME.yml, or a file made since the check
        raise UsageError(f"--out {out_file}: {error}") from None
    except OSError as error:
        file_error(error, f"--out {out_file}")
    say(f"wrote {out_file}")


def _from_hf_given_name(name: str | None, out_file: Path | None) -> str | None:
    """The spec name the options give (``--name``, else ``--out``'s file name; None:
    neither, the config's default applies), checked with ``--out`` before the config is
    read: UsageError for a name that is no spec name, an ``--out`` that is no NAME.yaml
    or NAME.yml file of that name, or a file that exists."""
    import os

    from posgen.scaffold import ScaffoldError, check_spec_name
    from posgen.spec.loader import SPEC_SUFFIXES

    if out_file is not None and out_file.suffix not in SPEC_SUFFIXES:
        raise UsageError(
            f"--out {out_file}: a spec file is NAME.yaml or NAME.yml (its name is the "
            "spec's name), as in --out specs/my_llama.yaml"
        )
    if out_file is not None and name is not None and name != out_file.stem:
        raise UsageError(
            f"--out {out_file}: spec {name!r} goes in a file named {name}{out_file.suffix} "
            "(a spec's name is its file's name); leave --name out to name the spec after "
            "the file"
        )
    chosen = name if name is not None or out_file is None else out_file.stem
    try:
        if chosen is not None:
            check_spec_name(chosen)
    except ScaffoldError as error:
        if name is not None:
            raise UsageError(str(error)) from None
        raise UsageError(
            f"--out {out_file}: {error} (the spec is named after the file, and a spec's "
            "name is its file's name: name the file after a spec name, as in "
            "--out specs/my_llama.yaml)"
        ) from None
    if out_file is not None and os.path.lexists(out_file):
        raise UsageError(
            f"--out {out_file}: the file exists; posgen from-hf never overwrites a file"
        )
    return chosen


def _default_from_hf_name(config: dict[str, object]) -> str:
    """The config's MODEL_TYPE_positions, checked as a spec name (ScaffoldError)."""
    from posgen.from_hf import default_name
    from posgen.scaffold import ScaffoldError, check_spec_name

    chosen = default_name(config)
    try:
        check_spec_name(chosen)
    except ScaffoldError as error:
        hint = " (the default, from model_type: choose one with --name)"
        raise ScaffoldError(f"{error}{hint}") from None
    return chosen


def _from_hf_spec_error(config_file: Path, error: SpecError) -> str:
    """A generated spec's diagnostics as errors about ``config_file``: the spec was never
    a file, so each names the spec field a config value became, not a file position."""
    return "\n".join(
        f"{config_file}: a setting of this config gives a spec posgen refuses (the "
        f"spec's {diagnostic.field}): {diagnostic.message}"
        for diagnostic in error.diagnostics
    )


@main.command(name="list")
@click.option(
    "--specs",
    "spec_dir",
    type=GivenPath(),
    default=DEFAULT_SPECS,
    show_default=True,
    help="Directory of specs.",
)
@click.option("--models", "by_model", is_flag=True, help="List by model: which encoding each uses.")
@reports_spec_errors
def list_specs(spec_dir: Path, by_model: bool) -> None:
    """List every encoding: title, the four terms in short, the models that use it.

    \b
    Example:
        posgen list
        posgen list --models
    """
    from posgen.spec.diagnostics import printable

    specs = [item.spec for item in load_specs(spec_files([spec_dir]))]
    for line in model_rows(specs) if by_model else encoding_rows(specs):
        say(printable(line))


@main.command()
@click.argument("name_or_spec")
@click.option(
    "--specs",
    "spec_dir",
    type=GivenPath(),
    default=DEFAULT_SPECS,
    show_default=True,
    help="Directory to look NAME up in.",
)
@reports_spec_errors
def explain(name_or_spec: str, spec_dir: Path) -> None:
    """Explain one encoding: its four score terms in words, with the formula.

    NAME_OR_SPEC is a file path when it ends in .yaml or .yml or holds a path separator
    (./rope), and otherwise a spec name, looked up in --specs (by default ./specs, then
    the built-in catalogue), even where the working directory has a file of that name.

    \b
    Example:
        posgen explain t5
        posgen explain specs/rope.yaml
    """
    from posgen.spec.diagnostics import printable

    loaded = find_spec(name_or_spec, spec_dir)
    for line in explanation(loaded.spec):
        say(printable(line))


@main.command()
@click.option(
    "--out",
    "out_file",
    type=GivenPath(),
    default=None,
    help="Write to this file instead of stdout (never over a file posgen did not write).",
)
@reports_spec_errors
def schema(out_file: Path | None) -> None:
    """Print the JSON Schema of the spec format (for editor completion).

    With --out, the file is written whole or not at all (temporary file and rename); its
    folder must exist. An existing FILE is replaced only when it already holds a JSON
    Schema of posgen's spec format, as this command writes (a JSON object titled "Spec"
    whose properties include name, terms and claims); any other file, a symbolic link
    or a folder is refused (exit 2, nothing written).

    \b
    Example:
        posgen schema --out specs/schema.json
    """
    text = _schema_text()
    if out_file is None:
        say(text, nl=False)
        return
    if not out_file.parent.is_dir():
        file_error(OutputError(f"cannot write {out_file}: no folder {out_file.parent}"))
    try:
        check_replaceable(out_file, _is_spec_schema, "a JSON Schema of posgen's spec format")
        if out_file.exists() and out_file.read_bytes() == text.encode("utf-8"):
            return  # the same bytes: not rewritten, as generate leaves unchanged files
        write_atomically(out_file, text.encode("utf-8"))  # whole or not at all
    except OutputError as error:
        file_error(error)


def _schema_text() -> str:
    """The JSON Schema of the spec format, as ``posgen schema`` prints it."""
    return json.dumps(Spec.model_json_schema(), indent=2, sort_keys=True) + "\n"


_SCHEMA_TITLE = "Spec"  # the title of the schema `posgen schema` writes
_SCHEMA_PROPERTIES = ("name", "terms", "claims")  # properties every version of it has
_MAX_SCHEMA_BYTES = 16 << 20  # a larger file is not one `posgen schema` wrote


def _is_spec_schema(path: Path) -> bool:
    """Whether ``path`` holds a JSON Schema of posgen's spec format, as ``posgen schema``
    writes: a JSON object titled "Spec" whose properties include name, terms and claims."""
    try:
        with path.open("rb") as stream:
            data = stream.read(_MAX_SCHEMA_BYTES + 1)
        document = json.loads(data) if len(data) <= _MAX_SCHEMA_BYTES else None
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON, too deep
        return False
    if not isinstance(document, dict) or document.get("title") != _SCHEMA_TITLE:
        return False
    properties = document.get("properties")
    return isinstance(properties, dict) and all(key in properties for key in _SCHEMA_PROPERTIES)


# --------------------------------------------------------------------------- check and plot


class FiniteFloatRange(click.FloatRange):
    """A ``click.FloatRange`` that also refuses NaN, which every comparison lets through
    (a NaN time budget never runs out). Its bounds are finite, so inf is refused too."""

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        number: float = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number; a finite number is needed.", param, ctx)
        return number


def _property_names() -> tuple[str, ...]:
    # Kept in sync with posgen.check.runner.PROPERTIES (a test compares them); listed here so
    # that `--help` does not import torch.
    return (
        "unique",
        "relative",
        "decay",
        "extrapolates",
        "rotation_norm",
        "rotation_pairing",
        "buckets",
        "slopes",
        "backends",
        "bf16",
        "kv_cache",
    )


@main.command()
@click.argument("specs", nargs=-1, type=GivenPath())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document, no tables.")
@click.option(
    "--seed",
    type=click.IntRange(0, 2**32 - 1),  # torch takes seed + 1 < 2**64; keep it portable
    default=0,
    show_default=True,
    help="Seed of hypothesis and of the random weights and content.",
)
@click.option(
    "--max-examples",
    type=click.IntRange(1, 100_000),
    default=100,
    show_default=True,
    help="hypothesis examples per property.",
)
@click.option(
    "--span",
    type=click.IntRange(16, 1 << 16),
    default=512,
    show_default=True,
    help="Positions [0, SPAN) for unique/relative/decay (capped by a table's max_positions).",
)
@click.option(
    "--only",
    multiple=True,
    type=click.Choice(_property_names()),
    help="Check only this property (repeatable).",
)
@click.option(
    "--time-budget",
    "seconds",
    type=FiniteFloatRange(0.1, 3600),
    default=10.0,
    show_default=True,
    help="Seconds per property after which no new examples are drawn (only slow modules reach it).",
)
@click.option(
    "--spec-time-budget",
    "spec_seconds",
    type=FiniteFloatRange(1, 36000),
    default=45.0,
    show_default=True,
    help="Seconds per spec, shared by its properties: each gets what is left divided by the "
    f"properties left, but at least {MIN_SHARE_SECONDS:g} s, and is stopped "
    f"{GRACE_FACTOR:.0%} + {GRACE_SECONDS:g} s past its share.",
)
@click.option(
    "--weights",
    "weights_file",
    type=GivenPath(),
    default=None,
    help="A state_dict file (torch.save) to judge one spec's module at, as trained.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Also exit 1 when a property ran out of its time budget with no verdict, or a "
    "stated claim was tested only up to a reach short of a length the spec names.",
)
@reports_spec_errors
def check(
    specs: tuple[Path, ...],
    as_json: bool,
    seed: int,
    max_examples: int,
    span: int,
    only: tuple[str, ...],
    seconds: float,
    spec_seconds: float,
    weights_file: Path | None,
    strict: bool,
) -> None:
    """Property-test SPECS (files, directories or spec names; default specs/) against their claims.

    Builds each module in memory (nothing is written) and tests, with hypothesis, the
    claims unique, relative, decay and extrapolates, plus the invariants of every
    building block present (rotation, buckets, slopes, backends, bf16, KV cache).
    A stated claim is judged; a false one is shown with a shrunk counterexample. An
    unstated claim is measured and shown, not judged.

    Exit codes: 0 no claim refuted and no building block failed; 1 a claim is refuted or
    a building block fails (with --strict also: a property stopped by its time budget
    with no verdict, or a stated claim tested only in part); 2 invalid spec or usage.

    \b
    Example:
        posgen check specs/rope.yaml
        posgen check rope
        posgen check my_idea.yaml --max-examples 300 --seed 1
        posgen check specs/ --json > verdicts.json
        posgen check specs/t5.yaml --weights trained_t5_bias.pt
    """
    import os
    import tempfile

    loaded = load_specs(spec_files(paths_or_names(specs)))
    weights = _trained_weights(loaded, weights_file) if weights_file is not None else None
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        _check(
            loaded, as_json, seed, max_examples, span, only, seconds, spec_seconds, weights, strict
        )
        return
    # hypothesis caches what it learns in ./.hypothesis; keep the user's directory clean
    from hypothesis.configuration import set_hypothesis_home_dir

    with tempfile.TemporaryDirectory(prefix="posgen-check-") as scratch:
        set_hypothesis_home_dir(scratch)
        try:
            _check(
                loaded,
                as_json,
                seed,
                max_examples,
                span,
                only,
                seconds,
                spec_seconds,
                weights,
                strict,
            )
        finally:
            set_hypothesis_home_dir(None)


def _trained_weights(loaded: list[LoadedSpec], path: Path) -> dict[str, Tensor]:
    """``--weights``: the state_dict in ``path``, checked against the one spec's module."""
    from posgen.check.weights import WeightsError, check_fit, load_weights
    from posgen.codegen.inmemory import encoding_class, module_from_loaded

    if len(loaded) != 1:
        raise UsageError(f"--weights applies to one spec; {len(loaded)} were given")
    try:
        weights = load_weights(path)
        check_fit(encoding_class(module_from_loaded(loaded[0]))(), weights, path)
    except WeightsError as error:
        raise UsageError(str(error)) from None
    return weights


def _check(
    loaded: list[LoadedSpec],
    as_json: bool,
    seed: int,
    max_examples: int,
    span: int,
    only: tuple[str, ...],
    seconds: float,
    spec_seconds: float,
    weights: dict[str, Tensor] | None = None,
    strict: bool = False,
) -> None:
    import shutil
    import time

    from posgen.check.report import render_json, render_summary, render_table
    from posgen.check.runner import PROPERTIES, Budget, check_loaded

    budget = Budget(
        max_examples=max_examples, seed=seed, span=span, seconds=seconds, spec_seconds=spec_seconds
    )
    wanted = [name for name in PROPERTIES if not only or name in only]
    started = time.perf_counter()
    reports = []
    width = min(shutil.get_terminal_size((110, 24)).columns, 140)
    show_progress = sys.stderr.isatty()
    bar = (
        click.progressbar(
            length=len(loaded) * len(wanted), file=sys.stderr, label="checking", show_pos=True
        )
        if show_progress
        else None
    )
    try:
        for item in loaded:
            if bar is not None:
                bar.label = f"checking {item.spec.name}"
            report = check_loaded(
                item,
                budget,
                only=wanted,
                progress=(lambda _name: bar.update(1)) if bar else None,
                weights=weights,
            )
            reports.append(report)
            if not as_json:
                if bar is not None:
                    click.echo("\r\033[K", nl=False, err=True)
                for line in render_table(report, width):
                    say(line)
                say()
    finally:
        if bar is not None:
            bar.render_finish()
    seconds = time.perf_counter() - started
    if as_json:
        say(render_json(reports, budget, seconds))
    else:
        say(render_summary(reports, seconds))
    if not all(report.ok for report in reports):
        sys.exit(1)
    stopped = [
        f"{report.name}: {outcome.name}"
        for report in reports
        for outcome in report.outcomes
        if outcome.inconclusive
    ]
    limited = [
        f"{report.name}: {outcome.name} ({outcome.limited_to})"
        for report in reports
        for outcome in report.outcomes
        if outcome.limited and outcome.claimed is not None
    ]
    if strict and stopped:
        click.echo(
            f"--strict: {len(stopped)} propert{'y' if len(stopped) == 1 else 'ies'} "
            f"stopped by the time budget with no verdict ({', '.join(stopped)})",
            err=True,
        )
    if strict and limited:
        click.echo(
            f"--strict: {len(limited)} stated claim{'' if len(limited) == 1 else 's'} "
            f"tested only in part ({', '.join(limited)})",
            err=True,
        )
    if strict and (stopped or limited):
        sys.exit(1)


@main.command()
@click.argument("spec", type=GivenPath())
@click.option(
    "--out",
    "out_dir",
    type=GivenPath(),
    default=Path("plots"),
    show_default=True,
    help="Directory for the PNG files.",
)
@click.option(
    "--span",
    type=click.IntRange(4, 4096),
    default=64,
    show_default=True,
    help="Positions [0, SPAN) in the heatmap.",
)
@click.option(
    "--distance",
    type=click.IntRange(4, 1 << 16),
    default=512,
    show_default=True,
    help="Largest distance on the decay curve.",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**32 - 1),  # as check's --seed
    default=0,
    show_default=True,
    help="Seed of the random weights and content.",
)
@reports_spec_errors
def plot(spec: Path, out_dir: Path, span: int, distance: int, seed: int) -> None:
    """Draw SPEC's position-only score heatmap per head and its decay curve (PNG).

    Writes OUT/NAME_scores.png and OUT/NAME_decay.png, each whole or not at all
    (temporary file and rename). Each PNG carries posgen's mark (a "Software: posgen
    plot" text chunk); an existing file is replaced only when it has that mark: any
    other file, a symbolic link or a folder in the way is refused (exit 2, nothing
    written). Needs matplotlib (pip install 'posgen[plot]').

    \b
    Example:
        posgen plot specs/alibi.yaml --out plots/
        posgen plot my_idea.yaml --span 128
    """
    (spec,) = paths_or_names([spec])
    if spec.is_dir():  # plotting a folder's first spec would hide the rest
        raise UsageError(f"plot draws one spec: name one file, not the folder {spec}")
    (loaded,) = load_specs(spec_files([spec]))
    from posgen.check.plot import (
        CannotPlot,
        MissingMatplotlib,
        PlotFailed,
        is_posgen_png,
        plot_files,
        render_plots,
    )

    _check_plot_targets(out_dir, plot_files(loaded.spec.name), is_posgen_png)
    try:
        images = render_plots(loaded, span=span, decay_span=distance, seed=seed)
    except (MissingMatplotlib, CannotPlot) as error:
        say(str(error), err=True)
        sys.exit(2)
    except PlotFailed as error:  # the module raised: a message and exit 1
        say(str(error), err=True)
        sys.exit(1)
    _write_plots(out_dir, images)


def _check_plot_targets(
    out_dir: Path, file_names: tuple[str, ...], ours: Callable[[Path], bool]
) -> None:
    """Exit 2 with one line, before anything is drawn, unless ``out_dir`` can be a folder
    and each file in it is absent or a PNG that ``ours`` recognises as posgen's."""
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise OutputError(f"{out_dir} is a file, not a folder: --out needs a folder")
        for file_name in file_names:
            check_replaceable(
                out_dir / file_name,
                ours,
                "a PNG with posgen plot's mark (plots made before the mark have none: remove them)",
            )
    except OutputError as error:
        file_error(error)


def _write_plots(out_dir: Path, images: dict[str, bytes]) -> None:
    """Write each PNG into ``out_dir`` atomically (its targets were checked) and say so."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for file_name, data in images.items():
            write_atomically(out_dir / file_name, data)
            say(f"wrote {out_dir / file_name}")
    except (OSError, OutputError) as error:  # a read-only folder, ...: one line, exit 2
        file_error(error, f"cannot write plots into {out_dir}")
