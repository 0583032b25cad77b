"""``posgen new``: a commented spec to start from, or a copy of an existing one.

The blank scaffold is the NoPE baseline with every section written out and a comment on
each field, so that a new idea starts from a spec that validates; ``--from`` copies an
existing spec (catalogue or path) under the new name. NAME is checked first, by the spec
model's own rule for ``name`` (``check_spec_name``), so that it is never read as YAML or
as a pattern; then the whole text is validated before it is written, and posgen never
overwrites a file.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import yaml

from posgen.spec.diagnostics import SpecError, quoted
from posgen.spec.loader import SPEC_SUFFIXES, load_spec
from posgen.spec.model import spec_name_problem

COMMENT_COLUMN = 34
"""Where the scaffold's field comments start (0-based)."""

SCAFFOLD = """\
# yaml-language-server: $schema=schema.json
# A new positional encoding. Every field is described in docs/reference.md; run
# `posgen validate` after each change and `posgen check` to test the claims below.
{name_line}# module name (= file name), lower_case words
title: {title}
references:                       # the paper(s): author, year, title, arXiv id
  - "Author et al. YEAR, Title, arXiv:XXXX.XXXXX"
models: []                        # models that use this encoding *exactly* as written
defaults: {{heads: 8, head_dim: 64}}  # constructor defaults (add model_dim for input tables)
scale: inv_sqrt_head_dim          # or: none, or {{kind: inv_sqrt_head_dim, factor: 2}}
terms:
  content_content: keep           # keep | {{rotate: {{base, pairing, rotary_dims, frequencies,
                                  #   position_scale, axes}}}}; frequencies: standard, linear,
                                  #   ntk, dynamic_ntk, yarn, llama3, longrope or expr
  content_position: drop          # drop | absolute | {{relative: ...}} | {{contextual: cope}}
  position_content: drop          # drop | absolute | {{relative: ...}} | {{global: ...}}
  position_position: drop         # drop | absolute | {{bias}} | {{untied}} | {{global}};
                                  #   bias kinds: linear_slopes, learned_table, kerple,
                                  #   fire, sandwich, expr ("-r1[h] * log1p(abs(i - j))")
values: plain                     # plain | {{relative: ...}} (Shaw et al.'s value term)
# what you believe; `posgen check` judges each stated claim (leave one out to measure it)
claims: {{relative: true}}
"""


class ScaffoldError(ValueError):
    """A scaffold that cannot be written (NAME is no spec name, the target exists, or the
    source is unknown)."""


def check_spec_name(name: str) -> None:
    """Raise ScaffoldError naming ``name`` unless it is a valid spec ``name``
    (``spec_name_problem``: the field's own rule, and no Python keyword or builtin)."""
    problem = spec_name_problem(name)
    if problem is not None:
        raise ScaffoldError(f"invalid NAME {quoted(name)}: {problem}")


def scaffold_text(name: str, source: Path | None) -> str:
    """The text of a new spec called ``name``: the commented scaffold, or ``source`` renamed."""
    if source is None:
        title = json.dumps(f"{name}: a new positional encoding")  # a quoted YAML scalar
        # the comment in the column of the others, or one space past a long name
        name_line = f"name: {name} ".ljust(COMMENT_COLUMN)
        return SCAFFOLD.format(name_line=name_line, title=title)
    text = source.read_text(encoding="utf-8")
    load_spec(source)  # a valid spec, so its text is one YAML mapping with a name
    models = _top_level_spans(text, "models")
    if models is not None:  # the copy is a new encoding: no model uses it yet
        key_end, _, value_end = models
        text = text[:key_end] + ": []" + text[value_end:]
    spans = _top_level_spans(text, "name")
    assert spans is not None, "a valid spec has a name"
    _, start, end = spans
    return text[:start] + name + text[end:]  # a spec name is a plain YAML scalar


def _top_level_spans(text: str, key: str) -> tuple[int, int, int] | None:
    """Character offsets in a spec's text of the top-level ``key``: where the key ends,
    where its value starts and where the value ends, in whatever style they are written
    (plain, quoted, a flow or block collection; a block list ends at its last item, not
    at the comments after it); None where the spec has no ``key``."""
    document = yaml.compose(text, Loader=yaml.SafeLoader)
    assert isinstance(document, yaml.MappingNode)
    for key_node, value in document.value:
        if key_node.value == key:
            end = value.end_mark.index
            if isinstance(value, yaml.SequenceNode) and not value.flow_style and value.value:
                end = value.value[-1].end_mark.index
            return key_node.end_mark.index, value.start_mark.index, end
    return None


def write_scaffold(name: str, out: Path, source: Path | None) -> Path:
    """Validate the new spec's text, then create ``out`` with it (never over a file).
    Raises ScaffoldError first where ``out`` is no file name for the spec ``name``."""
    if out.stem != name or out.suffix not in SPEC_SUFFIXES:
        raise ScaffoldError(
            f"--out {out}: spec {name!r} goes in a file named {name}.yaml or {name}.yml "
            "(a spec's name is its file's name)"
        )
    return write_new_spec(scaffold_text(name, source), out)


def validate_text(text: str, out: Path) -> None:
    """Raise SpecError, with diagnostics pointing at ``out``, unless ``text`` validates."""
    with tempfile.TemporaryDirectory(prefix="posgen-new-") as folder:
        trial = Path(folder) / out.name
        trial.write_text(text, encoding="utf-8")
        try:
            load_spec(trial)  # the name must match the file name, like any spec
        except SpecError as error:  # point the diagnostics at the file the user named
            shown = [dataclasses.replace(d, path=str(out)) for d in error.diagnostics]
            raise SpecError(shown) from None


def write_new_spec(text: str, out: Path) -> Path:
    """Validate ``text`` as the spec file ``out``, then create ``out`` (never over a file).

    Raises SpecError (nothing written) when the text does not validate, ScaffoldError
    when ``out`` exists or its folder holds the same spec name with the other suffix
    (``foo.yml`` beside a new ``foo.yaml``: two specs of one name).
    """
    validate_text(text, out)
    for twin in (out.with_suffix(suffix) for suffix in SPEC_SUFFIXES if suffix != out.suffix):
        if twin.exists():
            raise ScaffoldError(
                f"{twin} already holds spec {out.stem!r}: two files of one spec name would collide"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with out.open("x", encoding="utf-8") as stream:  # exclusive: never overwrites
            stream.write(text)
    except FileExistsError:
        raise ScaffoldError(f"{out} exists; posgen new never overwrites a file") from None
    return out
