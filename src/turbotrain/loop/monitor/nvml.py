"""GPU utilisation, power, temperature and clocks from NVML, sampled on a background thread."""

from __future__ import annotations

import statistics
import threading
from typing import Any

import torch

from ...parts.hardware import collect_nvml_device, nvml_handle


class NvmlSampler:
    """GPU utilisation (%), power (W), temperature (C) and SM/memory clocks (MHz) read from NVML
    every ``period_s`` on a daemon thread; each call returns the means (temperature: max) over
    the samples since the previous call. The training thread never calls the driver.

    Without NVML (no package, no driver, no GPU) it records nothing: ``available`` is False.
    """

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
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, Any]:
        """One reading of the fields NVML answers."""
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
