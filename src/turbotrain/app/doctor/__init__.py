"""``turbotrain doctor``: the environment (:func:`collect_env`, read-only, JSON), checks with fixes
(:mod:`.checks`), speed probes beside the datasheet (:mod:`.probes`: the only device work), and the
report of the three (:mod:`.report`)."""

from ..environment import collect_distributed, collect_env
from .checks import fp8_check, run_checks
from .probes import run_probes
from .report import build_report, format_report
