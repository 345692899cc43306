"""The report's PNG plots: what each shows (:data:`PLOTS`, labelled for what was measured by
:func:`plots_for`) and drawing them with matplotlib (:func:`write_plots`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write
from ..base.records import key_values, metric_keys


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    scale: float = 1.0
    style: str = "-"


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: ``series`` on the left axis (and ``right`` on a second axis)."""

    file: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    right: tuple[Series, ...] = ()
    right_label: str = ""
    missing: str = ""  # why the metric may be absent
    fallback_title: str = ""  # when only the right-axis series has data


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec(
        "loss.png",
        "Training and validation loss",
        "loss (cross-entropy, nats per token)",
        (
            Series("loss", "train loss (last step of each window)"),
            Series("val_loss", "validation loss", style="o-"),
        ),
    ),
    PlotSpec("lr.png", "Learning rate schedule", "learning rate", (Series("lr", "learning rate"),)),
    PlotSpec(
        "throughput.png",
        "Training throughput",
        "tokens per second",
        (Series("tokens_per_s", "tokens/s"),),
        right=(Series("step_ms", "step time (ms)", style="--"),),
        right_label="step time (ms)",
    ),
    PlotSpec(
        "mfu.png",
        "Model FLOPs utilisation (MFU)",
        "MFU (% of dense datasheet peak)",
        (Series("mfu", "MFU", scale=100.0),),
        right=(Series("tflops", "achieved model TFLOP/s", style="--"),),
        right_label="achieved TFLOP/s",
        missing="no datasheet peak for this device (CPU or unknown GPU): MFU left out",
        fallback_title="Achieved model TFLOP/s (MFU left out: no datasheet peak for this device)",
    ),
    PlotSpec(
        "memory.png",
        "Memory: device (CUDA caching allocator) and host (process RSS)",
        "memory (GiB)",
        (
            Series("mem_allocated_gib", "device allocated"),
            Series("mem_reserved_gib", "device reserved", style="--"),
            Series("mem_peak_gib", "device peak allocated", style=":"),
            Series("host_rss_gib", "host RSS (this process)", style="-."),
        ),
        missing="device memory is only measured on CUDA, host memory where /proc/self/statm exists",
    ),
    PlotSpec(
        "gpu.png",
        "GPU utilisation and power (NVML)",
        "GPU utilisation (%)",
        (
            Series("gpu_util_pct", "SM utilisation (%)"),
            Series("gpu_mem_util_pct", "memory-bus utilisation (%)", style="--"),
        ),
        right=(Series("gpu_power_w", "power (W)", style=":"),),
        right_label="power (W)",
        missing="NVML sampling needs an NVIDIA GPU and driver (monitor.nvml = true)",
    ),
)

NO_FLOPS = "no FLOP count for this model (give the monitor an example batch to count them)"


def plots_for(records: list[dict[str, Any]]) -> tuple[PlotSpec, ...]:
    """:data:`PLOTS` labelled for what was measured: a language model's loss is in nats per token
    and its throughput in tokens/s; any other model's loss is just its loss and its throughput is
    in samples/s. MFU's note says why it is missing: no FLOP count, or no datasheet peak."""
    tokens = any(v for _, v in key_values(records, "tokens_per_s"))
    counted = bool(key_values(records, "tflops"))
    out = []
    for spec in PLOTS:
        if spec.file == "loss.png" and not tokens:
            spec = replace(spec, ylabel="loss")
        elif spec.file == "throughput.png" and not tokens:
            spec = replace(spec, ylabel="samples per second", series=(Series("samples_per_s", "samples/s"),))
        elif spec.file == "mfu.png" and not counted:
            spec = replace(spec, missing=NO_FLOPS)
        out.append(spec)
    metrics = metric_keys(records)
    if metrics:  # the workload's own (accuracy, ...): validation metrics and what engine.log logged
        out.insert(1, PlotSpec("metrics.png", "Your metrics", "value", tuple(map(_metric_series, metrics))))
    return tuple(out)


def _metric_series(key: str) -> Series:
    """A metric of the workload's own: ``val_x`` is "validation x" (points), the rest "train x"."""
    val = key.startswith("val_")
    label = f"{'validation' if val else 'train'} {key.partition('_')[2].replace('_', ' ')}"
    return Series(key, label, style="o-" if val else "-")


