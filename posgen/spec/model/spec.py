"""The spec itself: its scale, its four terms and value term, defaults, claims and the
checks across fields.
"""

from __future__ import annotations

import builtins
import keyword
import re
import sys
from typing import Annotated, Literal

from pydantic import Field, Tag, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from posgen.spec.diagnostics import quoted
from posgen.spec.model.base import (
    MAX_TABLE_ELEMENTS,
    MAX_TABLE_ROWS,
    KeywordModel,
    SpecModel,
    cross_field_error,
    tagged,
)
from posgen.spec.model.biases import (
    AnyBias,
    BiasTerm,
    ExprBias,
    FireBias,
    LinearSlopeBias,
    UntiedPositions,
    UntiedTerm,
)
from posgen.spec.model.inputs import HierarchicalTable, InputForm, LearnedTable
from posgen.spec.model.query_scale import QueryScale
from posgen.spec.model.relative import (
    ContextualPositions,
    ContextualTerm,
    DistanceIndex,
    GlobalContentTerm,
    GlobalPositionSpec,
    GlobalPositionTerm,
    LearnedRelativeTable,
    RelativeSection,
    RelativeTerm,
    RelativeTermSpec,
    RelativeValues,
    SinusoidalRelativeTable,
)
from posgen.spec.model.rotations import RotateTerm, Rotation, rotation_problem
from posgen.spec.model.text import Text
from posgen.spec.names import reserved_name_problem

MODULE_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")  # fullmatch
# Standard-library modules that some supported Python (3.10 to 3.14) has and this one
# may not: added (tomllib in 3.11; annotationlib and compression in 3.14) or removed
# (PEP 594's in 3.12 and 3.13, and lib2to3), so that a spec name is valid or not on
# every version alike.
STDLIB_ON_OTHER_VERSIONS = frozenset(
    {
        "tomllib",
        "annotationlib",
        "compression",
        "distutils",
        "imp",
        "asynchat",
        "asyncore",
        "smtpd",
        "aifc",
        "audioop",
        "cgi",
        "cgitb",
        "chunk",
        "crypt",
        "imghdr",
        "lib2to3",
        "mailcap",
        "msilib",
        "nis",
        "nntplib",
        "ossaudiodev",
        "pipes",
        "sndhdr",
        "spwd",
        "sunau",
        "telnetlib",
        "uu",
        "xdrlib",
    }
)
# The top-level modules that ``import torch`` and ``import posgen`` load from their
# required dependencies (torch's: filelock, typing_extensions, setuptools, sympy with
# mpmath, networkx, jinja2 with markupsafe, fsspec; posgen's: pydantic and its parts, yaml,
# click, hypothesis with sortedcontainers), and the optional ones torch imports when they
# are installed (numpy, optree, opt_einsum, the CUDA wheels under ``nvidia``). A fixed list,
# not the environment's: whether a spec is valid must not depend on what is installed.
DEPENDENCY_MODULE_NAMES = frozenset(
    {
        "filelock",
        "typing_extensions",
        "setuptools",
        "pkg_resources",
        "_distutils_hack",
        "sympy",
        "mpmath",
        "networkx",
        "jinja2",
        "markupsafe",
        "fsspec",
        "numpy",
        "optree",
        "opt_einsum",
        "nvidia",
        "pydantic",
        "pydantic_core",
        "annotated_types",
        "typing_inspection",
        "yaml",
        "click",
        "hypothesis",
        "sortedcontainers",
        "exceptiongroup",
    }
)
# Names a generated module must not take: copied beside other code, or run with its folder
# as the working directory, it would shadow them (the standard library of any supported
# Python, every package the runtime imports: torch, and triton for the CUDA kernels, and
# the packages those import). ``__main__`` is always the running script, so a module of
# that name cannot be imported.
RESERVED_MODULE_NAMES = (
    frozenset(sys.stdlib_module_names)
    | STDLIB_ON_OTHER_VERSIONS
    | DEPENDENCY_MODULE_NAMES
    | {"torch", "triton", "posgen", "generated", "__main__"}
)


