"""Memory: activation checkpointing, the batch-size finder, OOM recovery mid-run, memory reports.

- :func:`apply_activation_checkpointing` (checkpointing.py): per-block build-time transform.
- :func:`find_batch_size`, :class:`StepTrial`, :func:`resolve_batch_size` (finder.py): the
  largest or fastest micro-batch that fits, keeping the global batch (``--batch.micro=auto``).
- :func:`build_batch_runner` (recovery.py): what ``Engine.forward_backward`` runs each batch
  through; halves the micro-batch and re-runs the step after an out-of-memory error.
- :func:`estimate_memory`, :func:`measure_step_memory`, :class:`MemoryStats` (stats.py): memory
  per phase and per kind (params, grads, optimizer state, activations).
"""

from .checkpointing import MODES as CHECKPOINTING_MODES
from .checkpointing import apply_activation_checkpointing, checkpointed_blocks
from .finder import (
    BatchSearch,
    StepTrial,
    TrialRecord,
    TrialResult,
    find_batch_size,
    is_oom,
    plan_accumulation,
    resolve_batch_size,
    token_batches,
    usable_memory_bytes,
)
from .recovery import BatchRunner, HalvingBatchRunner, OutOfMemoryStop, build_batch_runner, split_batch
from .stats import (
    GIB,
    MemoryStats,
    TensorMemoryTracker,
    compare_checkpointing,
    estimate_memory,
    measure_step_memory,
    memory_summary,
)

__all__ = [
    "CHECKPOINTING_MODES",
    "GIB",
    "BatchRunner",
    "BatchSearch",
    "HalvingBatchRunner",
    "MemoryStats",
    "OutOfMemoryStop",
    "StepTrial",
    "TensorMemoryTracker",
    "TrialRecord",
    "TrialResult",
    "apply_activation_checkpointing",
    "build_batch_runner",
    "checkpointed_blocks",
    "compare_checkpointing",
    "estimate_memory",
    "find_batch_size",
    "is_oom",
    "measure_step_memory",
    "memory_summary",
    "plan_accumulation",
    "resolve_batch_size",
    "split_batch",
    "token_batches",
    "usable_memory_bytes",
]
