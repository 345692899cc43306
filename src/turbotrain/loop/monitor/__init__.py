"""Monitoring: windowed throughput and the latest loss every ``log_every`` steps, to sinks.

The Monitor receives values (:meth:`Monitor.observe`: step, loss tensor, lr, sample and token
counts), from its hook side in ``fit()`` or from your own loop. The only host-device
synchronisation is the loss read on logging steps; every other step the monitor does an integer
modulo and returns. A step with a validation result is a logging step too (its evaluation has
synced already), so every evaluation reaches the records, whatever ``log_every``. Probes add to each record, also only on logging
steps: memory (allocator counters, no sync), MFU (FLOPs per sample counted once, before training),
and GPU utilisation/power/temperature/clocks from NVML, sampled on a background thread so the
training thread never waits for the driver. Sinks: ``metrics.jsonl``, a rich progress bar and,
optionally, TensorBoard.

Record keys carry their units: ``step_ms``, ``samples_per_s``, ``tokens_per_s``, ``tflops``
(achieved model TFLOP/s: FLOPs per token x tokens/s, per sample x samples/s without tokens), ``mfu`` (fraction of the datasheet peak), ``mem_*_gib``,
``gpu_util_pct``, ``gpu_power_w``, ``gpu_temp_c``, ``gpu_sm_clock_mhz``; ``grad_norm`` when the
engine computes it, and the ``precision`` in use. Data parallel (``world`` processes): rates are
the whole run's (this rank's counts x world, every rank training an equal share),
``rank_tokens_per_s`` is one rank's, and MFU is over all devices (world x the datasheet peak).

The package by concern: :mod:`.hook` (the Monitor, and the Sink and Probe interfaces),
:mod:`.sinks` (JSONL, progress, TensorBoard), :mod:`.trackers` (W&B, MLflow, trackio), :mod:`.memory`, :mod:`.flops` (FLOPs and MFU),
:mod:`.nvml` and :mod:`.probes` (the standard set). Everything is importable from here as before.
"""

from __future__ import annotations

from .flops import (
    COUNTED,
    FORMULA,
    FlopCount,
    MfuProbe,
    build_mfu_probe,
    count_flops,
    count_flops_per_sample,
    estimate_flops,
    estimate_flops_per_sample,
)
from .hook import Monitor, Probe, Sink
from .memory import MEMORY_WARNING, HostMemoryProbe, MemoryProbe, collect_cuda_memory
from .nvml import UTIL_WARNING, NvmlSampler, UtilisationWatch
from .probes import build_probes
from .sinks import JsonlSink, ProgressSink, TensorBoardSink, format_record
from .trackers import (
    SINKS,
    TRACKERS,
    MlflowSink,
    TrackerOptions,
    TrackioSink,
    WandbSink,
    build_sinks,
    publish,
)

__all__ = [
    "COUNTED",
    "FORMULA",
    "FlopCount",
    "count_flops",
    "estimate_flops",
    "MEMORY_WARNING",
    "UTIL_WARNING",
    "HostMemoryProbe",
    "UtilisationWatch",
    "SINKS",
    "TRACKERS",
    "MlflowSink",
    "TrackerOptions",
    "TrackioSink",
    "WandbSink",
    "build_sinks",
    "publish",
    "JsonlSink",
    "MemoryProbe",
    "MfuProbe",
    "Monitor",
    "NvmlSampler",
    "Probe",
    "ProgressSink",
    "Sink",
    "TensorBoardSink",
    "build_mfu_probe",
    "build_probes",
    "collect_cuda_memory",
    "count_flops_per_sample",
    "estimate_flops_per_sample",
    "format_record",
]
