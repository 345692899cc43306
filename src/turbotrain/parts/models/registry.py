"""Which spec a run's config names: the one place that maps ``model.workload`` / ``model.arch`` to a family."""

from __future__ import annotations

from ...base.config import RunConfig
from .gpt.spec import GPTSpec
from .moe.spec import MoESpec
from .spec import ModelSpec
from .workload_spec import WorkloadSpec


def spec_for(c: RunConfig) -> ModelSpec:
    """The spec of the run's model: a workload when ``model.workload`` names one, else ``model.arch``'s."""
    if c.model.workload:
        return WorkloadSpec(c.model.workload)
    return MoESpec() if c.model.arch == "moe" else GPTSpec()
