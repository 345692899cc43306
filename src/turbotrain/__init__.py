"""turbotrain: PyTorch training that is fast by default, and proves it.

The public API is ``__all__`` (docs/api.md); everything else lives in the layer folders and may
move between releases. The modules of the layout before them (``turbotrain.workload``, ...) still
import for one release, as the same module objects, with a DeprecationWarning (:data:`MOVED`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

from .base.config import RunConfig, load_config
from .base.errors import filter_import_noise
from .base.version import __version__
from .core.engine import Engine
from .core.optim import PlateauLR
from .loop.fit import fit
from .parts.models.moe import MoE, aux_loss, end_optimizer_step
from .parts.workload import Workload

__all__ = [
    "Engine",
    "MoE",
    "PlateauLR",
    "RunConfig",
    "Workload",
    "aux_loss",
    "end_optimizer_step",
    "fit",
    "load_config",
    "track",
    "train",
    "__version__",
]

filter_import_noise()  # torchao's import lines, whoever imports it after turbotrain (transformers)

# imported on first use: they load the report (matplotlib), which ``import turbotrain`` must not
LAZY = {"track": "app.tracking", "train": "app.run"}

# The old top-level modules (before the per-layer folders, commit d919ea6) -> (their module now,
# the import to write). Kept for one release; the old ``turbotrain.loop`` (fit) is not here: its
# name is the loop layer's folder now (``from turbotrain import fit``).
_LAYER_OF = {
    "base": "atomic batch errors failure launch process rundir runlock signals units version",
    "parts": "data hardware",
    "core": "precision distributed transforms compile_guard oom assembly",
    "loop": "hooks run_hooks checkpoint monitor epochs lr_plateau experts_monitor",
    "tools": "memory",
    "app": "training report expert_report doctor precision_check bench measure profile tune",
}
MOVED: dict[str, tuple[str, str]] = {
    "workload": ("parts.workload", "from turbotrain import Workload"),
    "tracking": ("app.tracking", "from turbotrain import track"),
    "engine": ("core.engine", "from turbotrain import Engine"),
    "config": ("base.config", "from turbotrain import RunConfig, load_config"),
    "optim": ("core.optim", "from turbotrain import PlateauLR"),
    "models": ("parts.models", "from turbotrain import MoE, aux_loss, end_optimizer_step"),
    "sharded": ("loop.checkpoint", "import turbotrain.loop.checkpoint"),
    **{
        old: (f"{layer}.{old}", f"import turbotrain.{layer}.{old}")
        for layer, names in _LAYER_OF.items()
        for old in names.split()
    },
}


# Modules that moved inside a layer folder since (dotted path under turbotrain -> as above).
MOVED_INSIDE: dict[str, tuple[str, str]] = {
    "loop.sharded": ("loop.checkpoint", "from turbotrain.loop.checkpoint import saved_world, ..."),
}


def moved_to(fullname: str) -> tuple[str, str, str] | None:
    """(old name under turbotrain, module name now, import to write) for an old module name, else None."""
    parts = fullname.split(".")
    if len(parts) < 2 or parts[0] != __name__:
        return None
    inside = ".".join(parts[1:3])
    if len(parts) == 3 and inside in MOVED_INSIDE:
        new, advice = MOVED_INSIDE[inside]
        return inside, f"{__name__}.{new}", advice
    if parts[1] not in MOVED:
        return None
    new, advice = MOVED[parts[1]]
    now = ".".join([__name__, new, *parts[2:]])
    if len(parts) > 2:
        advice = f"import {now}"
    return parts[1], now, advice


def _user_stacklevel() -> int:
    """The stacklevel of the user's import line (not counting this module's and importlib's frames)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
        elif name in (__file__, importlib.__file__):
            frame, level = frame.f_back, level + 1
        else:
            break
    return level


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of :data:`MOVED` before the path finder loads a second copy, and loads
    each as the module under its new name (the same object in ``sys.modules``)."""

    def exec_module(self, module: types.ModuleType) -> None:
        old, now, advice = moved_to(module.__name__)  # type: ignore[misc]
        # one warning per old top-level name (its submodules import after it: that one says it)
        if module.__name__ == f"{__name__}.{old}":
            warnings.warn(
                f"{module.__name__} moved to {now} (turbotrain {__version__}); write `{advice}`: the old "
                "path goes in the next release",
                DeprecationWarning,
                stacklevel=_user_stacklevel(),
            )
        sys.modules[module.__name__] = importlib.import_module(now)

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        moved = moved_to(fullname)
        # an old name of a module that does not exist now is not found (find_spec probes of
        # optional modules must not get a false "exists")
        if moved is None or importlib.util.find_spec(moved[1]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)


# by name, not class: importlib.reload(turbotrain) defines the class anew
if not any(type(f).__qualname__ == _MovedModuleFinder.__qualname__ for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name: str) -> Any:
    """``turbotrain.track`` on first use; ``turbotrain.workload`` (an old module) as an attribute."""
    if name in LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
        globals()[name] = value
        return value
    if name in MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API, the layer packages and the moved modules' table (not ``sys``, ...)."""
    mine = {
        n
        for n, v in globals().items()
        if n.startswith("__") or (isinstance(v, types.ModuleType) and v.__name__.startswith(f"{__name__}."))
    }
    return sorted({*__all__, *mine, "LAZY", "MOVED", "moved_to"})
