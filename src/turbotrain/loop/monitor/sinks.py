"""Where the Monitor's records go: ``metrics.jsonl``, a progress bar or plain lines, TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...base.atomic import reporting_disk_full
from ...base.errors import required_module

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger(__name__)


class JsonlSink:
    """One JSON object per record, appended to ``path``; flushed at most every ``flush_every_s`` (a
    write syscall per record cost ~80 us on the tiny-MLP benchmark) and on close."""

    def __init__(self, path: Path, flush_every_s: float = 1.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", encoding="utf-8")
        self.flush_every_s = flush_every_s
        self._flushed_at = time.monotonic()
        self._warned: set[str] = set()  # the keys already named in a non-finite warning

    def write(self, record: dict[str, Any]) -> None:
        # its NaN and infinite floats as None (strict JSON)
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        record = {**record, **dict.fromkeys(bad)} if bad else record
        for key in sorted(set(bad) - self._warned):  # once per key: a metric NaN at every pass warns once
            self._warned.add(key)
            log.warning(
                "%s is NaN or infinite at step %s: written as null in %s",
                key,
                record.get("step"),
                self.path.name,
            )
        with reporting_disk_full(self.path):  # a full disk: one DiskFullError naming the file
            self.file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
            now = time.monotonic()
            if now - self._flushed_at >= self.flush_every_s:
                self.file.flush()
                self._flushed_at = now

    def flush(self) -> None:
        """The records buffered so far onto the disk (before a checkpoint: a resume starts after it)."""
        if not self.file.closed:
            with reporting_disk_full(self.path):
                self.file.flush()
            self._flushed_at = time.monotonic()

    def close(self) -> None:
        with reporting_disk_full(self.path):
            self.file.close()


class ProgressSink:
    """A rich progress bar on a terminal (logs and validation lines above it); plain lines otherwise."""

    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None) -> None:
        # rich.progress costs ~0.1 s to import: a run without a progress bar (or an own loop) skips it
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.table import Column

        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        fixed = Column(no_wrap=True)  # the step, the times: never cut
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}", table_column=fixed),
            BarColumn(bar_width=16),
            TimeElapsedColumn(table_column=fixed),
            TextColumn("eta", table_column=fixed),
            TimeRemainingColumn(table_column=fixed),
            # the rest of the line: cut to the terminal's width, never wrapped onto a second one
            TextColumn(
                "{task.fields[stats]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")
            ),
            console=self.console,
            disable=not self.live,
            expand=True,
            refresh_per_second=2,  # redraws run on rich's thread and take the GIL: keep them rare
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.progress.start()
        self._handlers = _log_above(self.console) if self.live else []

    def tick(self, step: int) -> None:
        if self.live:
            self.progress.update(self.task, completed=step)

    def write(self, record: dict[str, Any]) -> None:
        # a probe's own record (memory between logging steps): the line keeps the last loss
        if "loss" not in record:
            return
        stats = format_record(record)
        if not self.live:  # plain lines for logs and pipes; rich's renderer costs ~200 us per line
            print(f"step {record['step']:>6} | {stats}", file=self.console.file, flush=True)
            return
        short = " | ".join(
            p for p in stats.split(" | ") if p.startswith(("loss", "val ")) or p.endswith(RATES)
        )
        self.progress.update(self.task, completed=record["step"], stats=short)
        if record.get("val_loss") is not None:  # a validation result stays, above the bar
            self.progress.console.print(f"step {record['step']:>6} | {stats}", highlight=False)

    def close(self) -> None:
        self.progress.stop()
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers = []


RATES = (" tok/s", " samples/s")  # the rates the bar shows (format_record's words)


def _log_above(console: Console) -> list[tuple[logging.StreamHandler[Any], Any]]:
    """The root logger's and turbotrain's handlers on the bar's terminal write through rich's proxy
    (above the bar, not onto it); returns the handlers and their streams, to put back."""
    proxy = next(
        (f for f in (sys.stderr, sys.stdout) if getattr(f, "rich_proxied_file", None) is console.file), None
    )
    if proxy is None:
        return []
    return [
        (handler, handler.setStream(proxy))
        for handler in (*logging.getLogger().handlers, *logging.getLogger("turbotrain").handlers)
        if type(handler) is logging.StreamHandler and handler.stream is console.file
    ]


def format_record(record: dict[str, Any]) -> str:
    """The short human line for one metrics record."""
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
        parts.extend(
            f"{k[4:]} {v:.4g}"
            for k, v in record.items()
            if k.startswith("val_") and k not in ("val_loss", "val_step")
        )
    parts.extend(
        f"{k[6:]} {v:.4g}" for k, v in record.items() if k.startswith("train_") and isinstance(v, float)
    )
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    elif record.get("samples_per_s"):
        parts.append(f"{record['samples_per_s']:,.1f} samples/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    elif record.get("tflops") is not None:
        parts.append(f"{record['tflops']:.3g} TFLOP/s")
    if record.get("mem_peak_gib") is not None:
        parts.append(f"peak {record['mem_peak_gib']:.2f} GiB")
    if record.get("gpu_util_pct") is not None:
        parts.append(f"GPU {record['gpu_util_pct']:.0f}%")
    return " | ".join(parts)


class TensorBoardSink:
    """Every numeric record value as a TensorBoard scalar (``train/<key>``) at its step."""

    def __init__(self, log_dir: Path) -> None:
        tensorboard = required_module(
            "torch.utils.tensorboard",
            "monitor.tensorboard = true needs the tensorboard package: pip install tensorboard "
            "(or pip install 'turbotrain[tensorboard]'), or drop --monitor.tensorboard",
        )
        self.writer = tensorboard.SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
