"""The mixture-of-experts family: the layer any model can use (:class:`MoE`, :mod:`.layer`), the
MoE GPT (:mod:`.model`) and expert parallelism (:mod:`.parallel`)."""

from .layer import (
    EXTRA_STATE_KEY,
    MoE,
    aux_loss,
    end_optimizer_step,
    expert_counts,
    follow_optimizer_steps,
    grow_experts,
    grown_order,
    load_balance_loss,
    moe_layers,
    route,
)
from .model import MoEConfig, MoEGPT, MoEMLP

__all__ = [
    "EXTRA_STATE_KEY",
    "MoE",
    "MoEConfig",
    "MoEGPT",
    "MoEMLP",
    "aux_loss",
    "end_optimizer_step",
    "expert_counts",
    "follow_optimizer_steps",
    "grow_experts",
    "grown_order",
    "load_balance_loss",
    "moe_layers",
    "route",
]