def spec_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a spec, or None: the ``name`` field's own rule
    (``Spec.name``: its length, pattern and reserved names), then the model's check
    across fields that it is no Python keyword or builtin (``python_name_problem``)."""
    try:
        Spec.model_validate({"name": name})
    except ValidationError as error:
        problems = [item["msg"] for item in error.errors() if item["loc"] == ("name",)]
        if problems:
            return str(problems[0])
    return python_name_problem(name)


def python_name_problem(name: str) -> str | None:
    """Why ``name``, a generated module's name, would shadow Python (a keyword or a
    builtin name), or None."""
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        return f"{name!r} is a Python keyword"
    if hasattr(builtins, name):
        return f"{name!r} is a Python builtin name"
    return None


class Scale(KeywordModel):
    """Logit scale: ``none`` (T5) or 1/sqrt(factor · head_dim) (Vaswani et al. 2017)."""

    kind: Literal["none", "inv_sqrt_head_dim"]
    factor: float = Field(
        1.0,
        ge=1e-3,
        le=1e3,
        description="the scale is 1/sqrt(factor * head_dim), factor in [0.001, 1000] "
        "(DeBERTa 3, TUPE 2): 1e-308 makes the logits overflow to NaN, 1e308 makes the scale "
        "0 so that attention ignores the content",
    )

    @model_validator(mode="after")
    def _factor_needs_a_scale(self) -> Scale:
        if self.kind == "none" and "factor" in self.model_fields_set:
            raise cross_field_error(
                "factor",
                "scale 'none' leaves the logits unscaled, so a factor has no effect: remove "
                "it or use kind 'inv_sqrt_head_dim'",
            )
        return self


ContentContent = Annotated[
    Annotated[Literal["keep"], Tag("keep")] | Annotated[RotateTerm, Tag("rotate")],
    tagged("keep", "rotate", what="content_content"),
]
ContentPosition = Annotated[
    Annotated[Literal["drop"], Tag("drop")]
    | Annotated[Literal["absolute"], Tag("absolute")]
    | Annotated[RelativeTerm, Tag("relative")]
    | Annotated[ContextualTerm, Tag("contextual")],
    tagged("drop", "absolute", "relative", "contextual", what="content_position"),
]
PositionContent = Annotated[
    Annotated[Literal["drop"], Tag("drop")]
    | Annotated[Literal["absolute"], Tag("absolute")]
    | Annotated[RelativeTerm, Tag("relative")]
    | Annotated[GlobalContentTerm, Tag("global")],
    tagged("drop", "absolute", "relative", "global", what="position_content"),
]
PositionPosition = Annotated[
    Annotated[Literal["drop"], Tag("drop")]
    | Annotated[Literal["absolute"], Tag("absolute")]
    | Annotated[BiasTerm, Tag("bias")]
    | Annotated[UntiedTerm, Tag("untied_term")]
    | Annotated[GlobalPositionTerm, Tag("global")],
    tagged(
        "drop",
        "absolute",
        "bias",
        "global",
        what="position_position",
        leading=("untied", "untied_term"),
    ),
]
Values = Annotated[
    Annotated[Literal["plain"], Tag("plain")] | Annotated[RelativeValues, Tag("relative")],
    tagged("plain", "relative", what="values"),
]


class Terms(SpecModel):
    """The four query-key terms of the decomposition, each stated explicitly."""

    content_content: ContentContent
    content_position: ContentPosition
    position_content: PositionContent
    position_position: PositionPosition


class Defaults(SpecModel):
    """Constructor defaults of the generated module (all overridable by the caller)."""

    heads: int = Field(
        ge=1, le=1024, description="attention heads, 1 to 1024 (published models: up to 128)"
    )
    head_dim: int = Field(
        ge=1, le=1024, description="features per head, 1 to 1024 (published models: up to 256)"
    )
    model_dim: int | None = Field(
        None,
        ge=1,
        le=1 << 16,
        description="model width, 1 to 65,536 (published models: up to about 25,600); "
        "tables hold rows x model_dim floats",
    )


class RandomizedPositions(SpecModel):
    """Randomized positional encodings (Ruoss et al. 2023, "Randomized Positional
    Encodings Boost Length Generalization of Transformers", arXiv:2305.16843).

    In training, a sequence of length M gets the positions of a sorted random subset of
    size M of 0 .. max_positions − 1 (drawn afresh each call, from the module's
    ``position_generator`` when it is set), so the model sees the position values of
    long sequences on short ones; in evaluation it gets the plain range 0 .. M − 1.
    """

    kind: Literal["randomized"]
    max_positions: int = Field(
        ge=2,
        le=MAX_TABLE_ROWS,
        description=f"the range positions are drawn from in training, 2 to {MAX_TABLE_ROWS:,}: "
        "longer than any training sequence, as long as the lengths to generalise to",
    )


class Claims(SpecModel):
    """What the encoding claims; ``posgen check`` tests stated claims, measures the rest."""

    unique: bool | None = None
    relative: bool | None = None
    decay: bool | None = None
    extrapolates: bool | None = None


class Spec(SpecModel):
    """One positional encoding: its metadata and its row of the decomposition table."""

    # the pattern shows the schema's readers MODULE_NAME, which _module_name checks (with
    # its own message; a Field pattern would replace it with pydantic's)
    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=64,
            json_schema_extra={"pattern": f"^{MODULE_NAME.pattern}$"},
        ),
    ]
    title: Text
    references: list[Text] = Field(
        min_length=1, max_length=32, description="1 to 32 references, one line each"
    )
    models: list[Text] = Field(
        default_factory=list,
        max_length=64,
        description="up to 64 models that use exactly this encoding, one line each",
    )
    defaults: Defaults
    scale: Scale
    query_scale: QueryScale | None = None
    input: InputForm | None = None
    relative: RelativeSection | None = None
    terms: Terms
    values: Values = "plain"
    positions: RandomizedPositions | None = None
    claims: Claims

    @field_validator("name")
    @classmethod
    def _module_name(cls, name: str) -> str:
        if not MODULE_NAME.fullmatch(name):
            raise PydanticCustomError(
                "module_name",
                "got {shown}; a spec name is lower-case ASCII words (letters and digits) "
                "joined by single underscores, starting with a letter, e.g. 'rope_yarn'",
                {"shown": quoted(name)},
            )
        if name in RESERVED_MODULE_NAMES:
            raise PydanticCustomError(
                "module_name",
                "'{name}' is the name of a standard-library module or of one that torch or "
                "posgen imports; a generated module of that name would shadow it",
                {"name": name},
            )
        problem = reserved_name_problem(name)
        if problem is not None:
            raise PydanticCustomError("module_name", "{problem}", {"problem": problem})
        return name

    def _trained_tables(self) -> list[tuple[str, int, int]]:
        """(field, rows, width) of every trained table and table projection the spec's
        defaults create."""
        model_dim = self.defaults.model_dim or 0
        heads, head_dim = self.defaults.heads, self.defaults.head_dim
        tables: list[tuple[str, int, int]] = []
        table = getattr(self.input, "table", None)
        if isinstance(table, LearnedTable):
            tables.append(("input.table.max_positions", table.max_positions, model_dim))
        elif isinstance(table, HierarchicalTable):
            tables.append(("input.table.base_positions", table.base_positions, model_dim))
        untied = self.untied
        if untied is not None and isinstance(untied.table, LearnedTable):
            untied_rows = untied.table.max_positions + 1
            at = "terms.position_position.untied.table.max_positions"
            tables.append((at, untied_rows, model_dim))
        if untied is not None:  # its query and key projections, model_dim -> heads x head_dim
            tables.append(("defaults.model_dim", model_dim, heads * head_dim))
        for name in ("content_position", "position_content", "position_position"):
            term = getattr(self.terms, name)
            spec = getattr(term, "relative", None) or getattr(term, "global_", None)
            if getattr(spec, "projection", "none") != "none":  # a Linear model_dim -> H x D
                tables.append((f"terms.{name}", model_dim, heads * head_dim))
        section = self.relative
        rows = section.index.rows if section is not None else None
        if section is not None and rows is not None:
            relative = section.table
            if isinstance(relative, LearnedRelativeTable):
                width = model_dim if relative.width == "model_dim" else head_dim
                if relative.heads == "per_head":
                    width *= heads
                tables.append(("relative.index", rows, width))
            if isinstance(self.values, RelativeValues):
                per_head = self.values.relative.heads == "per_head"
                tables.append(
                    ("values.relative.heads", rows, head_dim * (heads if per_head else 1))
                )
        return tables

    def _check_randomized_range(self) -> None:
        """Randomized positions must stay inside every trained table they index."""
        if self.positions is None:
            return
        limits = [rows for at, rows, _ in self._trained_tables() if "max_positions" in at]
        if limits and self.positions.max_positions > min(limits):
            raise cross_field_error(
                "positions.max_positions",
                f"randomized positions up to {self.positions.max_positions - 1} would index "
                f"past a learned table of {min(limits)} rows: use at most {min(limits)}",
            )

    def _check_table_sizes(self) -> None:
        for at, rows, width in self._trained_tables():
            if rows * width > MAX_TABLE_ELEMENTS:
                raise cross_field_error(
                    at,
                    f"this makes a trained table (or projection) of {rows:,} rows x "
                    f"{width:,} features = {rows * width:,} floats, past the limit of "
                    f"{MAX_TABLE_ELEMENTS:,} (2^27, 512 MiB in float32): use fewer rows or "
                    "a narrower table",
                )

    @model_validator(mode="after")
    def _check_consistency(self) -> Spec:
        shadowed = python_name_problem(self.name)
        if shadowed is not None:
            raise cross_field_error("name", shadowed)
        position_terms = {
            "content_position": self.terms.content_position,
            "position_content": self.terms.position_content,
            "position_position": self.terms.position_position,
        }
        if self.input is not None:
            for term, value in position_terms.items():
                if value != "absolute" and not isinstance(value, RELATIVE_FORMS):
                    raise cross_field_error(
                        f"terms.{term}",
                        "positions added to the input reach every position term: "
                        f"state it as 'absolute' (got {_describe(value)!r})",
                    )
            if self.defaults.model_dim is None:
                raise cross_field_error("defaults", "an input-level table needs defaults.model_dim")
            table = getattr(self.input, "table", None)
            if table is not None and table.kind == "sinusoidal" and self.defaults.model_dim % 2:
                raise cross_field_error(
                    "defaults.model_dim",
                    f"sinusoidal tables pair sin and cos features, so model_dim must be "
                    f"even (got {self.defaults.model_dim})",
                )
        else:
            for term, value in position_terms.items():
                if value == "absolute":
                    raise cross_field_error(
                        f"terms.{term}",
                        "'absolute' terms come from an input-level table: add an "
                        "'input' section or choose another form",
                    )
        if self.untied is not None and self.defaults.model_dim is None:
            raise cross_field_error(
                "defaults",
                "an untied position table lives in model space: it needs defaults.model_dim",
            )
        self._check_relative()
        self._check_bias()
        self._check_table_sizes()
        self._check_randomized_range()
        if self.rotation is not None:
            self._check_rotation(self.rotation)
        if self.contextual is not None and (self._relative_readers() or self.relative):
            raise cross_field_error(
                "terms.content_position",
                "CoPE's contextual term renders the module's content-dependent terms: it "
                "cannot share them with relative-table terms (drop those, or the relative "
                "section)",
            )
        return self

    def _check_rotation(self, rotation: Rotation) -> None:
        """Rotation fields that depend on head_dim, and combinations that have no meaning."""
        at = "terms.content_content.rotate"
        problem = rotation_problem(rotation, self.defaults.head_dim)
        if problem is not None:
            field, message = problem
            raise cross_field_error(f"{at}.{field}", message)
        if rotation.axes is not None and self.positions is not None:
            raise cross_field_error(
                f"{at}.axes",
                "randomized positions draw one position per token; M-RoPE "
                "takes a position per axis: use one or the other",
            )
        if rotation.axes is not None and self.query_scale is not None:
            raise cross_field_error(
                "query_scale",
                "a query scale reads one position per query; a rotation over position "
                "axes (M-RoPE, axial RoPE) gives each token one per axis: use one or the "
                "other",
            )
        readers = self._single_side_readers()
        if rotation.position_scale is not None and readers:
            raise cross_field_error(
                f"{at}.position_scale",
                "xPos scales q and k about the middle of each call's key positions, a "
                f"factor that cancels only in q·k; {readers[0]} reads q or k alone, so "
                "its logits would change with the keys a call holds (a prefill, a decode "
                "step, a cache of rotated keys): drop position_scale or that term",
            )

    def _single_side_readers(self) -> list[str]:
        """The terms that read the (rotated) q or k alone, not as q·k: relative terms
        (q·R, k·R), the global content term (u·k_j) and CoPE's (q·e)."""
        readers = []
        for term in ("content_position", "position_content"):
            value = getattr(self.terms, term)
            if isinstance(value, (RelativeTerm, GlobalContentTerm, ContextualTerm)):
                readers.append(f"terms.{term}")
        return readers

    def _check_bias(self) -> None:
        """Per-head sizes of a bias against defaults.heads."""
        bias = self.bias
        at = "terms.position_position.bias"
        heads = self.defaults.heads
        if isinstance(bias, LinearSlopeBias):
            if bias.values is not None and len(bias.values) != heads:
                raise cross_field_error(
                    f"{at}.values",
                    f"{len(bias.values)} custom slopes for {heads} heads (defaults.heads): "
                    "give one per head",
                )
            if bias.heads_with_bias is not None and bias.heads_with_bias > heads:
                raise cross_field_error(
                    f"{at}.heads_with_bias",
                    f"{bias.heads_with_bias} heads with a bias, but defaults.heads is {heads}",
                )
        if isinstance(bias, FireBias) and bias.hidden * heads > MAX_TABLE_ELEMENTS:
            raise cross_field_error(f"{at}.hidden", "the MLP is too large for these heads")
        if isinstance(bias, ExprBias):
            for name, param in bias.params.items():
                if isinstance(param.init, list) and len(param.init) != heads:
                    raise cross_field_error(
                        f"{at}.params.{name}.init",
                        f"{len(param.init)} initial values for {heads} heads (defaults.heads): "
                        "give one per head",
                    )
            problem = bias.finiteness_problem(heads)
            if problem is not None:
                raise cross_field_error(f"{at}.expr", problem)

    def _relative_readers(self) -> list[tuple[str, RelativeTermSpec | GlobalPositionSpec]]:
        """(path, term) of every term that reads the relative table."""
        readers: list[tuple[str, RelativeTermSpec | GlobalPositionSpec]] = []
        for term in ("content_position", "position_content", "position_position"):
            value = getattr(self.terms, term)
            if isinstance(value, RelativeTerm):
                readers.append((f"terms.{term}.relative", value.relative))
            elif isinstance(value, GlobalPositionTerm):
                readers.append((f"terms.{term}.global", value.global_))
        return readers

    def _check_relative(self) -> None:
        readers = self._relative_readers()
        value_term = self.values if isinstance(self.values, RelativeValues) else None
        section = self.relative
        if section is None:
            if readers:
                raise cross_field_error(
                    readers[0][0],
                    "relative terms read the table of a top-level 'relative' section "
                    "(index and table): add one",
                )
            if value_term is not None:
                raise cross_field_error(
                    "values.relative",
                    "relative values use the index of a top-level 'relative' section: add one",
                )
            return
        if not readers and value_term is None:
            raise cross_field_error(
                "relative", "no term reads the relative table: remove the section"
            )
        if readers and section.table is None:
            raise cross_field_error(
                "relative.table", f"{readers[0][0]} reads the relative table: add 'table'"
            )
        if section.table is not None and not readers:
            raise cross_field_error(
                "relative.table",
                "no term reads the relative table (the value term has its own): remove it",
            )
        if value_term is not None and isinstance(section.index, DistanceIndex):
            raise cross_field_error(
                "values.relative",
                "relative values are a learned table with finitely many rows: use index "
                "kind 'clip' or 'log_buckets'",
            )
        width = section.width
        for path, reader in readers:
            if width == "head_dim" and reader.projection != "none":
                raise cross_field_error(
                    f"{path}.projection",
                    "a head_dim table is used as it is, so projection must be 'none' "
                    f"(got {reader.projection!r})",
                )
            if width == "model_dim" and reader.projection == "none":
                raise cross_field_error(
                    f"{path}.projection",
                    "a model_dim table must be projected into the heads: choose 'key', "
                    "'query' or 'relative'",
                )
        table, index = section.table, section.index
        if isinstance(table, SinusoidalRelativeTable) and not isinstance(index, DistanceIndex):
            raise cross_field_error(
                "relative.index.kind",
                "a sinusoidal table is computed for every distance: use index kind 'distance'",
            )
        if isinstance(index, DistanceIndex) and isinstance(table, LearnedRelativeTable):
            raise cross_field_error(
                "relative.index.kind",
                "a learned table has finitely many rows: use index kind 'clip' or 'log_buckets'",
            )
        if width == "model_dim":
            if self.defaults.model_dim is None:
                raise cross_field_error(
                    "defaults", "a model_dim relative table needs defaults.model_dim"
                )
            if isinstance(table, SinusoidalRelativeTable) and self.defaults.model_dim % 2:
                raise cross_field_error(
                    "defaults.model_dim",
                    f"sinusoidal tables pair sin and cos features, so model_dim must be "
                    f"even (got {self.defaults.model_dim})",
                )

    @property
    def rotation(self) -> Rotation | None:
        """The rotation of content_content, if the spec rotates."""
        term = self.terms.content_content
        return term.rotate if isinstance(term, RotateTerm) else None

    @property
    def bias(self) -> AnyBias | None:
        """The position_position bias, if the spec has one (alone or beside an untied term)."""
        term = self.terms.position_position
        return term.bias if isinstance(term, (BiasTerm, UntiedTerm)) else None

    @property
    def contextual(self) -> ContextualPositions | None:
        """The CoPE term, if content_position is contextual."""
        term = self.terms.content_position
        return term.contextual if isinstance(term, ContextualTerm) else None

    @property
    def untied(self) -> UntiedPositions | None:
        """The untied absolute position_position term, if the spec has one."""
        term = self.terms.position_position
        return term.untied if isinstance(term, UntiedTerm) else None


RELATIVE_FORMS = (RelativeTerm, GlobalContentTerm, GlobalPositionTerm)


def _describe(value: object) -> str:
    """A term's form for an error message: its keyword, or its model's ``form``."""
    return value if isinstance(value, str) else getattr(value, "form", type(value).__name__)
