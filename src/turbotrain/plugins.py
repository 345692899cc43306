"""What an extender imports: the stable names for adding a precision, a model family, a start-of-run
decision or a hook to ``fit`` (docs/plugins.md, docs/early-stopping.md).

The layer folders (``turbotrain.base``, ``.parts``, ``.core``, ``.loop``, ...) may move their
modules between releases; these names stay here. ``import turbotrain`` does not import this
module (it loads the loop's hooks): ``from turbotrain.plugins import ModelSpec, register_family``.

- settings: :func:`knob` fields in a frozen dataclass, :func:`register_settings` (when they apply),
  :func:`setting` (a flag as the user writes it, for one-line errors), :func:`describe`;
  the run sections a plugin's settings extend: :class:`ModelConfig`, :class:`PrecisionConfig`.
- a precision: subclass :class:`Precision` (or :class:`MixedPrecision`) with a ``name``.
- a model family: a :class:`ModelSpec` (its data a :class:`RunData`), :func:`register_family`.
- a start-of-run decision of a plugin: :func:`register_start`, which calls it with a :class:`Start`.
- a hook of ``fit``: subclass :class:`Hook` (``on_<event>(ctx)``, ctx a :class:`FitContext`); the
  built-in ones a loop of your own combines: :class:`Evaluate`, :class:`EarlyStopping` with its
  :class:`MetricWatch`, :class:`Checkpointer` with :func:`run_state`, :class:`KeepBest`.
"""

from __future__ import annotations

from .base.config import ModelConfig, PrecisionConfig, describe, knob, register_settings, setting
from .base.config_plugins import Start, register_start
from .base.errors import ConfigError
from .core.precision import DeviceCaps, MixedPrecision, Precision
from .loop.best_checkpoint import KeepBest
from .loop.checkpoint import Checkpointer, run_state
from .loop.early_stop import EarlyStopping, MetricWatch
from .loop.hooks import Evaluate, FitContext, Hook
from .parts.models.registry import register_family
from .parts.models.spec import ModelSpec, RunData, SpeedHint

__all__ = [
    "Checkpointer",
    "ConfigError",
    "DeviceCaps",
    "EarlyStopping",
    "Evaluate",
    "FitContext",
    "Hook",
    "KeepBest",
    "MetricWatch",
    "MixedPrecision",
    "ModelConfig",
    "ModelSpec",
    "Precision",
    "PrecisionConfig",
    "RunData",
    "SpeedHint",
    "Start",
    "describe",
    "knob",
    "register_family",
    "register_settings",
    "register_start",
    "run_state",
    "setting",
]
