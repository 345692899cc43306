"""turbotrain: PyTorch training that is fast by default, and proves it.

Public API: :class:`Engine` for your own loop, :func:`fit` the reference loop, :class:`RunConfig`,
:class:`Workload` (your model for ``bench``, ``profile`` and ``tune``), :class:`MoE` (a
mixture-of-experts layer for any model).
"""

from .config import RunConfig, load_config
from .engine import Engine
from .loop import fit
from .models.moe import MoE
from .version import __version__
from .workload import Workload

__all__ = ["Engine", "MoE", "RunConfig", "Workload", "fit", "load_config", "__version__"]
