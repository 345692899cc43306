"""Growing a mixture-of-experts layer: where each expert of a larger layer comes from when a
checkpoint with fewer experts loads into it (:func:`grown_order`), and the grown tensors
(:func:`grow_experts`). The layer applies them on load (``MoE._grow_on_load``); expert parallelism
applies them to a one-process checkpoint's optimizer state."""

from __future__ import annotations

import torch

GROW_NOISE = 0.01  # new experts: a copy of an existing one plus noise of this x the tensor's std


def grown_order(old: int, new: int, ranks: int = 1) -> list[tuple[int, bool]]:
    """Where each of ``new`` experts comes from when a checkpoint with ``old`` experts loads into a
    model with more: ``(source expert, is_new)`` per position. Positions are dealt to ``ranks``
    contiguous slices of ``new / ranks`` (the expert-parallel layout); each old expert, then each
    new one, goes to the rank holding the fewest so far (ties: the lowest rank), so the copies
    spread over the ranks. New expert i copies old expert ``i mod old``."""
    per_rank = new // ranks
    held: list[list[tuple[int, bool]]] = [[] for _ in range(ranks)]
    for item in [(e, False) for e in range(old)] + [(i % old, True) for i in range(new - old)]:
        min(held, key=len).append(item)  # min() takes the first (lowest) rank among the fewest
    assert all(len(h) == per_rank for h in held)
    return [item for h in held for item in h]


def grow_experts(
    tensor: torch.Tensor, order: list[tuple[int, bool]], noise: float, seed: int
) -> torch.Tensor:
    """``tensor`` (old experts first dim) laid out by ``order``; new rows get ``noise`` x std noise."""
    g = torch.Generator().manual_seed(seed)
    rows = tensor[[src for src, _ in order]].clone()
    if noise > 0:
        scale = noise * float(tensor.float().std()) if tensor.numel() > 1 else 0.0
        for i, (_, is_new) in enumerate(order):
            if is_new:
                rows[i] += (scale * torch.randn(rows[i].shape, generator=g)).to(rows.dtype)
    return rows
