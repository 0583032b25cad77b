"""Query scales: each query vector multiplied by a factor of its own position.

Some long-context models sharpen attention as the context grows by scaling the query
at position i by a factor tau(i) (per head, where it is trained) before any term reads
it, so that the terms linear in the query (content_content, a relative
content_position) are multiplied by tau(i), while terms of positions alone are not
(CoPE's gates read the scaled query too). Rotations commute with the factor
(R(i)(tau q) = tau R(i) q), so it applies before or after a rotation alike.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from posgen.spec.model.base import SpecModel

MAX_QUERY_SCALE_LENGTH = 1 << 22
"""Largest floor_scale or original_max_positions of a query scale (published: 2,048 to
8,192): ``posgen check`` shifts positions past four times it, up to its limit of 2^24."""
MAX_ATTN_SCALE = 10.0
"""Largest attn_scale of the floor-log scale (Llama 4: 0.1)."""


class FloorLogQueryScale(SpecModel):
    """Llama 4's attention temperature tuning (Meta 2025, on its NoPE layers, after
    Nakanishi 2025, Scalable-Softmax, arXiv:2501.19399), as Hugging Face's
    Llama4TextAttention applies it:

        tau(i) = 1 + attn_scale * ln(1 + floor((i + 1) / floor_scale))

    so tau is 1 for the first floor_scale - 1 positions and grows by steps of
    floor_scale positions, logarithmically, after them.
    """

    kind: Literal["llama4"]
    floor_scale: int = Field(
        8192,
        ge=1,
        le=MAX_QUERY_SCALE_LENGTH,
        description=f"positions per step of the factor, in [1, {MAX_QUERY_SCALE_LENGTH:,}] "
        "(Llama 4: 8192)",
    )
    attn_scale: float = Field(
        0.1,
        gt=0,
        le=MAX_ATTN_SCALE,
        description=f"the factor's growth per unit of ln(1 + steps), in (0, {MAX_ATTN_SCALE:g}] "
        "(Llama 4: 0.1)",
    )


class LogLengthQueryScale(SpecModel):
    """Log-length scaling (Chiang and Cholak 2022, arXiv:2202.12172; Qwen's LogN-Scaling,
    Bai et al. 2023, arXiv:2309.16609), as Qwen's ``use_logn_attn`` applies it:

        tau(i) = max(1, ln(i + 1) / ln(original_max_positions))

    so tau is 1 within the training length and grows as the log of the context past it,
    keeping the softmax's entropy roughly level as the keys multiply. Qwen's code scales
    in evaluation mode only; a model trained within original_max_positions has tau = 1
    in training either way, and the generated module scales in both modes.
    """

    kind: Literal["log_length"]
    original_max_positions: int = Field(
        ge=2,
        le=MAX_QUERY_SCALE_LENGTH,
        description=f"the context length the model was trained with, in "
        f"[2, {MAX_QUERY_SCALE_LENGTH:,}]: tau is 1 up to it (Qwen's seq_length)",
    )


MAX_SCALABLE_SOFTMAX_INIT = 10.0
"""Largest starting s of Scalable-Softmax (s ln n multiplies the logits)."""


class ScalableSoftmaxQueryScale(SpecModel):
    """Scalable-Softmax, SSMax (Nakanishi 2025, arXiv:2501.19399): the softmax over the
    n keys a query sees takes its logits times s ln n, with s trained per head. For a
    causal query at position i (positions from 0) n = i + 1, so

        tau_h(i) = s_h * ln(i + 1)

    multiplies the query of head h; s_h starts at ``init`` and is trained (the module's
    ``query_scale_per_head`` [heads]). The query at position 0 gets tau = 0 (one key to
    see under causal attention; without a causal mask its keys weigh alike). SSMax over
    the M keys of a non-causal call (n = M for every query) is not a query scale by
    position and is not what this states.
    """

    kind: Literal["ssmax"]
    init: float = Field(
        gt=0,
        le=MAX_SCALABLE_SOFTMAX_INIT,
        description=f"every head's s at initialisation, in (0, {MAX_SCALABLE_SOFTMAX_INIT:g}]",
    )


QueryScale = Annotated[
    FloorLogQueryScale | LogLengthQueryScale | ScalableSoftmaxQueryScale,
    Field(discriminator="kind"),
]
AnyQueryScale = FloorLogQueryScale | LogLengthQueryScale | ScalableSoftmaxQueryScale
