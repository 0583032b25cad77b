"""Query scales: each query vector multiplied by a factor of its own position.

Some long-context models sharpen attention as the context grows by scaling the query
at position i by a factor tau(i) >= 1 before any term reads it, so that the terms
linear in the query (content_content, a relative content_position) are multiplied by
tau(i), while terms of positions alone are not (CoPE's gates read the scaled query
too). Rotations commute with the factor (R(i)(tau q) = tau R(i) q), so it applies
before or after a rotation alike.
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


QueryScale = Annotated[FloorLogQueryScale | LogLengthQueryScale, Field(discriminator="kind")]
AnyQueryScale = FloorLogQueryScale | LogLengthQueryScale
