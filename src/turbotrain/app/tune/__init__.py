"""``turbotrain tune``: the fastest settings for a preset or your model, searched with Optuna
(the ``[tune]`` extra: ``pip install 'turbotrain[tune]'``).

:mod:`.space` (what is searched on this device and model), :mod:`.trial` (one trial, in its own
process), :mod:`.runner` (running trials as processes), :mod:`.study` (the Optuna study: penalties and constraints, memory prediction, pruning,
SQLite resume), :mod:`.output` (the preset, table and plot), :mod:`.session` (one tune, end to
end). Optuna is imported only when a study starts: ``import turbotrain.app.tune`` works without it.
"""

from .runner import TuneOptions
from .session import summary, tune
from .study import require_optuna

__all__ = ["TuneOptions", "require_optuna", "summary", "tune"]
