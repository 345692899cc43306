"""``turbotrain doctor``: an environment report to paste into a bug report, checks with fixes, and
short speed probes (matmul TFLOP/s, copy GB/s) beside the datasheet figures.

:func:`collect_env` (:mod:`turbotrain.app.environment`) is read-only and JSON-serialisable
(benchmark result files embed it). :func:`run_checks` (:mod:`.checks`) turns it into findings,
each with a level and the fix. :func:`run_probes` (:mod:`.probes`) measures; nothing else here runs
device work. :mod:`.report` puts the three together as JSON and as text.
"""

from ..environment import PACKAGES, collect_distributed, collect_env, collect_hardware, cpu_model
from .checks import GPU_ONLY, LEVELS, Check, fp8_check, run_checks
from .probes import ProbeResult, measure_copy_gbs, measure_h2d_gbs, measure_matmul_tflops, run_probes
from .report import build_report, format_report

__all__ = [
    "GPU_ONLY",
    "LEVELS",
    "PACKAGES",
    "Check",
    "ProbeResult",
    "build_report",
    "collect_distributed",
    "collect_env",
    "collect_hardware",
    "cpu_model",
    "format_report",
    "fp8_check",
    "measure_copy_gbs",
    "measure_h2d_gbs",
    "measure_matmul_tflops",
    "run_checks",
    "run_probes",
]
