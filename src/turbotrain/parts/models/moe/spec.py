"""The mixture-of-experts GPT's spec: the GPT's data and unit, a :class:`MoEGPT` from the run's
``model`` section, parameters counted with every expert (and those one token meets). Expert
parallelism is not the spec's: it applies to the MoE layers of any model (:mod:`.parallel`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ....base.config import ModelConfig, RunConfig
from ..gpt.spec import GPTSpec, gpt_config
from .model import MoEConfig, MoEGPT


def moe_config(m: ModelConfig, vocab_size: int) -> MoEConfig:
    """The mixture-of-experts GPT a run's ``model`` section describes (``arch = 'moe'``)."""
    return MoEConfig(
        **vars(gpt_config(m, vocab_size)), n_experts=m.n_experts, top_k=m.top_k, moe_every=m.moe_every,
        expert_hidden=m.expert_hidden, aux_loss_coef=m.aux_loss_coef, capacity_factor=m.capacity_factor,
        router_bias_update=m.router_bias_update, moe_impl=m.moe_impl,
    )


class MoESpec(GPTSpec):
    """A GPT whose MLPs (every ``model.moe_every``-th) are mixtures of experts."""

    name = "moe"

    def build_model(self, m: ModelConfig, vocab_size: int) -> MoEGPT:
        return MoEGPT(moe_config(m, vocab_size))

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        assert isinstance(model, MoEGPT)
        return {**super().facts(c, model), "params": model.num_total_params(non_embedding=False),  # every expert
                "active_params": model.num_active_params(non_embedding=False)}

    def experts(self, c: RunConfig) -> int | None:
        return c.model.n_experts

    def weight_count(self, c: RunConfig) -> int:
        """The GPT's count with every MoE block's experts in place of its MLP."""
        m = c.model
        d, hidden, moe = m.d_model, m.expert_hidden or 4 * m.d_model, m.n_layer // m.moe_every
        return super().weight_count(c) - moe * 8 * d * d + moe * m.n_experts * 2 * d * hidden
