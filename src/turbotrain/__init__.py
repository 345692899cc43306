"""turbotrain: PyTorch training that is fast by default, and proves it.

Public API: :class:`Engine` for your own loop, :func:`fit` the reference loop, :class:`RunConfig`,
:class:`Workload` (your model for ``bench``, ``profile`` and ``tune``), :class:`MoE` (a
mixture-of-experts layer for any model).
"""

from .base.config import RunConfig, load_config
from .core.engine import Engine
from .loop.fit import fit
from .parts.models.moe import MoE
from .base.version import __version__
from .parts.workload import Workload

__all__ = ["Engine", "MoE", "RunConfig", "Workload", "fit", "load_config", "__version__"]
