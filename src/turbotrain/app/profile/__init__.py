"""``turbotrain profile``: why a training step is slow, and what to change, verified.

A short run of a preset or your workload (``--model FILE.py:FUNC``) through the Engine, ``fit``
and the Monitor: a warm-up, timed steps for the throughput figures, then a ``torch.profiler``
window (:mod:`.trace`: the step split into loader wait, forward, backward, optimizer, hooks and
other host work, device busy/idle and host-to-device copies on CUDA, every host read of a device
value attributed to its line). :mod:`.advice` names the bottleneck and ranks exact changes (a
config flag, or a line of your code) with their expected effect; ``--verify`` (:mod:`.verify`)
applies each config change in its own short run, interleaved with the baseline, and keeps only
what measurably helped. :mod:`.session` runs it and writes the run folder; :mod:`.render` prints.

From Python, on a model and loader you already have::

    from turbotrain.app.profile import profile_workload
    from turbotrain import Workload

    report = profile_workload(Workload(model=model, train_loader=loader), verify=True)
    print(report["bottleneck"], report["figures"]["throughput"])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...parts.workload import Workload, as_workload
from ..measure import Target
from .render import render
from .session import ProfileOptions, profile_target


def profile_workload(
    workload: Workload | Mapping[str, Any],
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    verify: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Profile a model and its data in this process (``turbotrain.app.measure`` copies the model and
    optimizer for every run, so yours stay untouched); ``overrides`` are config settings such as
    ``{"run": {"device": "cpu"}}``; ``options`` are :class:`ProfileOptions` fields. Returns the
    report document (``render(report)`` gives the text)."""
    target = Target(overrides=dict(overrides or {}), workload=as_workload(workload, "profile_workload()"))
    return profile_target(target, ProfileOptions(verify=verify, **options))


__all__ = ["ProfileOptions", "profile_target", "profile_workload", "render"]
