"""Mixture-of-experts observability: tokens per expert over training and where each expert lives.

The MoE layers count their routed tokens in device tensors (no host sync); this hook reads them all
with one copy every ``monitor.log_every`` steps, sums them over the ranks, and keeps the history,
which rank 0 writes to ``experts.json`` (turned into plots and a summary section by
:mod:`turbotrain.app.expert_report`; docs/moe.md). ``load[layer][expert]``: assignments routed there
in the window; ``max_mean``: max / mean over experts, averaged over MoE layers (1.0 = even)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base.atomic import atomic_write
from ..base.rundir import EXPERTS_FILE
from ..core.process_group import rank_world
from ..parts.models.moe import MoE, grown_order, moe_layers, new_positions, regrown
from .hooks import FitContext, Hook, every

log = logging.getLogger(__name__)


def max_mean(load: Sequence[float]) -> float | None:
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean if mean > 0 else None


def placement(model: nn.Module) -> dict[str, Any]:
    """Which rank holds which experts (the same split in every MoE layer): ``ranks[r]`` lists the
    expert ids on rank r of the expert-parallel group of size ``ep_degree``."""
    layers = [m for _, m in moe_layers(model)]
    world = rank_world()[1]
    if not layers:
        return {"ep_degree": 1, "world": world, "ranks": []}
    first = layers[0]
    ep = first.n_experts // first.n_local
    ranks = [list(range(r * first.n_local, (r + 1) * first.n_local)) for r in range(ep)]
    return {"ep_degree": ep, "world": world, "ranks": ranks}


class ExpertsMonitor(Hook):
    """Reads the MoE layers' token tallies every ``interval`` steps; rank 0 writes ``experts.json``."""

    def __init__(self, model: nn.Module, interval: int, run_dir: Path | None = None) -> None:
        self.layers: list[tuple[str, MoE]] = list(moe_layers(model))
        self.interval, self.run_dir = interval, run_dir
        first = self.layers[0][1] if self.layers else None
        self.meta: dict[str, Any] = {
            "n_experts": first.n_experts if first else 0,
            "top_k": first.top_k if first else 0,
            "layers": [name for name, _ in self.layers],
            "placement": placement(model),
        }
        self.history: list[dict[str, Any]] = []

    def on_fit_start(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        path = self.run_dir / EXPERTS_FILE if self.run_dir else None
        # a resume: keep the windows up to the checkpoint
        if step > 0 and path is not None and path.is_file():
            try:
                saved = json.loads(path.read_text())
                self.history = [h for h in saved["history"] if h["step"] <= step]
                self.meta["grown"] = [g for g in saved.get("grown", []) if g["step"] <= step]
            except (ValueError, KeyError, TypeError):
                log.warning("%s is unreadable; the expert-load history restarts at step %d", path, step)
        # experts grown at this start (moe.grow_at_step, a resume with more): earlier windows in the new numbering
        for h in self.history:
            h["load"] = [
                regrown(row, m.n_experts, m.n_experts // m.n_local)
                for row, (_, m) in zip(h["load"], self.layers)
            ]
        first = self.layers[0][1] if self.layers else None
        if first is not None and first.grew_from:
            order = grown_order(first.grew_from, first.n_experts, first.n_experts // first.n_local)
            self.meta.setdefault("grown", []).append(
                {"step": step, "from": first.grew_from, "to": first.n_experts, "new": new_positions(order)}
            )
        for _, layer in self.layers:  # counts from before the first step (a batch search) are not training's
            layer.take_load()

    def read(self, step: int) -> dict[str, Any] | None:
        """The window since the last read, summed over ranks: {step, load, dropped, max_mean}."""
        taken = [layer.take_load() for _, layer in self.layers]
        if not self.layers or any(t is None for t in taken):
            return None
        counts = torch.stack([torch.cat([load.float(), dropped.float()[None]]) for load, dropped in taken])
        if rank_world()[1] > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # every rank routed its own tokens
        rows = counts.cpu().tolist()  # sync: one copy of every layer's tallies, at the logging cadence
        load = [[int(v) for v in row[:-1]] for row in rows]
        ratios = [r for r in (max_mean(row) for row in load) if r is not None]
        entry = {
            "step": step,
            "load": load,
            "dropped": [int(row[-1]) for row in rows],
            "max_mean": sum(ratios) / len(ratios) if ratios else None,
        }
        self.history.append(entry)
        return entry

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if every(step, self.interval):
            entry = self.read(step)
            if entry is not None and entry["max_mean"] is not None:
                ctx.metrics["expert_max_mean"] = entry["max_mean"]

    def on_fit_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if not self.history or self.history[-1]["step"] != step:
            self.read(step)
        self.write()

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        try:
            self.write()
        except OSError as err:  # the error on its way is the one to report
            log.warning("expert-load history not written: %s", err)

    def write(self) -> None:
        if self.run_dir is None or not self.layers:
            return
        atomic_write(self.run_dir / EXPERTS_FILE, json.dumps({**self.meta, "history": self.history}) + "\n")


def experts_hooks(model: nn.Module, interval: int, run_dir: Path | None) -> list[Hook]:
    return [ExpertsMonitor(model, interval, run_dir)] if any(True for _ in moe_layers(model)) else []
