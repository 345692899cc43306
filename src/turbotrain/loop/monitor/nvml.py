"""GPU utilisation, power, temperature and clocks from NVML on a background thread, and a
one-time low-utilisation warning."""

from __future__ import annotations

import logging
import statistics
import threading
from typing import Any

import torch

from ...parts.hardware import collect_nvml_device, nvml_handle

log = logging.getLogger(__name__)
UTIL_WARNING = "gpu_util_warning"  # the record key and engine event kind of the low-utilisation warning


class NvmlSampler:
    """NVML read every ``period_s`` on a daemon thread (the training thread never calls the driver);
    each call returns the means (temperature: max) since the previous one. Without NVML
    ``available`` is False and it records nothing."""

    FIELDS = {
        "util_pct": "gpu_util_pct",
        "mem_util_pct": "gpu_mem_util_pct",
        "power_w": "gpu_power_w",
        "temp_c": "gpu_temp_c",
        "sm_clock_mhz": "gpu_sm_clock_mhz",
        "mem_clock_mhz": "gpu_mem_clock_mhz",
    }

    def __init__(self, cuda_index: int = 0, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.handle = nvml_handle(cuda_index) if torch.cuda.is_available() else None
        self.available = self.handle is not None
        self._samples: list[dict[str, Any]] = []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, Any]:
        raw = collect_nvml_device(self.handle)
        return {key: raw[src] for src, key in self.FIELDS.items() if raw.get(src) is not None}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            reading = self.sample()
            with self._lock:
                self._samples.append(reading)

    def start(self) -> None:
        if self.available and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="turbotrain-nvml", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s + 1)
            self._thread = None

    def __call__(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples and self.available:
            samples = [self.sample()]  # window shorter than the period: read once now
        out: dict[str, Any] = {}
        for key in self.FIELDS.values():
            values = [s[key] for s in samples if key in s]
            if values:
                out[key] = max(values) if key == "gpu_temp_c" else round(statistics.fmean(values), 2)
        return out


class UtilisationWatch:
    """After the NVML sampler: when ``gpu_util_pct`` stays under ``threshold_pct`` for ``after_s``
    seconds, one warning naming ``turbotrain profile``. The first window (warm-up) is skipped."""

    def __init__(self, threshold_pct: float = 80.0, after_s: float = 120.0) -> None:
        self.threshold_pct, self.after_s = threshold_pct, after_s
        self.low_s = 0.0  # seconds of consecutive low windows so far
        self.lows: list[float] = []  # their utilisation
        self._last_s: float | None = None  # elapsed_s of the previous record
        self.warned = False

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        util, now = record.get("gpu_util_pct"), record.get("elapsed_s")
        if util is None or now is None or self.warned or self.threshold_pct <= 0:
            return {}
        last, self._last_s = self._last_s, now
        if last is None:
            return {}  # the first window: warm-up
        if util >= self.threshold_pct:
            self.low_s, self.lows = 0.0, []
            return {}
        self.low_s += now - last
        self.lows.append(util)
        if self.low_s < self.after_s:
            return {}
        self.warned = True
        text = (
            f"GPU utilisation has stayed under {self.threshold_pct:g} % for {self.low_s:.0f} s (median "
            f"{statistics.median(self.lows):.0f} %, monitor.util_warn_pct): the GPU waits on something (data, "
            "host syncs, small kernels); `turbotrain profile` finds what and says what to change"
        )
        log.warning(text)
        return {UTIL_WARNING: text}
