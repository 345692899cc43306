"""turbotrain: PyTorch training that is fast by default, and proves it.

Public API: :class:`Engine` for your own loop, :func:`fit` the reference loop, :class:`RunConfig`.
"""

__version__ = "0.1.0"

from .config import RunConfig, load_config  # noqa: E402
from .engine import Engine  # noqa: E402
from .loop import fit  # noqa: E402

__all__ = ["Engine", "RunConfig", "fit", "load_config", "__version__"]
