"""``turbotrain profile`` (docs/profile-tune.md): :mod:`.session` runs a profiled run (:mod:`.trace`,
:mod:`.syncs`), :mod:`.advice` ranks changes, ``--verify`` (in :mod:`.session`) measures them. From Python::

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
    """Profile a model and its data in this process (yours stay untouched: every run takes a copy);
    ``overrides`` are config settings, ``options`` :class:`ProfileOptions` fields. Returns the report
    document (``render(report)`` gives the text)."""
    target = Target(overrides=dict(overrides or {}), workload=as_workload(workload, "profile_workload()"))
    return profile_target(target, ProfileOptions(verify=verify, **options))
