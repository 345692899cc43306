"""The profile report as text (markdown): what ran, where the step's time goes, syncs, compile,
the bottleneck and the recommendations with their verification."""

from __future__ import annotations

from typing import Any

from ...core.meter.table import DASH, render_table
from .syncs import format_syncs

PHASE_TITLES = {
    "data": "data wait (loader)",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "hooks": "hooks (monitor, ...)",
    "other": "other host work",
}


def _rate(value: float | None, unit: str) -> str:
    return DASH if value is None else f"{value:,.0f} {unit}" if value >= 100 else f"{value:,.1f} {unit}"


def render(doc: dict[str, Any]) -> str:
    lines = [*_header(doc), *_phases(doc), *format_syncs(doc["syncs"])]
    ops, comp = doc["operators"], doc["compile"]
    if ops["forward_op_median_us"] is not None:
        lines.append(
            f"- forward: {ops['forward_ops_per_step']:.0f} operators per step, median {ops['forward_op_median_us']:.1f} us, "
            f"half the time in operators up to {ops['forward_op_time_median_us']:.1f} us (host)"
        )
    lines.append(
        f"- compile: {'on' if comp['compiled'] else 'off'}; recompilations after warm-up {comp['recompiles_after_warmup']}; "
        f"graph breaks {comp['graph_breaks']}" + "".join(f"\n  - {r}" for r in comp["graph_break_reasons"])
    )
    if doc.get("regime"):  # app/regime.py
        lines += ["", f"**regime: {doc['regime']['name']}** — {doc['regime']['why']}"]
    lines += ["", f"**bottleneck: {doc['bottleneck']['name']}** — {doc['bottleneck']['text']}", ""]
    if not doc["recommendations"]:
        lines.append("No recommendation: nothing stands out in this profile.")
    for i, r in enumerate(doc["recommendations"], 1):
        lines += _recommendation(i, r)
    return "\n".join(lines + _verification(doc.get("verify")))


def _header(doc: dict[str, Any]) -> list[str]:
    f, s, loader = doc["figures"], doc["settings"], doc["loader"]
    return [
        f"## turbotrain profile: {doc['target']['describe']}",
        "",
        f"- device: {doc['device_name']} ({doc['device']}); trace: `{doc['trace']}`",
        f"- settings: {s['precision']}, compile {s['compile']}, {s['optimizer']}, micro-batch {s['micro_batch']} x "
        f"accumulation {s['accumulation']}, checkpointing {s['checkpointing']}, monitor.log_every {s['log_every']}",
        f"- loader: {loader.get('loader')}; workers {loader.get('num_workers')}, pin_memory {loader.get('pin_memory')}, "
        f"device prefetch {loader.get('device_prefetch')}",
        f"- step {f['step_ms_median']:.2f} ms (median of {f['steps']} after {f['warmup']} warm-up) | "
        f"{_rate(f['throughput'], f['throughput_unit'])} | first step {f['first_step_s']:.2f} s"
        + (f" | {f['tflops']:.3g} TFLOP/s" if f.get("tflops") is not None else "")
        + (f" | MFU {100 * f['mfu']:.1f}%" if f.get("mfu") is not None else " | MFU n/a (no datasheet peak)"),
        "",
    ]


def _phases(doc: dict[str, Any]) -> list[str]:
    """The step's phases as a table (device time beside on CUDA), then the device's timeline."""
    d = doc.get("device_timeline")
    columns = [
        ("phase", lambda r: r["title"]),
        ("host ms/step", lambda r: f"{r['ms']:.2f}"),
        ("share", lambda r: f"{r['share']:.0%}"),
    ]
    if d is not None:
        columns.append(("device ms/step", lambda r: f"{r.get('device_ms', 0.0):.2f}"))
    rows = [{"title": PHASE_TITLES[p], **v} for p, v in doc["breakdown"].items()]
    lines = [render_table(rows, columns), ""]
    if d is not None:
        lines.append(
            f"- device: busy {d['busy_ms']:.2f} ms/step, idle {d['idle_ms']:.2f} ms/step ({d['idle_share']:.0%}); "
            f"host-to-device copies {d['h2d_copy_ms']:.2f} ms/step; {d['kernels_per_step']:.0f} kernels/step, "
            f"median {d['kernel_median_us']:.1f} us"
        )
    return lines


def _recommendation(i: int, r: dict[str, Any]) -> list[str]:
    v = r.get("verified")
    measured = v and v["status"] in ("kept", "dropped")
    # an estimate is a model of the step, not a measurement: said so until --verify measures it
    how = "; --verify measures it" if r.get("settings") and not v else ""  # a code change: not run
    said = "Expected" if measured else f"Expected (an estimate, not measured{how})"
    lines = [f"{i}. `{r['change']}` — {r['why']}. {said}: {r['expected']}."]
    if v and measured:
        loss = f", loss {v['loss_diff']:+.4f} vs baseline" if v.get("loss_diff") is not None else ""
        lines.append(
            f"   verified: **{v['speedup']:.2f}x** ({v['status']}; median of {v['runs']} runs{loss})"
        )
    elif v:
        lines.append(f"   {v['status']}: {v['reason']}")
    return lines


def _verification(verify: dict[str, Any] | None) -> list[str]:
    if not verify:
        return []
    if verify.get("note"):
        return ["", f"verification: {verify['note']}"]
    base = verify["baseline"]
    return [
        "",
        f"verification: {verify['repeats']} interleaved runs of {verify['warmup']} + {verify['steps']} steps per "
        f"variant; baseline {_rate(base['throughput_median'], base['unit'] or '')} (median); kept when >= "
        f"{verify['min_speedup']:.2f}x" + ("; INTERRUPTED" if verify["interrupted"] else ""),
    ]
