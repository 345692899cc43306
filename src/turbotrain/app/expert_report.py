"""The mixture-of-experts part of a run's report: ``experts.json`` turned into two plots and the
Experts section of the summary (out of the hook's module: it runs once afterwards, with matplotlib).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write
from ..base.rundir import EXPERTS_FILE
from ..core.meter.table import figure

LOAD_PLOT, PLACEMENT_PLOT = "expert_load.png", "expert_placement.png"


def read_experts(run_dir: Path) -> dict[str, Any] | None:
    """A run's experts.json, or None when it has none (not a MoE run) or it cannot be read."""
    path = run_dir / EXPERTS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("history"), list) else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The summary section: layout, max/mean load, tokens per expert over the run, dropped share."""
    history = [h for h in data["history"] if h.get("load")]
    total = [0] * data.get("n_experts", 0)
    routed = dropped = 0
    for h in history:
        for row in h["load"]:
            # fewer before a growth
            total = [a + (row[e] if e < len(row) else 0) for e, a in enumerate(total)]
            routed += sum(row)
        dropped += sum(h.get("dropped", []))
    ratios = [h["max_mean"] for h in history if h.get("max_mean") is not None]
    return {
        "n_experts": data.get("n_experts"),
        "top_k": data.get("top_k"),
        "moe_layers": len(data.get("layers", [])),
        "placement": data.get("placement"),
        "max_mean_first": ratios[0] if ratios else None,
        "max_mean_last": ratios[-1] if ratios else None,
        "max_mean_best": min(ratios) if ratios else None,
        "assignments_per_expert": total,
        "dropped_fraction": dropped / routed if routed else 0.0,
    }


def markdown(section: dict[str, Any] | None) -> list[str]:
    """summary.md lines for the experts section (none for a run without experts)."""
    if not section:
        return []
    f = partial(figure, form=".3f", missing="n/a")  # the report's missing figure (report._fmt)
    p = section.get("placement") or {}
    return [
        "",
        "## Experts",
        "",
        f"- {section['n_experts']} experts, top-{section['top_k']}, in {section['moe_layers']} MoE blocks; "
        f"expert parallel degree {p.get('ep_degree', 1)} over {p.get('world', 1)} rank(s)",
        f"- load max/mean (1.0 = even): first window {f(section['max_mean_first'])}, "
        f"last {f(section['max_mean_last'])}, best {f(section['max_mean_best'])}",
        f"- assignments per expert over the run: {section['assignments_per_expert']}",
        f"- dropped by the capacity: {100 * section['dropped_fraction']:.2f}%",
    ]


def write_plots(data: dict[str, Any], out_dir: Path, subtitle: str = "") -> list[str]:
    """The two plots; returns the files written (relative to the run directory)."""
    history = [h for h in data["history"] if h.get("load") and sum(map(sum, h["load"]))]
    written: list[str] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    title_end = f"\n{subtitle}" if subtitle else ""
    p = data.get("placement") or {}
    for name, fig in (
        (LOAD_PLOT, _load_figure(data, history, title_end) if history else None),
        (PLACEMENT_PLOT, _placement_figure(data["n_experts"], p, title_end) if p.get("ranks") else None),
    ):
        if fig is not None:
            atomic_write(out_dir / name, lambda fh: fig.savefig(fh, format="png", bbox_inches="tight"))
            written.append(f"{out_dir.name}/{name}")
    return written


def _load_figure(data: dict[str, Any], history: list[dict[str, Any]], title_end: str) -> Any:
    """Each expert's share of the routed tokens (stacked) above the max/mean load; growths marked."""
    steps = [h["step"] for h in history]
    n = data["n_experts"]
    # windows before a resume that grew the experts have fewer of them: the new ones had none
    shares = [
        [sum(row[e] for row in h["load"] if e < len(row)) / max(sum(map(sum, h["load"])), 1) for h in history]
        for e in range(n)
    ]
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # no pyplot: no global figure to close

    fig = Figure(figsize=(8, 7), dpi=110)
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    fig.subplots_adjust(hspace=0.25)
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    grown = data.get("grown") or []  # moe.grow_at_step: the new experts named, the step marked
    born = {e: g["step"] for g in grown for e in g.get("new", [])}
    ax.stackplot(
        steps,
        shares,
        labels=[f"expert {e}" + (f" (new at {born[e]})" if e in born else "") for e in range(n)],
        colors=[cmap(e % cmap.N) for e in range(n)],
    )
    for g in grown:
        for a in (ax, ax2):
            a.axvline(g["step"], color="black", ls=":", lw=1)
        ax.text(g["step"], 0.98, f" {g['from']} -> {g['to']} experts", va="top", fontsize=8)
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
    ax.set_title(f"Expert load over training (top-{data['top_k']} of {n})" + title_end, fontsize=11)
    return fig


def _placement_figure(n: int, p: dict[str, Any], title_end: str) -> Any:
    """Which rank holds which expert, as a grid of ranks by experts."""
    ranks = p["ranks"]
    grid = [[1.0 if e in held else 0.0 for e in range(n)] for held in ranks]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5, 0.5 * n + 2), max(2.2, 0.5 * len(ranks) + 1.5)), dpi=110)
    ax = fig.subplots()
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
    ax.set_title(f"Expert placement: expert-parallel degree {len(ranks)}{note}" + title_end, fontsize=11)
    return fig
