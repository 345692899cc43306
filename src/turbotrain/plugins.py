"""What an extender imports: the stable names for adding a precision, a model family, a start-of-run
decision or a hook to ``fit`` (docs/api.md lists them by purpose; docs/plugins.md, docs/early-stopping.md).

The layer folders may move their modules between releases; these names stay here. ``import turbotrain``
does not import this module (it loads the loop's hooks): ``from turbotrain.plugins import ModelSpec``.
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
