"""Memory tools: the batch-size finder (finder.py, step_trial.py, resolve.py) and memory reports
(stats.py). Activation checkpointing and the out-of-memory policy are the step's (core)."""

from ...parts.data.loader import token_batches
from .finder import (
    BatchSearch,
    TrialRecord,
    TrialResult,
    find_batch_size,
    plan_accumulation,
    usable_memory_bytes,
)
from .resolve import get_optimal_batch_size, resolve_batch_size
from .stats import (
    MemoryStats,
    TensorMemoryTracker,
    compare_checkpointing,
    estimate_memory,
    measure_step_memory,
    memory_summary,
)
from .step_trial import StepTrial

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
    "get_optimal_batch_size",
    "measure_step_memory",
    "memory_summary",
    "plan_accumulation",
    "resolve_batch_size",
    "token_batches",
    "usable_memory_bytes",
]
