"""``turbotrain bench``: contenders side by side, the precision matrix and the optimization ablation.

Each row runs in its own process on the same model definition, data, seed and global batch, and
reports only what it measured (see :mod:`.protocol` for how). Modules: :mod:`.workloads` (models,
sizes, data, FLOPs), :mod:`.contenders` (who competes and how each trains; :mod:`.handtuned` the
expert's plain PyTorch), :mod:`.worker` (the per-row process), :mod:`.autobatch` (``--batch auto``),
:mod:`.suite` (running rows, derived figures), :mod:`.variants` (the precision matrix's and
the ablation's rows, and why one cannot run here), :mod:`.tables` and :mod:`.results` (markdown and JSON).
"""

from .suite import BenchOptions, run_ablation, run_compare, run_precision_matrix
from .workloads import WORKLOADS, BenchWorkload, resolve_workload

__all__ = [
    "BenchOptions",
    "WORKLOADS",
    "BenchWorkload",
    "resolve_workload",
    "run_ablation",
    "run_compare",
    "run_precision_matrix",
]
