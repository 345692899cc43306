"""Memory tools: the batch-size finder and memory reports (activation checkpointing and the
out-of-memory policy are part of the step: transforms.py, oom.py).

- :func:`find_batch_size`, :class:`StepTrial`, :func:`resolve_batch_size` (finder.py): the
  largest or fastest micro-batch that fits, keeping the global batch (``--batch.micro=auto``).
- :func:`estimate_memory`, :func:`measure_step_memory`, :class:`MemoryStats` (stats.py): memory
  per phase and per kind (params, grads, optimizer state, activations).
"""

from .finder import (
    BatchSearch,
    StepTrial,
    TrialRecord,
    TrialResult,
    find_batch_size,
    plan_accumulation,
    resolve_batch_size,
    token_batches,
    usable_memory_bytes,
)
from .stats import (
    MemoryStats,
    TensorMemoryTracker,
    compare_checkpointing,
    estimate_memory,
    measure_step_memory,
    memory_summary,
)

__all__ = [
    "BatchSearch",
    "MemoryStats",
    "StepTrial",
    "TensorMemoryTracker",
    "TrialRecord",
    "TrialResult",
    "compare_checkpointing",
    "estimate_memory",
    "find_batch_size",
    "measure_step_memory",
    "memory_summary",
    "plan_accumulation",
    "resolve_batch_size",
    "token_batches",
    "usable_memory_bytes",
]
