"""Ops that torch.compile does not trace into: a tensor made its own buffer.

Inductor fuses pointwise work into whatever reads it. Some readers need it computed
once instead: a rotation's cos and sin tables (fused into every element of q and k, a
compiled ``rope`` ran 7.3x a copy), and, on the CPU, where inductor's C++ code of
torch 2.13 gets two fusions wrong, the tensors a FlexAttention score_mod or mask_mod
captures and a learned table's rows shared by every head (``own_buffer_on_cpu``).
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
    # the gradient passes the same barrier, so a traced backward fuses nothing across
    # it either
    op.register_autograd(lambda ctx, grad: _MATERIALIZE(grad))
    return op


_MATERIALIZE = _materialize_op()


def opaque_copy(t: Tensor) -> Tensor:
    """A copy of ``t`` that a torch.compile graph holds as its own buffer (one call of
    ``posgen::materialize``, 15-25 us on the host of a 2-core CPU); differentiable, the
    gradient copied back the same way."""
    return _MATERIALIZE(t)


def own_buffer_on_cpu(t: Tensor) -> Tensor:
    """``t`` as its own buffer (``opaque_copy``) when torch.compile traces it on the CPU,
    else ``t`` itself. Inductor's CPU code (torch 2.13) miscompiled two fusions that
    this keeps apart:

    - FlexAttention took the tensors a score_mod or mask_mod captures only as buffers
      of their own: ALiBi's slopes, T5's clipped vector, positions or projections made
      in the graph failed to compile ("NoValidChoicesError", "Pointwise"), a view of one
      too ("All the buffers in the score and mask subgraph should be in
      kernel_group.args.input_buffers"), and so did q and k rotated by interleaved pairs,
      a view of a 5-D buffer ("too many values to unpack"): each passes this in
      ``_flex.py`` and the bias blocks;
    - the backward of a learned table's rows expanded over the heads (BERT's
      relative_key_query) summed the heads and scatter-added the rows into the table's
      gradient in one vectorised loop whose scatter index stepped two features at a
      time: the gradient into ``distance_embedding`` was off by its own size, forward
      outputs and the gradients into q, k and v right. With the barrier the sum and the
      scatter are two kernels, and the gradient matches eager mode's.
    """
    if t.device.type == "cpu" and torch.compiler.is_compiling():
        return opaque_copy(t)
    return t
