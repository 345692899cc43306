"""Memory tools: the batch-size finder (finder.py, step_trial.py, resolve.py) and memory reports
(stats.py). Activation checkpointing and the out-of-memory policy are the step's (core)."""

from ...parts.data.loader import token_batches  # noqa: F401 (the package's names)
from .finder import (  # noqa: F401
    BatchSearch,
    TrialRecord,
    TrialResult,
    find_batch_size,
    plan_accumulation,
    usable_memory_bytes,
)
from .resolve import get_optimal_batch_size, resolve_batch_size  # noqa: F401
from .stats import (  # noqa: F401
    MemoryStats,
    TensorMemoryTracker,
    compare_checkpointing,
    estimate_memory,
    measure_step_memory,
    memory_summary,
)
from .step_trial import StepTrial  # noqa: F401
