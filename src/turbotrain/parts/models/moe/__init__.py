"""The mixture-of-experts family: the layer any model can use (:class:`MoE`, :mod:`.layer`; its routing and expert compute in :mod:`.experts`, growing in :mod:`.grow`), the
MoE GPT (:mod:`.model`) and expert parallelism (:mod:`.parallel`)."""

from .experts import expert_counts, load_balance_loss, route
from .grow import grow_experts, grown_loads, grown_order, new_positions, regrown
from .layer import EXTRA_STATE_KEY, MoE, aux_loss, end_optimizer_step, follow_optimizer_steps, moe_layers
from .model import MoEConfig, MoEGPT, MoEMLP
