"""Ops that torch.compile does not trace into: a tensor made its own buffer.

Inductor fuses pointwise work into whatever reads it. Two readers need it computed
once instead: a rotation's cos and sin tables (fused into every element of q and k, a
compiled ``rope`` ran 7.3x a copy), and every tensor a FlexAttention score_mod or
mask_mod captures on the CPU (inductor's CPU flex lowering of torch 2.13 registers
them before it realizes them and fails on one still fused: "NoValidChoicesError",
"Pointwise").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _materialize_op() -> Any:
    """The custom op ``posgen::materialize``: a copy that torch.compile cannot see
    into, so inductor computes its input once, as its own buffer, and fuses nothing
    across it. Registered once per process (a standalone module's inlined runtime finds
    the one already there)."""
    if hasattr(torch.ops.posgen, "materialize"):
        return torch.ops.posgen.materialize
    op = torch.library.custom_op(
        "posgen::materialize", mutates_args=(), schema="(Tensor x) -> Tensor"
    )(lambda x: x.clone())
    op.register_fake(lambda x: torch.empty_like(x))
    op.register_autograd(lambda ctx, grad: grad)
    return op


_MATERIALIZE = _materialize_op()


def opaque_copy(t: Tensor) -> Tensor:
    """A copy of ``t`` that a torch.compile graph holds as its own buffer (one call of
    ``posgen::materialize``, 15-25 us on the host of a 2-core CPU); differentiable,
    the gradient passing through unchanged."""
    return _MATERIALIZE(t)
