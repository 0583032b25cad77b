"""The module contract as the checker sees it: what an encoding module offers, typed.

The checker drives a module through its public contract only (docs/design.md §4):
``embed``, ``rotate``, ``score_bias``, ``scores`` and ``forward`` (calling the module),
``rotate_keys`` where ``has_rotation`` is set, plus its sizes ``heads``, ``head_dim``
and, for input-level encodings, ``model_dim``.
Generated modules and hand-written ones alike are duck-typed: ``Encoding`` is a
``Protocol`` that names the contract for the type checker; nothing is verified at runtime,
so a module that lacks a method fails where the method is used (reported as an error).

Also here: float64 widening (``to_float64``: complex tensors stay complex) and the
``Content`` triple every property draws (queries, keys, values).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypedDict, cast

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from typing_extensions import Unpack

F64 = torch.float64

# (queries or their token embeddings, keys or their token embeddings, values)
Content = tuple[Tensor, Tensor, Tensor]


class ForwardOptions(TypedDict, total=False):
    """The keyword options of ``forward`` the checker passes (each one only when set)."""

    causal: bool
    attn_mask: Tensor
    backend: str
    keys_rotated: bool


class Encoding(Protocol):
    """The public contract of an encoding module (``model_dim``: input-level ones only)."""

    heads: int
    head_dim: int
    model_dim: int

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        **options: Unpack[ForwardOptions],
    ) -> Tensor:
        """Attention output [batch, heads, N, head_dim]."""
        ...

    def embed(
        self, x: Tensor, positions: Tensor | None = None
    ) -> Tensor | tuple[Tensor, ...] | list[Tensor]:
        """The input-level part: one tensor, or several parts (e.g. real and imaginary)."""
        ...

    def rotate(
        self,
        q: Tensor,
        k: Tensor,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The rotary part: rotated queries and keys."""
        ...

    def rotate_keys(self, k: Tensor, positions: Tensor | None = None) -> Tensor:
        """Keys rotated once for a cache (decode); used where ``has_rotation`` is set."""
        ...

    def score_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """The position-only bias [heads, N, M], or None where there is none."""
        ...

    def scores(
        self,
        q: Tensor,
        k: Tensor,
        *,
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
    ) -> Tensor:
        """Pre-softmax logits [batch, heads, N, M]."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The module's parameters (``nn.Module.parameters``)."""
        ...


def as_encoding(module: nn.Module) -> Encoding:
    """The module seen through its contract (typing only: nothing is checked here)."""
    return cast(Encoding, module)


def to_float64(module: nn.Module) -> nn.Module:
    """Real floating tensors to float64 and complex ones to complex128, in place
    (``Module.to(torch.float64)`` would drop the imaginary part of complex tensors)."""

    def widen(tensor: Tensor) -> Tensor:
        if tensor.is_complex():
            return tensor.to(torch.complex128)
        return tensor.to(F64) if tensor.is_floating_point() else tensor

    return module._apply(widen)


def content_as(content: Content, dtype: torch.dtype) -> Content:
    """Every tensor of ``content`` converted to ``dtype``."""
    q, k, v = content
    return q.to(dtype), k.to(dtype), v.to(dtype)
