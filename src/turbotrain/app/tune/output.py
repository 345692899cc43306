"""What ``turbotrain tune`` leaves behind: the best settings as a preset, the trials as a table
(``tune.md``) and as JSON (``tune.json``), and a plot (``tune.png``: throughput per trial, and
throughput against peak memory with the memory limit)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...base.atomic import atomic_write
from ...base.config import RunConfig, to_toml
from ...core.meter.table import render_table

DASH = "—"
COLORS = {
    "ok": "tab:green",
    "pruned": "tab:gray",
    "over budget": "tab:red",
    "predicted over budget": "salmon",
    "oom": "darkred",
    "loss parity": "tab:orange",
    "failed": "black",
    "timeout": "black",
    "invalid": "tab:purple",
}


def _mib(value: Any) -> str:
    return DASH if value is None else f"{value / 2**20:,.1f}"


def _param(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: str(r["params"].get(key, DASH))


def trials_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    """Markdown: one row per trial with its parameters and figures."""
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("#", lambda r: str(r["number"]) + (" (baseline)" if r.get("baseline") else "")),
        ("status", lambda r: r.get("status", r["state"])),
    ]
    columns += [(k.split(".", 1)[1], _param(k)) for k in keys]
    columns += [
        (
            "throughput",
            lambda r: DASH if not r.get("throughput") else f"{r['throughput']:,.0f} {r.get('unit') or ''}",
        ),
        ("peak MiB", lambda r: _mib(r.get("peak_bytes"))),
        ("Δ loss", lambda r: DASH if r.get("loss_diff") is None else f"{r['loss_diff']:+.4f}"),
        ("first step s", lambda r: DASH if r.get("first_step_s") is None else f"{r['first_step_s']:.1f}"),
        ("note", lambda r: r.get("reason") or ""),
    ]
    return render_table(rows, columns)


def preset_text(config: RunConfig, header: list[str]) -> str:
    """The best settings as a preset ``turbotrain train --preset PATH.toml`` reads."""
    return "".join(f"# {line}\n" for line in header) + to_toml(config)


def write_plot(rows: list[dict[str, Any]], limit_bytes: float | None, unit: str, path: Path) -> bool:
    """tune.png: throughput per trial (a pruned trial at its last window; penalised trials
    hollow), and throughput against peak memory with the limit. False when matplotlib cannot draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in rows if r.get("status") != "duplicate"]
    for r in rows:
        status = r.get("status", r["state"])
        value = r.get("throughput") or (r.get("windows") or [0.0])[-1]
        color = COLORS.get(status, "tab:blue")
        left.bar(
            r["number"], value, color=color if r.get("feasible") else "none", edgecolor=color, linewidth=1.5
        )
        if r.get("peak_bytes") is not None:
            right.scatter(
                r["peak_bytes"] / 2**20, value, color=color, marker="o" if r.get("feasible") else "x"
            )
    seen = [s for s in COLORS if any(r.get("status", r["state"]) == s for r in rows)]
    left.legend(handles=[Patch(color=COLORS[s], label=s) for s in seen], fontsize=7)
    left.set(xlabel="trial", ylabel=unit, title="throughput per trial (hollow: penalised or pruned)")
    right.set(xlabel="peak memory (MiB)", ylabel=unit, title="throughput against memory")
    if limit_bytes:
        right.axvline(limit_bytes / 2**20, color="tab:red", linestyle="--", label="memory limit")
        right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
