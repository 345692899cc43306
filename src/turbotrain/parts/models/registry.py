"""Which spec a run's config names: the one place that maps ``model.workload`` / ``model.arch`` to a family."""

from __future__ import annotations

from ...base.config import RunConfig
from ...base.errors import ConfigError
from .gpt import GPT
from .gpt.spec import GPTSpec
from .moe.spec import MoESpec
from .spec import ModelSpec
from .workload_spec import WorkloadSpec


def spec_for(c: RunConfig) -> ModelSpec:
    """The spec of the run's model: a workload when ``model.workload`` names one, else ``model.arch``'s."""
    if c.model.workload:
        return WorkloadSpec(c.model.workload)
    return MoESpec() if c.model.arch == "moe" else GPTSpec()


def build_model(c: RunConfig, vocab_size: int) -> GPT:
    """The run's language model from its config alone (``sample`` and ``memory`` build it without
    data): its family's spec builds it (a GPT, or for ``arch = 'moe'`` a :class:`MoEGPT`)."""
    spec = spec_for(c)
    if not isinstance(spec, GPTSpec):
        raise ConfigError(
            f"{c.model.workload} is your own model: its FUNC builds it with its data, not the config"
        )
    return spec.build_model(c, vocab_size)
