"""``turbotrain tune``: the fastest settings for a preset or your model, searched with Optuna (the
``[tune]`` extra), imported only when a study starts: ``import turbotrain.app.tune`` works without it."""

from .runner import TuneOptions
from .session import summary, tune
from .study import require_optuna
