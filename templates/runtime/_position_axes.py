"""Rotary embeddings over several position axes: the axis each rotated pair reads.

M-RoPE (Wang et al. 2024, Qwen2-VL, arXiv:2409.12191) and axial RoPE (Heo et al. 2024,
arXiv:2403.13298) give every token one position per axis (time, height, width; or row,
column), and each rotated pair k turns by the position on the axis that owns it:

    angle_k = positions[owner(k)] * theta_k

The axes own runs of pairs in axis order (Qwen2-VL, axial RoPE), or pairs dealt out in
turn (Qwen3-VL's interleaved M-RoPE), so that every axis spans the whole range of
frequencies.
"""

from __future__ import annotations

import torch
from torch import Tensor


def angles_by_axis(angles: Tensor, sections: tuple[int, ...], interleaved: bool) -> Tensor:
    """Each pair's angle from the axis that owns it.

    angles: [axes, ..., pairs] (axis a's positions times every theta_k) -> [..., pairs].
    ``sections[a]`` pairs belong to axis a: the a-th run of pairs, or where
    ``interleaved`` the pairs dealt out in turn, as Hugging Face's apply_interleaved_mrope:
    axis a >= 1 of n owns pairs a, a + n, ..., a + n (sections[a] - 1) and axis 0 every
    other pair (Qwen3-VL's (24, 20, 20): T H W T H W ... T H W T T T T). The spec checks
    that each such run fits (``interleaved_shortfall``). The owners are selected on
    angles' device, from no host data: no copy to the device, so no sync.
    """
    if not interleaved:
        runs = angles.split(list(sections), dim=-1)  # run a: [axes, ..., sections[a]]
        return torch.cat([run[axis] for axis, run in enumerate(runs)], dim=-1)
    count = len(sections)
    pair = torch.arange(angles.shape[-1], device=angles.device)  # [pairs]
    dealt = angles[0]  # [..., pairs]
    for axis in range(1, count):
        owned = (pair % count == axis) & (pair < count * sections[axis])  # [pairs]
        dealt = torch.where(owned, angles[axis], dealt)
    return dealt
