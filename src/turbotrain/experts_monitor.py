"""Mixture-of-experts observability: tokens per expert over training and where each expert lives.

Why a hook of its own: the MoE layers count their routed tokens in device tensors on every
training forward (:attr:`turbotrain.models.moe.MoEMLP.load`, no host sync); this hook reads all of
them with one copy every ``monitor.log_every`` steps (the run's one sync cadence), sums them over
the ranks when there are several (each rank routed its own tokens), and keeps the history. Rank 0
writes it to ``experts.json`` in the run directory at the end (and on a failure), which the report
turns into ``plots/expert_load.png`` (each expert's share of the routed tokens over training, and
the max/mean load that load balancing drives towards 1) and ``plots/expert_placement.png``
(which rank holds which expert), and a section of summary.json / summary.md.

Load figures: ``load[layer][expert]`` = assignments (token x top-k slots) routed there in the
window; ``max_mean`` = max over experts / mean over experts, averaged over MoE layers (1.0 =
perfectly even; E = every token on one expert).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .atomic import atomic_write
from .distributed import rank_world
from .hooks import FitContext, Hook, every
from .models.moe import MoEMLP, moe_layers

log = logging.getLogger(__name__)

EXPERTS_FILE = "experts.json"  # in the run directory, next to metrics.jsonl
LOAD_PLOT, PLACEMENT_PLOT = "expert_load.png", "expert_placement.png"


def max_mean(load: list[float]) -> float | None:
    """max / mean of one layer's per-expert load; None when nothing was routed."""
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean if mean > 0 else None


def placement(model: nn.Module) -> dict[str, Any]:
    """Which rank holds which experts (the same split in every MoE layer): ``ranks[r]`` lists the
    expert ids on rank r of the expert-parallel group, ``ep_degree`` the group's size, ``world``
    all ranks (the groups repeat: rank r holds what rank r mod ep_degree holds)."""
    layers = [m for _, m in moe_layers(model)]
    world = rank_world()[1]
    if not layers:
        return {"ep_degree": 1, "world": world, "ranks": []}
    first = layers[0]
    ep = first.n_experts // first.n_local
    ranks = [list(range(r * first.n_local, (r + 1) * first.n_local)) for r in range(ep)]
    return {"ep_degree": ep, "world": world, "ranks": ranks}


class ExpertsMonitor(Hook):
    """Reads the MoE layers' token tallies every ``interval`` steps (one device->host copy, marked
    ``# sync``) and writes ``experts.json`` to ``run_dir`` (rank 0; None: keep in memory only)."""

    def __init__(self, model: nn.Module, interval: int, run_dir: Path | None = None) -> None:
        self.layers: list[tuple[str, MoEMLP]] = list(moe_layers(model))
        self.interval, self.run_dir = interval, run_dir
        first = self.layers[0][1] if self.layers else None
        self.meta = {
            "n_experts": first.n_experts if first else 0,
            "top_k": first.top_k if first else 0,
            "layers": [name for name, _ in self.layers],
            "placement": placement(model),
        }
        self.history: list[dict[str, Any]] = []

    def on_fit_start(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        path = self.run_dir / EXPERTS_FILE if self.run_dir else None
        if step > 0 and path is not None and path.is_file():  # a resume: keep the windows up to the checkpoint
            try:
                self.history = [h for h in json.loads(path.read_text())["history"] if h["step"] <= step]
            except (ValueError, KeyError, TypeError):
                log.warning("%s is unreadable; the expert-load history restarts at step %d", path, step)
        for _, layer in self.layers:  # counts from before the first step (a batch search) are not training's
            layer.take_load()

    def read(self, step: int) -> dict[str, Any] | None:
        """The window since the last read, summed over ranks: {step, load, dropped, max_mean}."""
        taken = [layer.take_load() for _, layer in self.layers]
        if not self.layers or any(t is None for t in taken):
            return None
        counts = torch.stack([torch.cat([load.float(), dropped.float()[None]]) for load, dropped in taken])  # type: ignore[misc]
        if rank_world()[1] > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)  # every rank routed its own tokens
        rows = counts.cpu().tolist()  # sync: one copy of every layer's tallies, at the logging cadence
        load = [[int(v) for v in row[:-1]] for row in rows]
        ratios = [r for r in (max_mean(row) for row in load) if r is not None]
        entry = {"step": step, "load": load, "dropped": [int(row[-1]) for row in rows],
                 "max_mean": sum(ratios) / len(ratios) if ratios else None}
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


# ----------------------------------------------------------------------------- report


