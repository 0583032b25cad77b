"""Autograd nodes with a first derivative only, that say so when asked for a second.

``torch.autograd.function.once_differentiable`` leaves a double backward silently
wrong: the node it puts on the gradient hangs off detached copies, so a gradient of
that gradient with respect to q, k, v or a parameter skips the attention's second
derivative (None, or the other paths' terms alone), with no error. Plain SDPA's CPU
flash kernel raises there instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def first_order_only(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A custom Function's ``backward`` run as ``once_differentiable`` does (under
    no_grad), raising RuntimeError where the backward builds a graph for a second
    derivative (``create_graph=True``, under which autograd runs it in grad mode)."""
    first_order = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            node = type(ctx).__name__.removesuffix("Backward").lstrip("_")
            raise RuntimeError(
                f"posgen's {node} path has no double backward (a gradient taken with "
                'create_graph=True): call the module with backend="eager" for '
                "second-order gradients"
            )
        return first_order(ctx, *grads)

    return wrapper