COMPRESS = 1  # zlib level: a third of the time of PIL's default 6, files about 10 % larger
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _line(axis: Any, s: Series, v: list[tuple[int, float]], color: str, few: bool) -> list[Any]:
    """One series on ``axis`` in its style; its points marked when there are ``few``."""
    xs, ys = zip(*v)
    marker = "o" if "o" in s.style else ("." if few else None)
    return axis.plot(
        xs,
        [y * s.scale for y in ys],
        linestyle=s.style.replace("o", "") or "-",
        marker=marker,
        color=color,
        label=s.label,
        markersize=5,
    )


# The axes keep the size they had on pyplot's default 8 x 4.5 in figure; the canvas around them is
# wide enough for any label, title or legend, and the PNG is cropped to what was drawn (as
# ``bbox_inches="tight"`` does, without its second drawing of the figure).
AXES_IN = (6.2, 3.465)
MARGIN_IN = 2.0
DPI = 110
PAD_PX = 11  # 0.1 in, bbox_inches="tight"'s default padding


def _figure(spec: PlotSpec, records: list[dict[str, Any]], subtitle: str) -> Any:
    """One plot's figure; None when none of its series has data."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    left = [(s, v) for s in spec.series if (v := key_values(records, s.key))]
    right = [(s, v) for s in spec.right if (v := key_values(records, s.key))]
    if not left and not right:
        return None
    ylabel, right_label, title = spec.ylabel, spec.right_label, spec.title
    if not left:  # e.g. achieved TFLOP/s without an MFU: draw it on the main axis, say why
        left, right = right, []
        ylabel = right_label = spec.right_label
        title = spec.fallback_title or spec.title
    width, height = (size + 2 * MARGIN_IN for size in AXES_IN)
    fig = Figure(figsize=(width, height), dpi=DPI)
    ax = fig.add_axes((MARGIN_IN / width, MARGIN_IN / height, AXES_IN[0] / width, AXES_IN[1] / height))
    color = iter(COLORS)
    few = len(records) <= 40  # mark the logged points when there are few of them
    handles = [h for s, v in left for h in _line(ax, s, v, next(color), few)]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if right:
        ax2 = ax.twinx()
        handles += [h for s, v in right for h in _line(ax2, s, v, next(color), few)]
        ax2.set_ylabel(right_label)
        ax2.set_ylim(0, ax2.get_ylim()[1] * 1.08)
    if spec.file in ("throughput.png", "mfu.png", "memory.png", "gpu.png"):
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # rates from zero, with headroom above the line
    if spec.file == "lr.png":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    # Below the axes, so it never hides a line.
    ax.legend(
        handles=handles,
        labels=[h.get_label() for h in handles],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=min(3, len(handles)),
        fontsize=9,
        frameon=False,
    )
    ax.set_title(f"{title}\n{subtitle}", fontsize=11, y=1.0)  # no top ticks: where auto puts it
    return fig


def _save_png(fig: Any, path: Path) -> None:
    """Draw ``fig`` once and write what was drawn, cropped to its ink and padded, as a PNG."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    ink = rgba.view(np.uint32)[:, :, 0] != np.uint32(0xFFFFFFFF)  # an opaque white figure elsewhere
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    top, bottom = max(rows[0] - PAD_PX, 0), rows[-1] + 1 + PAD_PX
    left, right = max(cols[0] - PAD_PX, 0), cols[-1] + 1 + PAD_PX
    image = Image.fromarray(np.ascontiguousarray(rgba[top:bottom, left:right, :3]))
    atomic_write(path, lambda f: image.save(f, format="png", dpi=(DPI, DPI), compress_level=COMPRESS))


def write_plots(records: list[dict[str, Any]], out_dir: Path, subtitle: str) -> tuple[list[str], list[str]]:
    """PNG files written (relative to the run directory) and one line per plot skipped."""
    written: list[str] = []
    skipped: list[str] = []
    if not records:
        return written, ["all plots: no metrics records"]
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec in plots_for(records):
        fig = _figure(spec, records, subtitle)
        if fig is not None:
            _save_png(fig, out_dir / spec.file)
            written.append(f"{out_dir.name}/{spec.file}")
            if spec.file == "mfu.png" and not key_values(records, "mfu"):
                skipped.append(f"{spec.file}: shows achieved TFLOP/s only; {spec.missing}")
        else:
            keys = ", ".join(s.key for s in (*spec.series, *spec.right))
            skipped.append(
                f"{spec.file}: skipped, no {keys} in the metrics"
                + (f" ({spec.missing})" if spec.missing else "")
            )
    return written, skipped
