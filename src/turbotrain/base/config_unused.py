"""The one line for settings of the run's own sections given where they would do nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .config_fields import setting

if TYPE_CHECKING:
    from .config import RunConfig


def unused_run(config: RunConfig, given: Mapping[str, Sequence[str]]) -> str:
    """The one line for settings ``given`` (never a file's) that would do nothing; "" if none."""
    return _unused_best(config, given) or _unused_trackers(config, given)


_TRACKER_FIELDS = {
    "wandb_mode": ("wandb",),
    "mlflow_uri": ("mlflow",),
    "project": ("wandb", "mlflow", "trackio"),
}


def _unused_trackers(config: RunConfig, given: Mapping[str, Sequence[str]]) -> str:
    """monitor.wandb_mode, mlflow_uri or project while the trackers they configure are off."""
    m = config.monitor
    idle = [
        k
        for k in given.get("monitor", ())
        if k in _TRACKER_FIELDS and not any(getattr(m, t) for t in _TRACKER_FIELDS[k])
    ]
    if not idle:
        return ""
    on = [t for t in ("wandb", "mlflow", "trackio") if any(t in _TRACKER_FIELDS[k] for k in idle)]
    return (
        f"{', '.join(f'monitor.{k}' for k in idle)} only configure{'s' if len(idle) == 1 else ''} "
        f"{' / '.join(f'monitor.{t}' for t in on)}, off in this run: nothing would use "
        f"{'it' if len(idle) == 1 else 'them'}; add {' or '.join(setting(f'monitor.{t}', 'true') for t in on)}, "
        f"or drop {'it' if len(idle) == 1 else 'them'}"
    )


def _unused_best(config: RunConfig, given: Mapping[str, Sequence[str]]) -> str:
    """best.metric, mode or min_delta while nothing watches the metric."""
    b = config.best
    idle = [k for k in given.get("best", ()) if k in ("metric", "mode", "min_delta")]
    if b.patience or b.checkpoint or not idle:
        return ""
    return (
        f"{', '.join(f'best.{k}' for k in idle)} choose{'s' if len(idle) == 1 else ''} what early stopping "
        "and the best checkpoint watch, "
        f"and neither is on: add {setting('best.patience', 3)} or {setting('best.checkpoint', 'true')}"
    )
