"""The ``Probe``: one spec's module, built in memory and driven through its contract.

``Probe`` builds a spec's module in memory (nothing is written into generated/) and
reaches positions through the module contract only (``embed``, ``rotate``,
``score_bias``, ``scores``, ``forward``), never through the spec's name, so a new idea
needs nothing but a YAML file. Which route reaches the positions is decided from the
validated ``Spec``:

* ``input`` (``spec.input`` is set): the table p_m = embed(t, m) for a constant token t
  (0, or 1 where embed(0, ·) is 0, as for x ⊙ p); logits are embed(x, i) Wq ·
  (embed(x, j) Wk)ᵀ with random float64 projections and content. An embed returning
  several parts (real, imaginary) is read as their concatenation; one that takes no
  explicit positions is read row by row from embed(x); one that cannot be called with x
  alone makes the properties it would serve "n/a", with the reason
  (``input_unreachable``);
* ``rotation`` (``content_content`` rotates): R_m = rotate(I, m);
* ``scores`` (everything else, including term forms the checker has never heard of): the
  module's ``scores`` with constant content (the same q at every query, the same k at
  every key, q · k = 0 so that a kept content term adds nothing).

No read goes past a table (``Probe.limit``: the max_positions of an input or untied
table, n² for n base rows).
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from posgen.check.contract import (
    F64,
    Content,
    Encoding,
    ForwardOptions,
    as_encoding,
    to_float64,
)
from posgen.check.search import Budget, generator
from posgen.check.verdicts import Outcome, kind_of
from posgen.codegen.inmemory import encoding_class, module_from_loaded
from posgen.spec.loader import LoadedSpec
from posgen.spec.model import ExprBias, Spec, SpecModel

if TYPE_CHECKING:
    from typing_extensions import Unpack


def stated(model: Any, field_name: str, kind: type | tuple[type, ...] = int) -> list[Any]:
    """Every field called ``field_name`` (of type ``kind``, never bool) in the spec."""
    found: list[Any] = []
    if isinstance(model, SpecModel):
        for name in type(model).model_fields:
            value = getattr(model, name)
            if name == field_name and isinstance(value, kind) and not isinstance(value, bool):
                found.append(value)
            else:
                found.extend(stated(value, field_name, kind))
    elif isinstance(model, (list, tuple)):
        for item in model:
            found.extend(stated(item, field_name, kind))
    return found


def route_of(spec: Spec) -> str:
    """How positions are reached: "input", "rotation" or "scores"."""
    if spec.input is not None:
        return "input"
    if spec.rotation is not None:
        return "rotation"
    return "scores"


def float64_encoding(cls: type[nn.Module], heads: int, head_dim: int) -> Encoding:
    """A fresh instance of ``cls`` with these sizes, widened to float64."""
    return as_encoding(to_float64(cls(heads=heads, head_dim=head_dim)))


class Probe:
    """One spec's module, instantiated with the spec's defaults, and its routes."""

    def __init__(
        self, loaded: LoadedSpec, budget: Budget, weights: Mapping[str, Tensor] | None = None
    ) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        self.budget = budget
        self.module: types.ModuleType = module_from_loaded(loaded)
        self.cls = encoding_class(self.module)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(budget.seed)
            module32 = self.cls().eval()
            if weights is not None:  # judged as trained, not at its random initialisation
                module32.load_state_dict(weights)
            self.pe32: Encoding = as_encoding(module32)
            self.pe64: Encoding = as_encoding(to_float64(copy.deepcopy(module32)))
        self.heads = int(self.pe32.heads)
        self.head_dim = int(self.pe32.head_dim)
        self.model_dim = int(self.pe32.model_dim) if self.spec.input is not None else None
        self.route = route_of(self.spec)
        # the positions a table can be read at: the max_positions of an input table or
        # an untied table (or an ODE's integration horizon), and n² for a table of n base
        # rows (hierarchical decomposition); every read stays below it. CoPE's
        # max_positions is no such bound: it clamps counted positions.
        tables = [self.spec.input, self.spec.untied]
        read_bounds: list[int] = [v for table in tables for v in stated(table, "max_positions")]
        limits = read_bounds + [n * n for n in stated(self.spec.input, "base_positions")]
        self.limit: int | None = min(limits) if limits else None
        # the training length (extrapolation starts there): a table's end, the range
        # randomized positions are drawn from in training, or where a query scale
        # leaves 1 (a floor step, or the length the log-length scale starts past)
        queries = self.spec.query_scale
        scale_lengths = stated(queries, "floor_scale") + stated(queries, "original_max_positions")
        lengths = read_bounds + stated(self.spec.positions, "max_positions") + scale_lengths
        self.length: int | None = min(lengths) if lengths else None
        self.span = min(budget.span, self.limit) if self.limit else budget.span
        self._token: float | None = None  # the table's constant token, once known
        self._tables: dict[float, Tensor] = {}  # token -> rows 0..n-1 of the table
        self._scores: dict[int, Tensor] = {}  # span -> position-only scores
        self._angles: Tensor | None = None
        # How the input route can be driven: embed(x, positions) ("explicit"), only
        # embed(x) with the default positions 0..L-1 ("default"), or not at all (None,
        # with the reason in input_note; e.g. an embed that needs extra arguments).
        self.input_mode: str | None = None
        self.input_note = ""
        # the input route's W_q and W_k [width, heads * head_dim], made only for it:
        # float64 squares of the model's width (2 GiB each at 16 heads of 1024)
        self.wq = self.wk = torch.empty(0, dtype=F64)
        if self.route == "input":
            width = self._find_input_mode() or self.heads * self.head_dim
            projections = generator(budget.seed + 1)
            project = self.heads * self.head_dim
            scale = math.sqrt(width)
            self.wq = torch.randn(width, project, generator=projections, dtype=F64) / scale
            self.wk = torch.randn(width, project, generator=projections, dtype=F64) / scale

    def _find_input_mode(self) -> int | None:
        """Set input_mode and input_note by calling embed; the width embed returns."""
        count = min(4, self.limit) if self.limit is not None else 4  # never past a table
        probe_x = torch.zeros(1, count, self.input_dim, dtype=F64)
        try:
            width = self.embed(self.pe64, probe_x, torch.arange(count)).shape[-1]
            self.input_mode = "explicit"
            return width
        except ValueError:
            pass
        try:
            width = self.embed(self.pe64, probe_x, None).shape[-1]
        except ValueError as error:
            self.input_note = f"embed(x) raises ValueError: {error}"
            return None
        self.input_mode = "default"
        self.input_note = "embed takes no explicit positions"
        return width

    def expression_parameters(self) -> dict[str, tuple[float, ...]]:
        """The values an expression bias reads for each of its parameters in the module
        under test (its init, or the ``--weights`` loaded), through softplus and bounds
        as the module reads them: one per head, or one; empty without such a bias."""
        bias = self.spec.bias
        module = cast(nn.Module, self.pe64)
        read = getattr(module, "_expression_parameters", None)
        if not isinstance(bias, ExprBias) or read is None:
            return {}
        with torch.no_grad():
            tensors = read(torch.device("cpu"), F64)
        return {
            name: tuple(value.reshape(-1).tolist())
            for name, value in zip(bias.params, tensors, strict=True)
        }

    @property
    def input_dim(self) -> int:
        """model_dim of an input-level encoding (the other routes have none)."""
        if self.model_dim is None:
            raise ValueError("no model_dim: the encoding has no input-level part")
        return self.model_dim

    def route_text(self) -> str:
        """How positions are reached, in words (the report's route line)."""
        if self.route == "rotation":
            return "rotation: R_m = rotate(I, m)"
        if self.route == "scores":
            return "scores with constant content (q on even features, k on odd)"
        if self.input_mode is None:
            return f"input-level, not reachable ({self.input_note})"
        token = int(self.table_token)
        how = "embed(t, m)" if self.input_mode == "explicit" else "row m of embed(t)"
        return f"input-level table: p_m = {how}, constant token t = {token}"

    @property
    def through_embed(self) -> bool:
        """Whether logits are formed as (embed(x, positions)) W: input route, explicit."""
        return self.route == "input" and self.input_mode == "explicit"

    @staticmethod
    def embed(pe: Encoding, x: Tensor, positions: Tensor | None) -> Tensor:
        """pe.embed, with a tuple of parts (e.g. real and imaginary) joined on features."""
        out = pe.embed(x) if positions is None else pe.embed(x, positions=positions)
        if isinstance(out, (tuple, list)):
            return torch.cat([part for part in out], dim=-1)
        return out

    @staticmethod
    def variant_class(loaded: LoadedSpec) -> type[nn.Module]:
        """The encoding class of another spec (a variant), built in memory like ours."""
        return encoding_class(module_from_loaded(loaded))

    # ----------------------------------------------------------------- content and logits

    def content(
        self, generator: torch.Generator, n: int, m: int, dtype: torch.dtype = F64
    ) -> Content:
        """Random content: token embeddings (through embed) or projected q, k; and v."""
        if self.through_embed:
            x_q = torch.randn(1, n, self.input_dim, generator=generator, dtype=F64)
            x_k = torch.randn(1, m, self.input_dim, generator=generator, dtype=F64)
            v = torch.randn(1, self.heads, m, self.head_dim, generator=generator, dtype=F64)
            return x_q.to(dtype), x_k.to(dtype), v.to(dtype)
        q = torch.randn(1, self.heads, n, self.head_dim, generator=generator, dtype=F64)
        k = torch.randn(1, self.heads, m, self.head_dim, generator=generator, dtype=F64)
        v = torch.randn(1, self.heads, m, self.head_dim, generator=generator, dtype=F64)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    def project(
        self,
        pe: Encoding,
        x_q: Tensor,
        x_k: Tensor,
        q_pos: Tensor | None,
        k_pos: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """Input route: embed(x, positions) W, split into heads: [1, heads, seq, head_dim]."""
        h_q = self.embed(pe, x_q, q_pos)
        h_k = self.embed(pe, x_k, k_pos)
        wq, wk = self.wq.to(h_q.dtype), self.wk.to(h_k.dtype)
        q = (h_q @ wq).view(1, -1, self.heads, self.head_dim).transpose(1, 2)
        k = (h_k @ wk).view(1, -1, self.heads, self.head_dim).transpose(1, 2)
        return q, k

    def logits(self, content: Content, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """float64 pre-softmax logits [1, heads, N, M] for content at explicit positions."""
        a, b, _ = content
        if self.through_embed:
            q, k = self.project(self.pe64, a, b, q_pos, k_pos)
        else:
            q, k = a, b
        return self.pe64.scores(q, k, q_positions=q_pos, k_positions=k_pos)

    def forward(
        self,
        pe: Encoding,
        content: Content,
        q_pos: Tensor | None,
        k_pos: Tensor | None,
        **options: Unpack[ForwardOptions],
    ) -> Tensor:
        """The module's attention output for content at these positions (None: default)."""
        a, b, v = content
        if self.through_embed:
            q, k = self.project(pe, a, b, q_pos, k_pos)
        else:
            q, k = a, b
        return pe(q, k, v, q_positions=q_pos, k_positions=k_pos, **options)

    # ----------------------------------------------------------------- position-only parts

    @property
    def table_token(self) -> float:
        """The constant token the table is read with: 0 (x + p gives p), or 1 where
        embed(0, m) is identically 0 (a multiplicative form such as x ⊙ p_m)."""
        if self._token is None:
            self._token = 0.0
            silent = not bool(self.table(torch.arange(min(self.span, 64))).any())
            self._token = 1.0 if silent else 0.0
        return self._token

    def table(self, positions: Tensor) -> Tensor:
        """Input route: p_m = embed(t, m) for the constant token t, [len, width].

        Where embed takes no explicit positions, the rows of embed(t) over 0..max are
        read instead (cached)."""
        token = self._token if self._token is not None else self.table_token
        if self.input_mode is None:
            raise ValueError(self.input_note)
        size = int(positions.max()) + 1 if positions.numel() else 1
        cached = self._tables.get(token)
        if cached is None or cached.shape[0] < size:
            # one call for every row up to the largest position (some tables are costly
            # to evaluate, e.g. integrated dynamics); rows are read by index
            size = max(size, 2 * cached.shape[0] if cached is not None else 64)
            if self.limit is not None:  # never read past the table (it raises there)
                size = max(min(size, self.limit), int(positions.max()) + 1)
            x = torch.full((1, size, self.input_dim), token, dtype=F64)
            every = torch.arange(size) if self.input_mode == "explicit" else None
            cached = self.embed(self.pe64, x, every)[0]
            self._tables[token] = cached
        return cached[positions]

    def constant_content(self, example_seed: int | None = None) -> tuple[Tensor, Tensor]:
        """The same q at every query and k at every key: [head_dim] each.

        Rotation route: q = k = 1 (the RoFormer picture: Σ cos((i-j)θ)). Otherwise a
        random q on the even features and a random k on the odd ones, so that a kept
        content term contributes exactly 0 and what remains is the position-only score.
        """
        if self.route == "rotation":
            ones = torch.ones(self.head_dim, dtype=F64)
            return ones, ones
        drawn = generator(self.budget.seed if example_seed is None else example_seed)
        q = torch.randn(self.head_dim, generator=drawn, dtype=F64)
        k = torch.randn(self.head_dim, generator=drawn, dtype=F64)
        if self.head_dim > 1:  # disjoint supports: q · k is exactly 0
            q[1::2] = 0.0
            k[0::2] = 0.0
        return q, k

    def position_scores(
        self, q_pos: Tensor, k_pos: Tensor, example_seed: int | None = None
    ) -> Tensor:
        """Position-only scores [heads, N, M] (input route: [1, N, M], p_i·p_j / √d)."""
        if self.route == "input":
            p_q, p_k = self.table(q_pos), self.table(k_pos)
            return (p_q @ p_k.T / math.sqrt(self.input_dim)).unsqueeze(0)
        q0, k0 = self.constant_content(example_seed)
        q = q0.expand(1, self.heads, q_pos.shape[0], self.head_dim).contiguous()
        k = k0.expand(1, self.heads, k_pos.shape[0], self.head_dim).contiguous()
        return self.pe64.scores(q, k, q_positions=q_pos, k_positions=k_pos)[0]

    def score_matrix(self, span: int) -> Tensor:
        """position_scores over [0, span)², cached."""
        if span not in self._scores:
            positions = torch.arange(span)
            self._scores[span] = self.position_scores(positions, positions)
        return self._scores[span]

    def rotation_matrix(self, position: int, side: int = 0) -> Tensor:
        """R_m as a [head_dim, head_dim] float64 matrix (row r = R_m e_r); side 0 is the
        query output of rotate, side 1 the key output."""
        eye = torch.eye(self.head_dim, dtype=F64).view(1, 1, self.head_dim, self.head_dim)
        where = torch.full((self.head_dim,), position, dtype=torch.int64)
        return self.pe64.rotate(eye, eye, where, where)[side][0, 0]

    def rotation_angles(self) -> Tensor:
        """θ_k measured from the module: the eigen-angles of R_1, descending."""
        if self._angles is None:
            angles = torch.linalg.eigvals(self.rotation_matrix(1)).angle()
            self._angles = angles[angles > 1e-12].sort(descending=True).values
        return self._angles

    def roformer_bound(self, distances: Tensor) -> Tensor:
        """(1/(d/2)) Σ_j |S_j|, S_j = Σ_{k<j} e^{i r θ_k} (Su et al. 2021, §3.4.3)."""
        theta = self.rotation_angles()
        phases = torch.polar(
            torch.ones(distances.shape[0], theta.shape[0], dtype=F64),
            distances.to(F64).unsqueeze(-1) * theta,
        )
        return phases.cumsum(dim=-1).abs().mean(dim=-1)


def bias_of(pe: Encoding, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """pe.score_bias for a module that has a bias (TypeError where it returns None)."""
    bias = pe.score_bias(q_pos, k_pos)
    if bias is None:
        raise TypeError("score_bias returned None for an encoding with a bias")
    return bias


def input_unreachable(
    probe: Probe, name: str, claimed: bool | None = None, need_explicit: bool = False
) -> Outcome | None:
    """An n/a outcome where positions enter through an embed the checker cannot drive."""
    if probe.route != "input":
        return None
    if probe.input_mode is None or (need_explicit and probe.input_mode != "explicit"):
        return Outcome(name, kind_of(name), claimed, None, f"cannot check: {probe.input_note}")
    return None
