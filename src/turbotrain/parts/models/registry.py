"""Which spec a run's config names: the one place that maps ``model.workload`` / ``model.arch`` to a
family. A family is one folder (its model, its settings registered on import, its
:class:`~turbotrain.parts.models.spec.ModelSpec`) plus one line here (docs/model_specs.md)."""

from __future__ import annotations

from torch import nn

from ...base.config import ARCHS, RunConfig
from .gpt.spec import GPTSpec
from .llama.spec import LlamaSpec
from .moe.spec import MoESpec
from .spec import ModelSpec
from .workload_spec import WorkloadSpec

FAMILIES: dict[str, type[ModelSpec]] = {}
"""Every model family by its ``model.arch`` name (its spec's ``name``), in registration order."""


def register_family(spec: type[ModelSpec]) -> type[ModelSpec]:
    """Make ``spec`` selectable as ``model.arch = spec.name`` (validation and ``--help-config`` read
    the names from here). Its settings registered themselves when its folder was imported."""
    FAMILIES[spec.name] = spec
    ARCHS.add(spec.name)
    return spec


register_family(GPTSpec)
register_family(MoESpec)
register_family(LlamaSpec)


def spec_for(c: RunConfig) -> ModelSpec:
    """The spec of the run's model: a workload when ``model.workload`` names one, else ``model.arch``'s."""
    if c.model.workload:
        return WorkloadSpec(c.model.workload)
    return FAMILIES[c.model.arch]()


def build_model(c: RunConfig, vocab_size: int) -> nn.Module:
    """The run's model from its config alone (``sample`` and ``memory``), by its family's spec."""
    return spec_for(c).build_model(c, vocab_size)