def read_experts(run_dir: Path) -> dict[str, Any] | None:
    """A run's experts.json, or None when it has none (not a MoE run) or it cannot be read."""
    path = run_dir / EXPERTS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("history"), list) else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The summary section: layout, the first and last windows' max/mean load, tokens per expert
    over the run (all layers), dropped share."""
    history = [h for h in data["history"] if h.get("load")]
    total = [0] * data.get("n_experts", 0)
    routed = dropped = 0
    for h in history:
        for row in h["load"]:
            total = [a + (row[e] if e < len(row) else 0) for e, a in enumerate(total)]  # fewer before a growth
            routed += sum(row)
        dropped += sum(h.get("dropped", []))
    ratios = [h["max_mean"] for h in history if h.get("max_mean") is not None]
    return {
        "n_experts": data.get("n_experts"), "top_k": data.get("top_k"), "moe_layers": len(data.get("layers", [])),
        "placement": data.get("placement"),
        "max_mean_first": ratios[0] if ratios else None, "max_mean_last": ratios[-1] if ratios else None,
        "max_mean_best": min(ratios) if ratios else None,
        "assignments_per_expert": total, "dropped_fraction": dropped / routed if routed else 0.0,
    }


def markdown(section: dict[str, Any] | None) -> list[str]:
    """summary.md lines for the experts section (none for a run without experts)."""
    if not section:
        return []

    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    p = section.get("placement") or {}
    return ["", "## Experts", "",
            f"- {section['n_experts']} experts, top-{section['top_k']}, in {section['moe_layers']} MoE blocks; "
            f"expert parallel degree {p.get('ep_degree', 1)} over {p.get('world', 1)} rank(s)",
            f"- load max/mean (1.0 = even): first window {f(section['max_mean_first'])}, "
            f"last {f(section['max_mean_last'])}, best {f(section['max_mean_best'])}",
            f"- assignments per expert over the run: {section['assignments_per_expert']}",
            f"- dropped by the capacity: {100 * section['dropped_fraction']:.2f}%"]


def write_plots(data: dict[str, Any], out_dir: Path, subtitle: str = "") -> list[str]:
    """plots/expert_load.png and plots/expert_placement.png; returns the files written (relative
    to the run directory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = [h for h in data["history"] if h.get("load") and sum(map(sum, h["load"]))]
    written: list[str] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    if history:
        steps = [h["step"] for h in history]
        n = data["n_experts"]
        # windows before a resume that grew the experts have fewer of them: the new ones had none
        shares = [[sum(row[e] for row in h["load"] if e < len(row)) / max(sum(map(sum, h["load"])), 1) for h in history]
                  for e in range(n)]
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), dpi=110, sharex=True, height_ratios=(3, 2))
        fig.subplots_adjust(hspace=0.25)
        cmap = plt.get_cmap("tab20" if n > 10 else "tab10")
        ax.stackplot(steps, shares, labels=[f"expert {e}" for e in range(n)], colors=[cmap(e % cmap.N) for e in range(n)])
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of routed tokens\n(all MoE blocks)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=min(n, 8), fontsize=7, frameon=False)
        ratios = [(h["step"], h["max_mean"]) for h in history if h.get("max_mean") is not None]
        if ratios:
            ax2.plot(*zip(*ratios), marker="." if len(ratios) <= 40 else None, color="tab:red")
        ax2.axhline(1.0, color="gray", ls="--", lw=1)
        ax2.set_ylabel("max / mean load\n(1.0 = even)")
        ax2.set_xlabel("optimizer step")
        ax2.grid(True, alpha=0.3)
        ax.set_title(f"Expert load over training (top-{data['top_k']} of {n})" + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
        atomic_write(out_dir / LOAD_PLOT, lambda fh: fig.savefig(fh, format="png", bbox_inches="tight"))
        plt.close(fig)
        written.append(f"{out_dir.name}/{LOAD_PLOT}")
    p = data.get("placement") or {}
    ranks = p.get("ranks") or []
    if ranks:
        n = data["n_experts"]
        grid = [[1.0 if e in held else 0.0 for e in range(n)] for held in ranks]
        fig, ax = plt.subplots(figsize=(max(5, 0.5 * n + 2), max(2.2, 0.5 * len(ranks) + 1.5)), dpi=110)
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=1.4, aspect="auto")
        for r, held in enumerate(ranks):
            for e in held:
                ax.text(e, r, str(e), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(n))
        ax.set_yticks(range(len(ranks)))
        ax.set_yticklabels([f"rank {r}" for r in range(len(ranks))])
        ax.set_xlabel("expert")
        repeat = p.get("world", 1) // max(len(ranks), 1)
        note = f" (x{repeat} data-parallel copies)" if repeat > 1 else ""
        ax.set_title(f"Expert placement: expert-parallel degree {len(ranks)}{note}" + (f"\n{subtitle}" if subtitle else ""), fontsize=11)
        atomic_write(out_dir / PLACEMENT_PLOT, lambda fh: fig.savefig(fh, format="png", bbox_inches="tight"))
        plt.close(fig)
        written.append(f"{out_dir.name}/{PLACEMENT_PLOT}")
    return written


def experts_hooks(model: nn.Module, interval: int, run_dir: Path | None) -> list[Hook]:
    """``[ExpertsMonitor]`` for a model with MoE layers, ``[]`` otherwise (what training adds)."""
    return [ExpertsMonitor(model, interval, run_dir)] if any(True for _ in moe_layers(model)) else []
