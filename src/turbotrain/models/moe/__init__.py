"""The mixture-of-experts family: the MoE layer and GPT (:mod:`.model`), expert parallelism
(:mod:`.parallel`) and its spec (:mod:`.spec`)."""

from .model import (
    EXTRA_STATE_KEY,
    MoEConfig,
    MoEGPT,
    MoEMLP,
    end_optimizer_step,
    expert_counts,
    follow_optimizer_steps,
    grow_experts,
    grown_order,
    load_balance_loss,
    moe_layers,
    route,
)

__all__ = ["EXTRA_STATE_KEY", "MoEConfig", "MoEGPT", "MoEMLP", "end_optimizer_step", "expert_counts",
           "follow_optimizer_steps", "grow_experts", "grown_order", "load_balance_loss", "moe_layers", "route"]
