"""``turbotrain doctor``: the environment (:func:`collect_env`, read-only, JSON), checks with fixes
(:mod:`.checks`), speed probes beside the datasheet (:mod:`.probes`: the only device work), and the
report of the three (:mod:`.report`)."""

# every name the old ``turbotrain.doctor`` gave (turbotrain.MOVED keeps that path as this package)
from ..environment import PACKAGES, collect_distributed, collect_env, collect_hardware, cpu_model
from .checks import GPU_ONLY, LEVELS, Check, fp8_check, run_checks
from .probes import ProbeResult, measure_copy_gbs, measure_h2d_gbs, measure_matmul_tflops, run_probes
from .report import build_report, format_report
