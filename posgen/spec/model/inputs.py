"""Input-level forms: absolute tables added to the input (learned, sinusoidal,
hierarchical, depthwise convolution, ODE) and the complex word-order embedding.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from posgen.spec.model.base import (
    BASE_WHY,
    MAX_BASE,
    MAX_GRID_KERNEL,
    MAX_ODE_POSITIONS,
    MAX_ODE_STEPS,
    MAX_TABLE_ROWS,
    SpecModel,
    cross_field_error,
    init_std,
)


class LearnedTable(SpecModel):
    """A trained [max_positions, model_dim] table (GPT-2 ``wpe``, BERT position ids).

    Initialised from N(init_mean, init_std²): mean 0 for a table that is added, mean 1
    for one that multiplies (so that x ⊙ p starts near x rather than near 0).
    """

    kind: Literal["learned"]
    max_positions: int = Field(
        ge=2,  # one row holds no distance: nothing to learn or check between positions
        le=MAX_TABLE_ROWS,
        description=f"rows of the table, 2 to {MAX_TABLE_ROWS:,} (2^21): the table holds "
        "max_positions x model_dim trained floats (GPT-2 1024, BERT 512)",
    )
    init_std: float = init_std(0.02)
    init_mean: float = Field(
        0.0,
        ge=-10,
        le=10,
        description="mean of the normal initialisation, in [-10, 10]: 0 for a table that "
        "is added, 1 for one that multiplies; far larger means push x * p past half precision",
    )


class SinusoidalTable(SpecModel):
    """Fixed sinusoids (Vaswani et al. 2017, arXiv:1706.03762).

    ``interleaved``: PE(p, 2i) = sin(p·base^(-2i/d)), PE(p, 2i+1) = cos(p·base^(-2i/d)).
    ``split``: the sines fill the first half of the features and the cosines the second
    (the tensor2tensor layout).
    """

    kind: Literal["sinusoidal"]
    base: float = Field(gt=1, le=MAX_BASE, description=BASE_WHY)
    layout: Literal["interleaved", "split"]


class HierarchicalTable(SpecModel):
    """Hierarchically decomposed positions (Su 2020, kexue.fm/archives/7947).

    A trained table u of n = ``base_positions`` rows serves n² positions: position
    i·n + j (0 ≤ i, j < n) is q = alpha·u_i + (1 − alpha)·u_j. alpha ≠ 0.5 keeps
    positions i·n + j and j·n + i apart; positions ≥ n² raise.
    """

    kind: Literal["hierarchical"]
    base_positions: int = Field(
        ge=2,
        le=MAX_TABLE_ROWS,
        description=f"rows n of the trained table u, 2 to {MAX_TABLE_ROWS:,} (2^21), serving "
        "n^2 positions; each row is model_dim floats",
    )
    alpha: float = Field(
        0.4,
        gt=0,
        lt=1,
        description="weight of u_i in q = alpha u_i + (1 - alpha) u_j, in (0, 1), not 0.5",
        json_schema_extra={"not": {"const": 0.5}},  # checked by _check_alpha
    )
    init_std: float = init_std(0.02)

    @model_validator(mode="after")
    def _check_alpha(self) -> HierarchicalTable:
        if self.alpha == 0.5:
            raise cross_field_error(
                "alpha",
                "alpha = 0.5 makes position i*n + j equal to position j*n + i "
                "(q = (u_i + u_j) / 2 is symmetric); choose alpha in (0, 1) other than 0.5",
            )
        return self


class DepthwiseConvTable(SpecModel):
    """Positions generated from the tokens by a depthwise convolution (Chu et al. 2021,
    CPVT's position encoding generator, arXiv:2102.10882): p = DWConv(x), one kernel per
    feature, zero padding at the sequence edges (the only source of absolute position).

    ``same``: (k − 1)/2 zeros on each side, output i sees inputs i − (k−1)/2 … i + (k−1)/2
    (CPVT's PEG; k odd ≥ 3). ``causal``: k − 1 zeros on the left, output i sees inputs
    i − k + 1 … i only, so it can sit in a decoder (k ≥ 2). The kernel is a
    cross-correlation, as PyTorch's Conv1d: out_i = b + Σ_t w_t · x_(i + t − left).

    ``layout: grid_2d`` is CPVT's own form: the tokens are an H × W grid in row-major
    order (token r·W + c), given to ``embed`` as ``grid=(H, W)``, and the convolution is
    k × k with (k − 1)/2 zeros on every side.
    """

    kind: Literal["depthwise_conv"]
    kernel_size: int = Field(
        ge=2,
        le=1024,
        description="kernel width k, 2 to 1024 (CPVT 3, wav2vec 2.0 128; grid_2d: at most "
        "63, a k x k kernel): one kernel of k (grid_2d: k^2) floats per feature",
    )
    padding: Literal["same", "causal"]
    bias: bool = True
    layout: Literal["sequence", "grid_2d"] = "sequence"

    @model_validator(mode="after")
    def _check_kernel(self) -> DepthwiseConvTable:
        if self.layout == "grid_2d" and self.padding != "same":
            raise cross_field_error(
                "padding",
                "a 2-D grid has no causal order: grid_2d needs 'same' padding (CPVT's "
                "(k - 1)/2 zeros on every side)",
            )
        if self.layout == "grid_2d" and self.kernel_size > MAX_GRID_KERNEL:
            raise cross_field_error(
                "kernel_size",
                f"a grid_2d kernel has kernel_size^2 weights per feature: kernel_size is at "
                f"most {MAX_GRID_KERNEL} there (got {self.kernel_size})",
            )
        if self.padding == "same" and (self.kernel_size % 2 == 0 or self.kernel_size < 3):
            raise cross_field_error(
                "kernel_size",
                f"'same' padding centres the kernel on each token, so kernel_size must be "
                f"odd and at least 3 (got {self.kernel_size})",
            )
        return self


class OdeTable(SpecModel):
    """Positions from a learned continuous dynamical system (Liu et al. 2020, FLOATER,
    arXiv:2003.09229): p(t) solves dp/dt = h(p, t), p(0) = p_0, and position i gets
    p(i · position_step).

    h(p, t) = W_out [σ(W_in [p; t] + b_in); t] + b_out: a one-hidden-layer network with
    the time appended to the input of both layers (the authors' ``flow_func_linear``).
    The ODE is integrated with ``steps_per_position`` fixed steps of size
    position_step / steps_per_position by ``euler`` (first order) or ``rk4`` (classic
    fourth-order Runge-Kutta). ``initial``: p_0 is a trained vector (``learned``) or 0.
    ``max_positions`` is the integration horizon, required: integrating to position i
    takes i · steps_per_position steps (4 evaluations of h each with rk4) and keeps i
    states, so a caller-supplied position must have a bound; positions past it raise
    ValueError naming the bound.
    """

    kind: Literal["ode"]
    hidden: int = Field(
        ge=1,
        le=1 << 16,
        description="width of h's hidden layer, 1 to 65,536: h holds about "
        "2 x hidden x (model_dim + 1) trained floats",
    )
    activation: Literal["relu", "tanh", "gelu", "sigmoid"]
    integrator: Literal["euler", "rk4"]
    position_step: float = Field(
        gt=0,
        le=100,
        description="time between positions, in (0, 100] (FLOATER 0.1): the time enters h "
        "linearly, so p grows with it; larger steps overflow long before the horizon",
    )
    steps_per_position: int = Field(
        ge=1,
        le=1024,
        description="integration steps per position, 1 to 1024 (work per position)",
    )
    initial: Literal["learned", "zero"]
    max_positions: int = Field(
        ge=2,  # one position holds no distance: nothing to integrate or check
        le=MAX_ODE_POSITIONS,
        description=f"integration horizon, required, 2 to {MAX_ODE_POSITIONS:,} (2^16): "
        "integrating to position i takes i x steps_per_position steps and keeps i x "
        "model_dim floats (and, with autograd, every intermediate state), so the cost of "
        "any position the caller passes is bounded by this",
    )
    init_std: float = init_std(0.02)

    @model_validator(mode="after")
    def _bounded_integration(self) -> OdeTable:
        steps = self.max_positions * self.steps_per_position
        if steps > MAX_ODE_STEPS:
            raise cross_field_error(
                "steps_per_position",
                f"max_positions x steps_per_position = {self.max_positions:,} x "
                f"{self.steps_per_position:,} = {steps:,} sequential integration steps to "
                f"the horizon, past the limit of {MAX_ODE_STEPS:,} (2^18): the farthest "
                "position would take hours; use fewer steps or a nearer horizon",
            )
        return self


AbsoluteTable = Annotated[
    LearnedTable | SinusoidalTable | HierarchicalTable | DepthwiseConvTable | OdeTable,
    Field(discriminator="kind"),
]


class TableInput(SpecModel):
    """Input-level positions, combined with the token embeddings x feature by feature.

    ``add``: x + p (Vaswani et al. 2017; GPT-2, BERT). ``multiply``: x ⊙ p, each feature
    of x scaled by the position's table entry; a learned table then acts as a per-position
    gain (initialise it around 1 with ``init_mean: 1``), and a sinusoidal table modulates
    x by sin/cos waves: at position 0 every sine feature is 0, so x ⊙ p zeroes those
    features there (half of them) while the cosine features pass x unchanged.
    """

    kind: Literal["add", "multiply"]
    table: AbsoluteTable

    @model_validator(mode="after")
    def _multiply_needs_a_gain_table(self) -> TableInput:
        if self.kind == "multiply" and self.table.kind not in ("learned", "sinusoidal"):
            raise cross_field_error(
                "kind",
                f"a {self.table.kind!r} table starts near zero or reads the content itself, "
                "so x * p would erase the tokens: 'multiply' takes a 'learned' table "
                "(init_mean 1) or a 'sinusoidal' one; use 'add' here",
            )
        return self


class ComplexOrderInput(SpecModel):
    """Complex word-order embeddings (Wang et al. 2020, arXiv:1912.12333, eq. 3).

    Each feature d of the token at position pos is r_d · exp(i(ω_d · pos + θ_d)) with
    a per-token amplitude r (the caller's token embedding), frequency ω and phase θ.
    The module cannot own a vocabulary, so ω and θ come from the caller per token, or,
    with ``module_parameters: learned_per_feature``, from the module's own per-feature
    ω [model_dim] (initialised to frequency_base^(−d / model_dim)) and θ (zeros),
    used whenever the caller passes none.
    """

    kind: Literal["complex_order"]
    module_parameters: Literal["learned_per_feature", "none"]
    frequency_base: float | None = Field(
        None,
        gt=1,
        le=MAX_BASE,
        description=f"initial omega_d = frequency_base^(-d / model_dim), in (1, {MAX_BASE:g}]: "
        "a base of 1 or less gives no decreasing frequencies",
    )

    @model_validator(mode="after")
    def _check_frequency_base(self) -> ComplexOrderInput:
        learned = self.module_parameters == "learned_per_feature"
        if learned and self.frequency_base is None:
            raise cross_field_error(
                "frequency_base",
                "learned per-feature frequencies need frequency_base (their initial values "
                "are frequency_base^(-d / model_dim))",
            )
        if not learned and self.frequency_base is not None:
            raise cross_field_error(
                "frequency_base",
                "frequency_base initialises the module's own frequencies; with "
                "module_parameters: none there are none",
            )
        return self


InputForm = Annotated[TableInput | ComplexOrderInput, Field(discriminator="kind")]
