"""Markdown tables for bench reports: a column appears only when some row measured it (no MFU
column when the GPU's peak is unknown); a skipped or failed row shows its reason and dashes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.meter.table import DASH, figure, render_table


def _status(row: dict[str, Any]) -> str:
    if row.get("status") == "ok":
        return "ok"
    return f"{row.get('status', 'failed')} ({row.get('reason', 'no reason given')})"


def _ok(fn: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    return lambda r: fn(r) if r.get("status") == "ok" else DASH


def _throughput_column(report: dict[str, Any]) -> tuple[str, Callable[[dict[str, Any]], str]]:
    if report["workload"].get("task") == "lm":
        return "tokens/s", _ok(lambda r: figure(r.get("tokens_per_s"), ",.0f"))
    return "samples/s", _ok(lambda r: figure(r.get("samples_per_s"), ",.1f"))


def _memory_column(rows: list[dict[str, Any]]) -> tuple[str, Callable[[dict[str, Any]], str]] | None:
    for key, title in (("peak_mem_gib", "peak mem GiB"), ("peak_rss_gib", "peak RSS GiB (process)")):
        if any(key in r for r in rows):
            return title, _ok(lambda r: figure(r.get(key), ".2f"))
    return None


def _mfu_column(rows: list[dict[str, Any]]) -> tuple[str, Callable[[dict[str, Any]], str]] | None:
    if not any(r.get("mfu") is not None for r in rows):
        return None
    return "MFU", _ok(
        lambda r: DASH if r.get("mfu") is None else f"{100 * r['mfu']:.1f}% of {r.get('math_precision')} peak"
    )


def _times(key: str) -> Callable[[dict[str, Any]], str]:
    """A speedup column: ``1.23x``."""
    return _ok(lambda r: figure(r.get(key), ".2f") + ("x" if r.get(key) else ""))


def _loss_diff(r: dict[str, Any]) -> str:
    if r.get("loss_diff") is None:
        return DASH
    mark = "" if r.get("loss_within_tol") else " (outside tolerance)"
    return f"{r['loss_diff']:+.5f}{mark}"


def _common(report: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    rows = report["rows"]
    cols = [("step ms (median)", _ok(lambda r: f"{r['step_ms_median']:.2f}"))]
    if any(r.get("runs") for r in rows):
        runs = _ok(lambda r: " / ".join(f"{x['step_ms_median']:.1f}" for x in r.get("runs", [])) or DASH)
        cols.append(("step ms per run", runs))
    cols.append(_throughput_column(report))
    cols += [optional for optional in (_mfu_column(rows), _memory_column(rows)) if optional]
    cols.append(("first step s", _ok(lambda r: f"{r['time_to_first_step_s']:.2f}")))
    cols.append(("final loss", _ok(lambda r: f"{r['final_loss']:.5f}")))
    return cols


def compare_table(report: dict[str, Any]) -> str:
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("contender", lambda r: r["contender"]),
        ("status", _status),
        ("recipe", lambda r: r.get("recipe", "")),
        *_common(report),
        *(
            [("decision s (not in step time)", _ok(lambda r: figure(r.get("decision_s"), ".1f")))]
            if any("decision_s" in r for r in report["rows"])
            else []
        ),
        ("Δ loss vs turbotrain", _loss_diff),
        ("turbotrain speedup", _times("turbotrain_speedup")),
    ]
    return render_table(report["rows"], cols)


def precision_table(report: dict[str, Any]) -> str:
    cols = [
        ("precision", lambda r: r["row"]),
        ("status", _status),
        *_common(report),
        ("speedup vs fp32", _times("speedup")),
    ]
    if any("mem_reduction" in r for r in report["rows"]):
        saved = _ok(lambda r: DASH if r.get("mem_reduction") is None else f"{100 * r['mem_reduction']:.0f}%")
        cols.append(("memory saved vs fp32", saved))
    cols.append(("Δ loss vs fp32", _loss_diff))
    return render_table(report["rows"], cols)


def ablation_table(report: dict[str, Any]) -> str:
    """One table per ladder (against its own base); one for an older report without ladders."""
    ladders = report.get("ladders") or {}
    groups = [
        (about, [r for r in report["rows"] if r.get("ladder") == name]) for name, about in ladders.items()
    ]
    groups = [(about, rows) for about, rows in groups if rows] or [
        ({"reference": "baseline"}, report["rows"])
    ]
    tables = []
    for about, rows in groups:
        ref = about["reference"]
        cols = [
            ("row", lambda r: r["row"]),
            ("change", lambda r: r.get("change", "")),
            ("status", _status),
            *_common({**report, "rows": rows}),
            (f"speedup vs {ref}", _times("speedup")),
            (f"Δ loss vs {ref}", _loss_diff),
        ]
        title = [f"### {about['title']} (reference: {ref})", ""] if "title" in about else []
        tables.append("\n".join([*title, render_table(rows, cols)]))
    return "\n\n".join(tables)


TABLES = {"compare": compare_table, "precision": precision_table, "ablation": ablation_table}
TITLES = {
    "compare": "contenders side by side",
    "precision": "precision matrix",
    "ablation": "optimization ablation",
}


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The conclusions under the table: parity, same start, recommendation."""
    s, out = report.get("summary", {}), []
    if report["kind"] == "compare":
        if s.get("contenders_ok"):
            same = "yes" if s.get("same_initial_weights") else "NO"
            out.append(
                f"- same initial weights in every contender: {same} (digest {', '.join(s.get('init_digests', []))}); "
                f"first-step losses differ by at most {s['first_loss_spread']:.2e}"
            )
        if s.get("loss_parity") is not None:
            out.append(
                f"- final losses within tolerance of turbotrain's: {'yes' if s['loss_parity'] else 'NO'}"
            )
    if report["kind"] == "precision":
        rec = s.get("recommendation")
        out.append(
            f"- recommended: {rec['text']}"
            if rec
            else "- no recommendation: the fp32 reference row did not run"
        )
    return out


def render_report(report: dict[str, Any]) -> str:
    """The whole markdown document for one report: header, table, conclusions, notes."""
    w = report["workload"]
    device = report.get("device_name") or report["device"]
    lines = [
        f"## {w['name']}: {TITLES[report['kind']]}",
        "",
        f"- device: {device} ({report['device']})",
        f"- workload: {w['describe']}",
        *[f"- note: {n}" for n in (*w.get("notes", ()), *report.get("notes", ()))],
        f"- timing: {report['timing']}",
        f"- loss parity rule: {report['tolerance']['rule']}",
    ]
    if any(r.get("mfu") is not None for r in report["rows"]):
        lines.append(f"- MFU: {report['mfu_basis']}; FLOPs: {report['flops_method']}")
    elif report["device"] == "cuda":
        lines.append(f"- MFU omitted: no datasheet peak known for {device!r}")
    if report.get("command"):
        lines.append(f"- command: `{report['command']}`")
    if report.get("complete") is False:
        lines.append(
            f"- INCOMPLETE: written after each finished row; the bench stopped (or is still running) "
            f"before these: {', '.join(report.get('missing', [])) or 'none'}"
        )
    lines += ["", TABLES[report["kind"]](report), "", *summary_lines(report)]
    return "\n".join(lines) + "\n"
