"""Growing a mixture-of-experts layer: where each expert of a larger layer comes from when a
checkpoint with fewer experts loads into it (:func:`grown_order`; ``moe.grow_at_step`` grows a
run through the same load, :mod:`turbotrain.app.experts_growth`) and the grown tensors."""

from __future__ import annotations

import torch

GROW_NOISE = 0.01  # new experts: a copy of an existing one plus noise of this x the tensor's std


def grown_order(old: int, new: int, ranks: int = 1) -> list[tuple[int, bool]]:
    """Where each of ``new`` experts comes from when a layer with ``old`` experts grows (a
    checkpoint with fewer loading into a layer with more, or ``moe.grow_at_step`` in a run):
    ``(source expert, is_new)`` per position. Positions are dealt to ``ranks`` contiguous slices of
    ``new / ranks`` (the expert-parallel layout). The old experts stay on the rank of their old
    contiguous slice when ``old`` divides over the ranks (no expert moves), else each goes to the
    rank holding the fewest so far; then each new expert goes to the rank holding the fewest so far
    (ties: the lowest rank). New expert i copies old expert ``i mod old``."""
    per_rank = new // ranks
    held: list[list[tuple[int, bool]]] = [[] for _ in range(ranks)]
    if old % ranks == 0:  # where they live now: rank r holds old experts [r old/ranks, (r + 1) old/ranks)
        for r in range(ranks):
            held[r] = [(e, False) for e in range(r * old // ranks, (r + 1) * old // ranks)]
    else:
        for e in range(old):
            min(held, key=len).append((e, False))
    for i in range(new - old):
        min(held, key=len).append((i % old, True))  # min() takes the first (lowest) rank among the fewest
    assert all(len(h) == per_rank for h in held)
    return [item for h in held for item in h]


def new_positions(order: list[tuple[int, bool]]) -> list[int]:
    """The positions of the new experts in a :func:`grown_order`."""
    return [i for i, (_, is_new) in enumerate(order) if is_new]


def grown_loads(loads: list[int], order: list[tuple[int, bool]]) -> list[int]:
    """Per-expert figures before growing (old numbering) in the grown numbering, 0 for new experts."""
    return [0 if is_new else loads[src] for src, is_new in order]


def regrown(loads: list[int], n_experts: int, ranks: int) -> list[int]:
    """A layer's per-expert figures in its numbering now (:func:`grown_loads` when it grew since)."""
    if len(loads) >= n_experts or not loads:
        return loads
    return grown_loads(loads, grown_order(len(loads), n_experts, ranks))


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
