"""turbotrain: PyTorch training that is fast by default, and proves it.

The public API is what this module exports (``__all__``, listed in docs/api.md): :class:`Engine`
for your own loop, :func:`fit` the reference loop, :func:`track` (monitoring, checkpoints and a
report around an own loop), :func:`train` (a whole run in one call: ``turbotrain train --model``
from Python), :class:`RunConfig` and :func:`load_config`, :class:`Workload` (your model for
``train``, ``bench``, ``profile`` and ``tune``), :class:`PlateauLR`, and :class:`MoE`
(a mixture-of-experts layer for any model) with :func:`aux_loss` and :func:`end_optimizer_step`.
Everything else lives in the layer folders and may move between releases.

The modules of the layout before the per-layer folders (``turbotrain.workload``,
``turbotrain.tracking``, ``turbotrain.engine``, ``turbotrain.config``, ...) still import for one
release, as the same module objects under their old names, with a DeprecationWarning naming the
import to write instead (:data:`MOVED`).
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

# Public names imported on first use: turbotrain.app.tracking and .run load the report (matplotlib), which
# ``import turbotrain`` must not (tests/unit/test_layers.py, test_import_turbotrain_stays_light).
LAZY = {"track": "app.tracking", "train": "app.run"}

# The old top-level modules (before the per-layer folders, commit d919ea6) -> (their module now,
# the import to write). Kept for one release; the old ``turbotrain.loop`` (fit) is not here: its
# name is the loop layer's folder now (``from turbotrain import fit``).
MOVED: dict[str, tuple[str, str]] = {
    "workload": ("parts.workload", "from turbotrain import Workload"),
    "tracking": ("app.tracking", "from turbotrain import track"),
    "engine": ("core.engine", "from turbotrain import Engine"),
    "config": ("base.config", "from turbotrain import RunConfig, load_config"),
    "optim": ("core.optim", "from turbotrain import PlateauLR"),
    "models": ("parts.models", "from turbotrain import MoE, aux_loss, end_optimizer_step"),
    "data": ("parts.data", "import turbotrain.parts.data"),
    "hardware": ("parts.hardware", "import turbotrain.parts.hardware"),
    "precision": ("core.precision", "import turbotrain.core.precision"),
    "distributed": ("core.distributed", "import turbotrain.core.distributed"),
    "transforms": ("core.transforms", "import turbotrain.core.transforms"),
    "compile_guard": ("core.compile_guard", "import turbotrain.core.compile_guard"),
    "oom": ("core.oom", "import turbotrain.core.oom"),
    "assembly": ("core.assembly", "import turbotrain.core.assembly"),
    "hooks": ("loop.hooks", "import turbotrain.loop.hooks"),
    "run_hooks": ("loop.run_hooks", "import turbotrain.loop.run_hooks"),
    "checkpoint": ("loop.checkpoint", "import turbotrain.loop.checkpoint"),
    "sharded": ("loop.checkpoint", "import turbotrain.loop.checkpoint"),
    "monitor": ("loop.monitor", "import turbotrain.loop.monitor"),
    "epochs": ("loop.epochs", "import turbotrain.loop.epochs"),
    "lr_plateau": ("loop.lr_plateau", "import turbotrain.loop.lr_plateau"),
    "experts_monitor": ("loop.experts_monitor", "import turbotrain.loop.experts_monitor"),
    "memory": ("tools.memory", "import turbotrain.tools.memory"),
    "training": ("app.training", "import turbotrain.app.training"),
    "report": ("app.report", "import turbotrain.app.report"),
    "expert_report": ("app.expert_report", "import turbotrain.app.expert_report"),
    "doctor": ("app.doctor", "import turbotrain.app.doctor"),
    "precision_check": ("app.precision_check", "import turbotrain.app.precision_check"),
    "bench": ("app.bench", "import turbotrain.app.bench"),
    "measure": ("app.measure", "import turbotrain.app.measure"),
    "profile": ("app.profile", "import turbotrain.app.profile"),
    "tune": ("app.tune", "import turbotrain.app.tune"),
    "atomic": ("base.atomic", "import turbotrain.base.atomic"),
    "batch": ("base.batch", "import turbotrain.base.batch"),
    "errors": ("base.errors", "import turbotrain.base.errors"),
    "failure": ("base.failure", "import turbotrain.base.failure"),
    "launch": ("base.launch", "import turbotrain.base.launch"),
    "process": ("base.process", "import turbotrain.base.process"),
    "rundir": ("base.rundir", "import turbotrain.base.rundir"),
    "runlock": ("base.runlock", "import turbotrain.base.runlock"),
    "signals": ("base.signals", "import turbotrain.base.signals"),
    "units": ("base.units", "import turbotrain.base.units"),
    "version": ("base.version", "import turbotrain.base.version"),
}


# Modules that moved inside a layer folder since (their dotted path under turbotrain -> the same
# pair as above). turbotrain.loop.sharded: merged into the turbotrain.loop.checkpoint package
# (issue 33), which exports its public names.
MOVED_INSIDE: dict[str, tuple[str, str]] = {
    "loop.sharded": ("loop.checkpoint", "from turbotrain.loop.checkpoint import saved_world, ..."),
}


def moved_to(fullname: str) -> tuple[str, str, str] | None:
    """For an old module name (``turbotrain.tracking``, ``turbotrain.models.moe``,
    ``turbotrain.loop.sharded``): (the old name under turbotrain, the module's name now, the
    import to write); None for any other name."""
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
    """The stacklevel of the first frame outside the import machinery and this module, so that
    a DeprecationWarning points at the user's import line (and shows in a script's __main__).
    ``warnings.warn`` does not count the frames of importlib's bootstrap; neither does this."""
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


def _warn_moved(fullname: str) -> str:
    """Warn once per old top-level name (its submodules import after it: one warning says it)."""
    old, now, advice = moved_to(fullname)  # type: ignore[misc]
    if fullname == f"{__name__}.{old}":
        warnings.warn(
            f"{fullname} moved to {now} (turbotrain {__version__}); write `{advice}`: the old path "
            "goes in the next release",
            DeprecationWarning,
            stacklevel=_user_stacklevel(),
        )
    return now


class _MovedModuleLoader(importlib.abc.Loader):
    """Puts the module under its new name in ``sys.modules`` under the old name too: the same
    module object, not a second copy (the import system returns what ``sys.modules`` holds)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(_warn_moved(module.__name__))


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module names of :data:`MOVED` (and their submodules) before the path finder
    could load a second copy of a submodule under its old name."""

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        moved = moved_to(fullname)
        # an old name of a module that does not exist now is not found (find_spec probes of
        # optional modules must not get a false "exists")
        if moved is None or importlib.util.find_spec(moved[1]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(), is_package=True)


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
    """The public API, the layer packages and the table of moved modules (not this module's own
    imports: ``sys``, ``warnings``, ...)."""
    mine = {
        n
        for n, v in globals().items()
        if n.startswith("__") or (isinstance(v, types.ModuleType) and v.__name__.startswith(f"{__name__}."))
    }
    return sorted({*__all__, *mine, "LAZY", "MOVED", "moved_to"})
