"""Monitoring: windowed throughput and the latest loss every ``log_every`` steps, to sinks
(docs/monitoring.md; every record key: reference/metrics.md). The only host-device sync is the loss
read on logging steps (a step with a validation result is one too: its evaluation synced already);
probes add to those records without a sync of their own (NVML is sampled on a thread).
The names the old ``turbotrain.monitor`` module gave are importable from here.
"""

from __future__ import annotations

from .flops import (
    COUNTED,
    FORMULA,
    MfuProbe,
    build_mfu_probe,
    count_flops,
    count_flops_per_sample,
    estimate_flops,
    estimate_flops_per_sample,
)
from .hook import Monitor, Probe, Sink
from .memory import MEMORY_WARNING, HostMemoryProbe, MemoryProbe, collect_cuda_memory
from .nvml import NvmlSampler, UtilisationWatch
from .probes import build_probes
from .sinks import JsonlSink, ProgressSink, TensorBoardSink, format_record
from .trackers import TrackerOptions, build_sinks
