"""The mixture-of-experts GPT's spec: the GPT's data, a :class:`MoEGPT` from ``[model]`` (the
backbone) and ``[moe]`` (the experts); expert parallelism applies to any model's MoE layers."""

from __future__ import annotations

from typing import Any

from torch import nn

from ....base.config import RunConfig
from ....base.config_plugins import same_fields
from ..gpt.settings import GPTSettings, gpt_settings
from ..gpt.spec import GPTSpec, gpt_config
from .model import MoEConfig, MoEGPT
from .settings import MoESettings


def moe_config(m: GPTSettings, e: MoESettings, vocab_size: int) -> MoEConfig:
    """The mixture-of-experts GPT of a run's ``[model]`` (backbone) and ``[moe]`` (experts) sections."""
    return MoEConfig(
        **vars(gpt_config(m, vocab_size)), **same_fields(MoEConfig, e), moe_every=e.every, moe_impl=e.impl
    )


class MoESpec(GPTSpec):
    """A GPT whose MLPs (every ``moe.every``-th) are mixtures of experts."""

    name = "moe"

    def build_model(self, c: RunConfig, vocab_size: int) -> MoEGPT:
        return MoEGPT(moe_config(gpt_settings(c), c.table(MoESettings), vocab_size))

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        assert isinstance(model, MoEGPT)
        return {
            **super().facts(c, model),
            "params": model.num_total_params(non_embedding=False),  # every expert
            "active_params": model.num_active_params(non_embedding=False),
        }

    def experts(self, c: RunConfig) -> int | None:
        return c.table(MoESettings).n_experts

    def weight_count(self, c: RunConfig) -> int:
        """The GPT's count with every MoE block's experts in place of its MLP."""
        m, e = gpt_settings(c), c.table(MoESettings)
        d, hidden, moe = m.d_model, e.expert_hidden or 4 * m.d_model, m.n_layer // e.every
        return super().weight_count(c) - moe * 8 * d * d + moe * e.n_experts * 2 * d * hidden
