"""``turbotrain bench``: contenders side by side, the precision matrix and the optimization ablation,
each row in its own process on the same model, data, seed and global batch (docs/bench.md)."""

# every name the old ``turbotrain.bench`` gave (turbotrain.MOVED keeps that path as this package)
from .suite import BenchOptions, run_ablation, run_compare, run_precision_matrix
from .workloads import WORKLOADS, BenchWorkload, resolve_workload
