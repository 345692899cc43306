"""Memory tools: the batch-size finder and memory reports (activation checkpointing and the
out-of-memory policy are part of the step: transforms.py, oom.py).

- :func:`find_batch_size` (finder.py): the search, the largest or fastest micro-batch that fits;
  :class:`StepTrial` (step_trial.py): the real training step each size is measured with;
  :func:`resolve_batch_size` (resolve.py): ``--batch.micro=auto`` for a run, keeping the global
  batch; :func:`get_optimal_batch_size` (resolve.py): the same in one call on a model and a batch.
- :func:`estimate_memory`, :func:`measure_step_memory`, :class:`MemoryStats` (stats.py): memory
  per phase and per kind (params, grads, optimizer state, activations).
"""

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
