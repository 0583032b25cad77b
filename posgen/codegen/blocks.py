"""The typed parts of a plan: building blocks, and the variants they are made of.

Every field is a typed Python value (bool, int, float, None, a word from a fixed set,
or a tuple of those) that the builders in ``posgen.codegen.plan`` computed. Templates
render values through the one ``py`` filter and test only booleans and None: each
convention a spec names (a pairing, a sign, a placement) reaches them as a boolean here
(a field or a property), and each kind of table or index is a class of its own that
names its own macro file. Words that remain are rendered only in prose (docstrings and
comments) or through ``py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

Pairing = Literal["half", "interleaved"]
SectionLayout = Literal["consecutive", "interleaved"]
SinusoidLayout = Literal["interleaved", "split"]
Sign = Literal["key_minus_query", "query_minus_key"]
Activation = Literal["relu", "tanh", "gelu", "sigmoid"]
TermName = Literal["content_position", "position_content", "position_position"]
Side = Literal["query", "key", "global"]
Projection = Literal["none", "key", "query", "relative"]

# The call that applies each activation in generated code (F is torch.nn.functional).
ACTIVATION_CALLS: dict[Activation, str] = {
    "relu": "torch.relu",
    "tanh": "torch.tanh",
    "gelu": "F.gelu",
    "sigmoid": "torch.sigmoid",
}
# How a term's comment writes the vector it reads and the projection of the rows.
SIDE_SYMBOLS: dict[Side, str] = {"query": "q_i", "key": "k_j", "global": "v_h"}
PROJECTION_SYMBOLS: dict[Projection, str] = {
    "none": "",
    "key": "W_k ",
    "query": "W_q ",
    "relative": "W_R ",
}


@dataclass(frozen=True)
class Rendered:
    """A plan part with a macro file of its own, named by ``template``."""

    template: ClassVar[str]


@dataclass(frozen=True)
class Block(Rendered):
    """A building block of a module, one of ``ModulePlan.blocks``.

    Its macro file exposes four macros taking the block: ``helpers`` (module level),
    ``init`` (constructor lines), ``methods`` and ``weights`` (checkpoint notes for the
    docstring).
    """

    #: every block of the class reads positions only as key minus query position
    reads_differences_only: ClassVar[bool] = False

    @property
    def shift_invariant(self) -> bool:
        """Positions reach this block's part of attention only as key minus query
        position, so adding one constant to every query and key position changes none of
        its logits (the runtime's flag of that name). False unless a block says so:
        rotations, untied absolute and contextual terms and FIRE read positions
        themselves. Input-level tables say so: they act before attention, which then
        reads no position."""
        return self.reads_differences_only

    @property
    def distance_bias_parameters(self) -> tuple[str, ...]:
        """For a bias of j - i alone: the trained parameters (attribute names its macro
        file creates) its per-distance vector is a function of, each one scalar per head
        whose entry h reaches only head h's row (the runtime's flag of that name); ()
        where there are none."""
        return ()

    @property
    def distance_bias_at_most_zero(self) -> bool:
        """For a bias of j - i alone: every entry is at most 0 and the entry at distance 0
        is 0, whatever the parameters (the runtime's flag of that name). False unless a
        block says so."""
        return False

    @property
    def position_bias_finite(self) -> bool:
        """For a position bias: every entry is finite while the parameters are (the
        runtime's flag of that name), so a row that reads a key the masks leave is never
        all -inf. False unless a block says so: an expression may give -inf (log(0))."""
        return False


# --------------------------------------------------------------------------- input tables


@dataclass(frozen=True)
class InputTable(Rendered):
    """The table p of an input-level block (``AbsoluteTablePlan.table``).

    Its macro file exposes ``helpers``, ``init``, ``lookup`` (``_position_table`` and
    what it needs), ``weights``, and ``note(table, multiply)`` (embed's docstring lines
    after the summary) or, for a table generated from the tokens, ``summary`` (embed's
    whole docstring).
    """


@dataclass(frozen=True)
class LearnedTablePlan(InputTable):
    """A trained table with a hard length (GPT-2, BERT)."""

    template: ClassVar[str] = "blocks/learned_table.jinja"
    max_positions: int
    init_std: float
    init_mean: float


@dataclass(frozen=True)
class SinusoidalTablePlan(InputTable):
    """sin and cos of the position at geometric frequencies, computed in float64."""

    template: ClassVar[str] = "blocks/sinusoidal_table.jinja"
    base: float
    layout: SinusoidLayout  # also named in the docstring

    @property
    def interleaved(self) -> bool:
        """sin on even features and cos on odd ones (else all sines, then all cosines)."""
        return self.layout == "interleaved"


@dataclass(frozen=True)
class HierarchicalTablePlan(InputTable):
    """A trained basis u of n rows serving n² positions: alpha u_i + (1 - alpha) u_j."""

    template: ClassVar[str] = "blocks/hierarchical_table.jinja"
    base_positions: int
    alpha: float
    init_std: float


@dataclass(frozen=True)
class DepthwiseConvPlan(InputTable):
    """Positions generated from the tokens by a depthwise convolution (CPVT)."""

    template: ClassVar[str] = "blocks/depthwise_conv.jinja"
    kernel_size: int
    padding: Literal["same", "causal"]  # named in the docstring
    bias: bool
    grid_2d: bool  # a k x k convolution over an H x W grid (else 1-D over the sequence)

    @property
    def causal(self) -> bool:
        """All k - 1 zeros on the left: output i sees inputs i - k + 1 .. i only."""
        return self.padding == "causal"


@dataclass(frozen=True)
class OdeTablePlan(InputTable):
    """Positions from a learned dynamical system dp/dt = h(p, t) (FLOATER)."""

    template: ClassVar[str] = "blocks/ode_positions.jinja"
    max_positions: int | None  # the integration horizon; None: unbounded
    init_std: float
    hidden: int
    activation: Activation  # named in the docstring
    uses_rk4: bool  # classic fourth-order Runge-Kutta steps (else explicit Euler)
    position_step: float
    steps_per_position: int
    learns_initial_position: bool  # p_0 is a trained vector (else zero)

    @property
    def activation_call(self) -> str:
        """The function that applies the activation, from a fixed table."""
        return ACTIVATION_CALLS[self.activation]


@dataclass(frozen=True)
class AbsoluteTablePlan(Block):
    """An input-level table p combined with x (``embed``): x + p or x * p."""

    template: ClassVar[str] = "blocks/absolute_table.jinja"
    reads_differences_only: ClassVar[bool] = True  # input level: attention reads no position
    table: InputTable
    multiply: bool  # x * p, feature-wise (else x + p)

    @property
    def generated_from_tokens(self) -> bool:
        """p is computed from x itself: positions cannot be given, embed says so."""
        return isinstance(self.table, DepthwiseConvPlan)

    @property
    def takes_grid(self) -> bool:
        """embed takes the tokens' (H, W) grid as a keyword argument."""
        return isinstance(self.table, DepthwiseConvPlan) and self.table.grid_2d


@dataclass(frozen=True)
class ComplexOrderPlan(Block):
    """Complex word-order embeddings (``embed`` returns real and imaginary parts)."""

    template: ClassVar[str] = "blocks/complex_order.jinja"
    reads_differences_only: ClassVar[bool] = True  # input level: attention reads no position
    learned: bool  # module-owned per-feature frequency and phase
    frequency_base: float | None = None


# --------------------------------------------------------------------------- rotation


@dataclass(frozen=True)
class FrequencyPlan(Rendered):
    """A schedule of rotary frequencies theta_k: renders ``_inverse_frequencies``.

    ``by_length``: theta depends on the call's length (largest position + 1). The
    schedule renders ``_length_regime`` too, which groups the lengths that share theta:
    the module keeps cos and sin for the regime of the last call whose length the host
    knows (default positions) and computes them per call past any regime.
    """

    by_length: ClassVar[bool] = False
    #: the schedule has a fixed width (one factor per pair): check it at construction
    checks_width: ClassVar[bool] = False
    #: it rescales base^(-2k / d), rendered once as ``_geometric_frequencies``
    geometric: ClassVar[bool] = True


@dataclass(frozen=True)
class StandardFrequencyPlan(FrequencyPlan):
    """theta_k = base^(-2k / d)."""

    template: ClassVar[str] = "blocks/frequencies/standard.jinja"


@dataclass(frozen=True)
class LinearFrequencyPlan(FrequencyPlan):
    """Position Interpolation: theta_k / factor."""

    template: ClassVar[str] = "blocks/frequencies/linear.jinja"
    factor: float


@dataclass(frozen=True)
class NtkFrequencyPlan(FrequencyPlan):
    """NTK-aware: base · factor^(d / (d - 2))."""

    template: ClassVar[str] = "blocks/frequencies/ntk.jinja"
    checks_width: ClassVar[bool] = True  # d / (d - 2) needs rotary_dim > 2
    factor: float


@dataclass(frozen=True)
class DynamicNtkFrequencyPlan(FrequencyPlan):
    """Dynamic NTK: the NTK base for the call's length."""

    template: ClassVar[str] = "blocks/frequencies/dynamic_ntk.jinja"
    checks_width: ClassVar[bool] = True  # d / (d - 2) needs rotary_dim > 2
    by_length: ClassVar[bool] = True
    factor: float
    original_max_positions: int


@dataclass(frozen=True)
class YarnFrequencyPlan(FrequencyPlan):
    """YaRN's ramp between theta_k and theta_k / factor."""

    template: ClassVar[str] = "blocks/frequencies/yarn.jinja"
    factor: float
    original_max_positions: int
    beta_fast: float
    beta_slow: float
    truncate: bool


@dataclass(frozen=True)
class Llama3FrequencyPlan(FrequencyPlan):
    """Llama 3.1's wavelength bands."""

    template: ClassVar[str] = "blocks/frequencies/llama3.jinja"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclass(frozen=True)
class LongRopeFrequencyPlan(FrequencyPlan):
    """LongRoPE's per-pair factors, short or long by the call's length."""

    template: ClassVar[str] = "blocks/frequencies/longrope.jinja"
    by_length: ClassVar[bool] = True
    checks_width: ClassVar[bool] = True
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_positions: int


@dataclass(frozen=True)
class ExprFrequencyPlan(FrequencyPlan):
    """theta_k from a checked expression of k, d and base, one assignment per syntax node
    (``posgen.spec.expr.render_steps``: fixed torch calls and temporaries, no spec text)."""

    template: ClassVar[str] = "blocks/frequencies/expr.jinja"
    checks_width: ClassVar[bool] = True  # computed once at construction: refuses non-finite
    geometric: ClassVar[bool] = False
    expression: str  # rendered through ``py`` only
    steps: tuple[str, ...]
    result: str
    # the expression in pieces of one line each (one piece where it fits a line): a long
    # one is rendered as implicit concatenation, as ruff leaves it
    expression_parts: tuple[str, ...]
    uses_d: bool  # the steps read d (only names they read are assigned)
    uses_base: bool

    @property
    def fits_one_line(self) -> bool:
        """The expression is one literal on its line (no implicit concatenation)."""
        return len(self.expression_parts) == 1


@dataclass(frozen=True)
class RotationPlan(Block):
    """Rotary position embedding of q and k."""

    template: ClassVar[str] = "blocks/rotation.jinja"
    base: float
    pairing: Pairing  # rendered as the ROTARY_PAIRING constant
    fraction: float
    proportional: bool  # p-RoPE: pairs span the head, the lowest frequencies are zero
    frequencies: FrequencyPlan
    attention_factor: float  # multiplies cos and sin (YaRN, LongRoPE); 1.0 elsewhere
    xpos_scale_base: float | None  # xPos per-position scale, or None
    sections: tuple[int, ...] | None  # M-RoPE: pairs per position axis, or None
    section_layout: SectionLayout  # M-RoPE: runs of pairs, or pairs dealt out in turn
    axial_count: int | None  # axial RoPE: axes sharing the pairs evenly, or None

    @property
    def half_pairing(self) -> bool:
        """Feature k pairs with k + rotary_dim / 2 (GPT-NeoX); else 2k with 2k + 1 (GPT-J)."""
        return self.pairing == "half"

    @property
    def scales_attention(self) -> bool:
        return self.attention_factor != 1.0

    @property
    def axis_count(self) -> int:
        """Position axes: 1, or M-RoPE's sections, or the axial count."""
        if self.sections is not None:
            return len(self.sections)
        return self.axial_count or 1

    @property
    def multi_axis(self) -> bool:
        return self.axis_count > 1

    @property
    def patch_grid(self) -> bool:
        """2-D axial RoPE: the class gets ``grid_positions(height, width)``."""
        return self.axial_count == 2


# --------------------------------------------------------------------------- contextual


@dataclass(frozen=True)
class ContextualPlan(Block):
    """CoPE: a content_position term at gate-counted (contextual) positions."""

    template: ClassVar[str] = "blocks/cope.jinja"
    max_positions: int
    init_std: float
    # a global content term beside it: the relative block renders ``_relative_terms``,
    # which adds this block's ``_contextual_terms`` (a class has one method of a name)
    beside_relative: bool = False


# --------------------------------------------------------------------------- biases


@dataclass(frozen=True)
class BucketIndexPlan:
    """T5's log-spaced buckets of a signed relative position."""

    buckets: int
    max_distance: int
    max_exact: int
    bidirectional: bool
    key_minus_query: bool  # r = j - i (else i - j)


@dataclass(frozen=True)
class SlopeBiasPlan(Block):
    """bias[h, i, j] = -slope_h * |i - j|: ALiBi's geometric, learned or custom slopes."""

    template: ClassVar[str] = "blocks/slope_bias.jinja"
    reads_differences_only: ClassVar[bool] = True  # a function of |j - i|
    inside_scale: bool  # added to q.k before the scale (else after it)
    slopes: Literal["alibi_geometric", "learned", "custom"]  # named in a comment
    method: str = "_position_bias"  # the method that returns the [heads, N, M] bias
    public: bool = True  # also render ``score_bias`` (False inside an untied term)
    custom_values: tuple[float, ...] | None = None  # the CUSTOM_SLOPES constant
    heads_with_bias: int | None = None  # only the first N heads get a bias

    @property
    def learned(self) -> bool:
        """The slopes are an nn.Parameter initialised from the geometric recipe."""
        return self.slopes == "learned"

    @property
    def custom(self) -> bool:
        """The slopes are the spec's values (a module-level constant)."""
        return self.custom_values is not None

    @property
    def plain(self) -> bool:
        """The original fixed geometric slopes on every head (the cached buffer path)."""
        return not self.learned and not self.custom and self.heads_with_bias is None

    @property
    def distance_bias_parameters(self) -> tuple[str, ...]:
        """Learned slopes, one per head (the heads past ``heads_with_bias`` get 0)."""
        return ("slopes",) if self.learned else ()

    @property
    def distance_bias_at_most_zero(self) -> bool:
        """-slope_h |r| with fixed slopes, each at least 0 (the recipe's, or custom ones
        in [0, 1000]); trained slopes may turn negative."""
        return not self.learned

    @property
    def position_bias_finite(self) -> bool:
        """-slope_h |r|: finite for finite slopes."""
        return True


@dataclass(frozen=True)
class KerplePlan(Block):
    """KERPLE: -r1_h log(1 + r2_h |i - j|) or -r1_h |i - j|^r2_h, r1 and r2 trained."""

    template: ClassVar[str] = "blocks/kerple.jinja"
    reads_differences_only: ClassVar[bool] = True  # a function of |j - i|
    inside_scale: bool
    variant: Literal["log", "power"]  # named in comments

    @property
    def log(self) -> bool:
        """The logarithmic kernel (else the power kernel)."""
        return self.variant == "log"

    @property
    def distance_bias_parameters(self) -> tuple[str, ...]:
        """r1 and r2, one each per head."""
        return ("r1", "r2")

    @property
    def distance_bias_at_most_zero(self) -> bool:
        """r1 and r2 are clamped to at least KERPLE_EPS > 0, so -r1 log(1 + r2 |r|) and
        -r1 |r|^r2 are at most 0, and 0 at r = 0."""
        return True

    @property
    def position_bias_finite(self) -> bool:
        """Both kernels are finite for finite r1 and r2 (clamped above 0)."""
        return True


@dataclass(frozen=True)
class FirePlan(Block):
    """FIRE: an MLP of the log-normalised causal distance, per head."""

    template: ClassVar[str] = "blocks/fire.jinja"
    inside_scale: bool
    hidden: int
    init_c: float
    init_threshold: float

    @property
    def position_bias_finite(self) -> bool:
        """An MLP of log(1 + |c| d) / (log(1 + |c| max(i, |L|)) + eps), d = max(i - j, 0)
        and positions at least 0: finite for finite parameters."""
        return True


@dataclass(frozen=True)
class SandwichPlan(Block):
    """Sandwich: S = sum_k cos((i - j) / base^(2k / d')), the same for every head, or
    (S - d'/2) / (8h / H) for head h = 1 .. H where ``divided``."""

    template: ClassVar[str] = "blocks/sandwich.jinja"
    reads_differences_only: ClassVar[bool] = True  # a function of i - j
    inside_scale: bool
    dim: int
    base: float
    divided: bool

    @property
    def position_bias_finite(self) -> bool:
        """A sum of cosines: finite."""
        return True


@dataclass(frozen=True)
class ExprParamPlan:
    """A trained parameter of an expression bias (``name`` a checked identifier)."""

    name: str
    per_head: bool
    # the stored value: init, or softplus^-1(init) for a positive one; or one per head
    raw_init: float | tuple[float, ...]
    positive: bool
    bounds: tuple[float, float] | None

    @property
    def listed(self) -> str:
        """The module constant that holds the initial value of each head, where the spec
        lists them; else ''."""
        return f"EXPR_INIT_{self.name.upper()}" if isinstance(self.raw_init, tuple) else ""


@dataclass(frozen=True)
class ExprBiasPlan(Block):
    """A bias from a checked expression, rendered as one assignment per syntax node.

    ``steps`` come from ``posgen.spec.expr.render_steps``: fixed torch calls, temporaries
    ``tK``, the locals i, j, h, heads, ``p_NAME`` and finite float literals; no spec text.
    """

    template: ClassVar[str] = "blocks/expr_bias.jinja"
    inside_scale: bool
    expression: str  # quoted in the docstring only, through ``py``
    params: tuple[ExprParamPlan, ...]
    steps: tuple[str, ...]
    result: str
    uses_i: bool  # the steps read i (only names they read are assigned)
    uses_j: bool
    uses_h: bool
    uses_heads: bool = False  # the steps read the head count, a 0-d tensor
    of_difference: bool = False  # unchanged when i and j shift together: f(0, j - i)
    # and at explicit positions made once per distance and read per pair, where its
    # per-head work per pair outweighs the read (``expr_cost``)
    read_per_distance: bool = False

    @property
    def shift_invariant(self) -> bool:
        """An expression of i - j alone (it renders ``_distance_bias``)."""
        return self.of_difference

    @property
    def distance_bias_parameters(self) -> tuple[str, ...]:
        """Every parameter of an expression of i - j: each is 0-D or [heads], read as
        name[h] (a view [H, 1, 1], so entry h reaches only head h's row)."""
        return tuple(f"expr_{param.name}" for param in self.params) if self.of_difference else ()

    @property
    def reads_bounded(self) -> bool:
        """A parameter is read through ``clamp_toward_range`` (it has ``bounds``): a
        chunked call then reads the parameters once for all its chunks (the runtime's
        ``BoundedReads``)."""
        return any(param.bounds is not None for param in self.params)


PositionBiasPlan = SlopeBiasPlan | KerplePlan | FirePlan | SandwichPlan | ExprBiasPlan


@dataclass(frozen=True)
class TableBiasPlan(Block):
    """bias[h, i, j] = table[bucket(i, j), h], a trained scalar per (bucket, head)."""

    template: ClassVar[str] = "blocks/bias_table.jinja"
    reads_differences_only: ClassVar[bool] = True  # buckets of j - i
    inside_scale: bool
    index: BucketIndexPlan
    init_std: float
    method: str = "_position_bias"
    public: bool = True
    spare_row: bool = False  # one extra row for the untied first-token reset
    document_weights: bool = True  # False where the untied block documents the table

    @property
    def position_bias_finite(self) -> bool:
        """Entries of the trained table: finite while the table is."""
        return True


@dataclass(frozen=True)
class UntiedPlan(Block):
    """TUPE's untied absolute term, with an optional relative bias beside it."""

    template: ClassVar[str] = "blocks/untied_absolute.jinja"
    max_positions: int
    init_std: float
    layer_norm: bool  # a LayerNorm over the table rows before the projections
    norm_eps: float
    projection_bias: bool
    first_token_reset: bool  # TUPE's [CLS] reset: a leading table row, per-head constants
    bias: SlopeBiasPlan | TableBiasPlan | None = None
    # other terms read q or k (relative, global or CoPE terms): they read them unfolded
    beside_content_terms: bool = False

    @property
    def folds(self) -> bool:
        """No bias beside it and no term that reads q or k: the term folds into extra
        features of q and k (sdpa, flex). A relative, global or CoPE term computed from
        the folded q' = [q, p U_q] and k' = [k, p U_k] would read head_dim + extra
        features against its head_dim rows (flex raised a shape error)."""
        return self.bias is None and not self.beside_content_terms

    @property
    def position_bias_finite(self) -> bool:
        """(p_i U_q) . (p_j U_k), finite for finite rows and projections, plus the
        relative bias beside it where there is one."""
        return self.bias is None or self.bias.position_bias_finite

    @property
    def bias_table(self) -> TableBiasPlan | None:
        """The bias beside the untied term when it is a trained table (else None)."""
        return self.bias if isinstance(self.bias, TableBiasPlan) else None


# --------------------------------------------------------------------------- relative terms


@dataclass(frozen=True)
class RelativeIndex(Rendered):
    """How a signed relative position r picks a row (``RelativePlan.index``).

    Its macro file exposes ``helpers``: what the index needs at module level.
    """

    rows_are_distances: ClassVar[bool] = False  # rows are the distances themselves

    @property
    def row_text(self) -> str:
        """Which row a distance reads, for the docstring's weights (or '')."""
        return ""


@dataclass(frozen=True)
class ClipIndexPlan(RelativeIndex):
    """row = clip(r, -k, k) + k: 2k + 1 rows."""

    template: ClassVar[str] = "blocks/clip_index.jinja"
    max_distance: int
    rows: int

    @property
    def row_text(self) -> str:
        k = self.max_distance
        return f"Row clip(r, -{k}, {k}) + {k} holds the distance r of each term's formula."


@dataclass(frozen=True)
class SymmetricLogIndexPlan(RelativeIndex):
    """DeBERTa-v2's log buckets that keep the sign: 2 * buckets rows."""

    template: ClassVar[str] = "blocks/symmetric_log_index.jinja"
    max_distance: int
    buckets: int
    rows: int


@dataclass(frozen=True)
class DistanceIndexPlan(RelativeIndex):
    """The raw distance: as many rows as distances present (a computed table)."""

    template: ClassVar[str] = "blocks/distance_index.jinja"
    rows_are_distances: ClassVar[bool] = True


@dataclass(frozen=True)
class RelativeTable(Rendered):
    """The table R of relative rows (``RelativePlan.table``).

    Its macro file exposes ``helpers``, ``init``, ``rows`` (the K rows of
    ``_relative_rows``) and ``weights``.
    """

    @property
    def projected(self) -> bool:
        """Rows are model_dim wide and each term projects them into the heads."""
        raise NotImplementedError


@dataclass(frozen=True)
class LearnedRelativeTablePlan(RelativeTable):
    """A trained table: head_dim rows used as they are, or model_dim rows projected."""

    template: ClassVar[str] = "blocks/learned_relative_table.jinja"
    model_width: bool  # rows of model_dim (else head_dim, or heads * head_dim per head)
    per_head: bool
    norm_eps: float | None  # a LayerNorm over model_dim rows; None: no norm
    init_std: float

    @property
    def projected(self) -> bool:
        return self.model_width


@dataclass(frozen=True)
class SinusoidalRelativeTablePlan(RelativeTable):
    """sin and cos of each distance, model_dim wide, computed in float64."""

    template: ClassVar[str] = "blocks/sinusoidal_relative_table.jinja"
    base: float
    layout: SinusoidLayout  # also named in the docstring

    @property
    def interleaved(self) -> bool:
        """sin on even features and cos on odd ones (else all sines, then all cosines)."""
        return self.layout == "interleaved"

    @property
    def projected(self) -> bool:
        return True


@dataclass(frozen=True)
class ProjectionPlan:
    """A projection of model_dim rows into the heads, shared by the terms that name it."""

    name: Literal["key", "query", "relative"]  # the word terms pass to _relative_rows
    layer: str  # the nn.Linear attribute (a validated identifier)
    has_bias: bool


@dataclass(frozen=True)
class RelativeTermPlan:
    """One term that reads the relative table: (query-side vector) . P(R)[index(r)]."""

    term: TermName  # its key in the terms dict
    side: Side  # the vector it reads: q_i, k_j, or the global v_h
    sign: Sign  # passed to _relative_layout
    projection: Projection  # passed to _relative_rows
    scaled_inside: bool  # the scale is applied inside the term (on its rows)
    init_std: float
    new_index: bool  # its sign differs from the previous term's: a new index map
    new_rows: bool  # its sign or projection differs from the previous term's: new rows
    relative_shift: bool  # default positions read the rows by a strided shift, not a gather

    @property
    def reads_query(self) -> bool:
        return self.side == "query"

    @property
    def reads_key(self) -> bool:
        return self.side == "key"

    @property
    def reads_global(self) -> bool:
        """It reads the global vector v_h: a position-only term."""
        return self.side == "global"

    @property
    def key_minus_query(self) -> bool:
        """r = j - i (else i - j)."""
        return self.sign == "key_minus_query"

    @property
    def side_symbol(self) -> str:
        """The vector it reads, as its comment writes it."""
        return SIDE_SYMBOLS[self.side]

    @property
    def projection_symbol(self) -> str:
        """The projection of the rows, as its comment writes it ("" when none)."""
        return PROJECTION_SYMBOLS[self.projection]


@dataclass(frozen=True)
class GlobalContentPlan:
    """Transformer-XL's u: one trained vector per head dotted with every key."""

    scaled_inside: bool
    init_std: float


@dataclass(frozen=True)
class ValueTermPlan:
    """A value-side table R^V added to the values by the attention weights."""

    sign: Sign
    per_head: bool
    init_std: float


@dataclass(frozen=True)
class RelativePlan(Block):
    """Relative terms gathered from a table of relative rows, and a value term."""

    template: ClassVar[str] = "blocks/relative_table.jinja"
    reads_differences_only: ClassVar[bool] = True  # rows by j - i
    index: RelativeIndex | None
    table: RelativeTable | None
    terms: tuple[RelativeTermPlan, ...]
    global_content: GlobalContentPlan | None
    values: ValueTermPlan | None
    projections: tuple[ProjectionPlan, ...]  # in the order key, query, relative
    renders_score_bias: bool  # its global position term is the module's position-only bias
    # CoPE beside it (a global content term): ``_relative_terms`` adds CoPE's
    # content_position (``_contextual_terms``, the contextual block's)
    contextual: bool = False

    @property
    def position_only(self) -> RelativeTermPlan | None:
        """The global position_position term, the only position-only relative term."""
        return next((term for term in self.terms if term.side == "global"), None)

    @property
    def term_order(self) -> tuple[str, ...]:
        """The names of the logit terms ``_relative_terms`` returns, in sorted order."""
        names = {term.term for term in self.terms}
        if self.global_content is not None:
            names.add("position_content")
        if self.contextual:
            names.add("content_position")
        return tuple(sorted(names))

    @property
    def copies_bert_table(self) -> bool:
        """Its table is read as Hugging Face BERT's ``distance_embedding`` is: head_dim
        rows at clip(i - j, -K, K) + K by every term, with no value term (so that
        checkpoint copies in directly; Shaw's reads j - i and adds a value term)."""
        return (
            isinstance(self.table, LearnedRelativeTablePlan)
            and not self.table.model_width
            and not self.table.per_head
            and isinstance(self.index, ClipIndexPlan)
            and self.values is None
            and all(not term.key_minus_query for term in self.terms)
        )

    @property
    def keeps_projected_rows(self) -> bool:
        """Its table is projected, so the rows are kept across calls without gradients
        (``_kept_relative_rows``)."""
        return self.table is not None and self.table.projected

    @property
    def shift(self) -> bool:
        """Some term reads default positions through the relative shift."""
        return any(term.relative_shift for term in self.terms)

    def _uses(self, name: str) -> bool:
        return any(projection.name == name for projection in self.projections)

    @property
    def uses_key_projection(self) -> bool:
        return self._uses("key")

    @property
    def uses_query_projection(self) -> bool:
        return self._uses("query")

    @property
    def uses_relative_projection(self) -> bool:
        return self._uses("relative")


@dataclass(frozen=True)
class RandomizedPositionsPlan(Block):
    """Training draws sorted random positions from a larger range (Ruoss et al. 2023)."""

    template: ClassVar[str] = "blocks/randomized_positions.jinja"
    max_positions: int


# --------------------------------------------------------------------------- query scales


@dataclass(frozen=True)
class QueryScalePlan(Block):
    """Each query multiplied by a factor of its own position (``_query_scales``): the
    logits change when every position shifts by one constant, so never shift-invariant."""


@dataclass(frozen=True)
class FloorLogQueryScalePlan(QueryScalePlan):
    """tau(i) = 1 + attn_scale ln(1 + floor((i + 1) / floor_scale)) (Llama 4)."""

    template: ClassVar[str] = "blocks/floor_log_query_scale.jinja"
    floor_scale: int
    attn_scale: float


@dataclass(frozen=True)
class LogLengthQueryScalePlan(QueryScalePlan):
    """tau(i) = max(1, ln(i + 1) / ln(original_max_positions)) (log-length scaling)."""

    template: ClassVar[str] = "blocks/log_length_query_scale.jinja"
    original_max_positions: int


@dataclass(frozen=True)
class TrainedLogQueryScalePlan(QueryScalePlan):
    """tau_h(i) = s_h ln(i + 1), s [heads] trained from ``init`` (Scalable-Softmax)."""

    template: ClassVar[str] = "blocks/trained_log_query_scale.jinja"
    init: float
