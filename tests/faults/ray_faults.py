"""A Ray Train worker that kills itself with SIGKILL once (tests/distributed/test_ray_train.py).

Ray starts its workers itself, long after their interpreter (and this folder's ``sitecustomize``)
started, so ``TT_FAULT`` cannot reach them: :func:`train_loop_killed_once` arms the fault from
inside the worker, as sitecustomize's ``step`` point does (SIGKILL inside an optimizer step, before
its forward), on one rank and on the first attempt only: a marker file, written just before the
kill, tells the group Ray starts again not to arm it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import ray.train

import turbotrain.core.engine as engine
from turbotrain.integrations.ray import train_loop


def train_loop_killed_once(config: dict[str, Any]) -> Any:
    """:func:`train_loop`, with rank ``config["kill"]["rank"]`` killed with SIGKILL inside step
    ``config["kill"]["step"]``, unless ``config["kill"]["marker"]`` exists (written before the kill)."""
    kill = config["kill"]
    marker = Path(kill["marker"])
    if ray.train.get_context().get_world_rank() == kill["rank"] and not marker.exists():
        train_window = engine.Engine.train_window

        def killed(self: engine.Engine, *args: Any, **kwargs: Any) -> Any:
            if self.state.step + 1 == kill["step"]:
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return train_window(self, *args, **kwargs)

        engine.Engine.train_window = killed  # type: ignore[method-assign]
    return train_loop(config)
