"""The strategy that carries a :class:`~turbotrain.core.plan.ParallelPlan` out (docs/distributed.md):
``single``, ``ddp`` or ``fsdp`` (FSDP2). Each step's loss is averaged over ranks on the device, so
every rank's guard sees the same value and they skip together.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..base.errors import ConfigError
from ..base.launch import Topology
from ..parts.models.blocks import repeated_blocks
from ..parts.models.moe.parallel import GradNormFn, place_experts
from .plan import ParallelPlan
from .process_group import collective_device

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_loaded_instance(obj: Any, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` without importing ``module`` (no object of it exists before)."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


class Strategy:
    """Carries a :class:`ParallelPlan` out; the base class is one process, no communication."""

    name = "single"

    def __init__(self, plan: ParallelPlan | None = None) -> None:
        self.plan = plan or ParallelPlan(Topology())
        self.topology = self.plan.topology
        self.rank, self.world = self.topology.rank, self.topology.world
        # the global gradient norm when experts are spread, and the precision's dtypes (set by wrap)
        self.grad_norm: GradNormFn | None = None
        self.dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, torch.float32)

    def wrap(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None = torch.float32,
    ) -> nn.Module:
        """The model to train: the experts placed on their ranks, the rest wrapped for the data dimension."""
        placed = place_experts(model, optimizer, self.plan.experts)
        self.grad_norm, self.dtypes = placed.grad_norm, (param_dtype, reduce_dtype)
        return self.wrap_data(model, optimizer, placed.params)

    def wrap_data(
        self, model: nn.Module, optimizer: Optimizer | None, experts: list[nn.Parameter]
    ) -> nn.Module:
        """``model`` wrapped so its parameters other than ``experts`` are averaged over ranks."""
        return model

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        """Whether the coming backward reduces gradients across ranks (only at accumulation boundaries)."""

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over ranks in place, enqueued on the device (no host sync)."""
        return tensor

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A plain tensor from a possibly sharded one (a DTensor's global value)."""
        return tensor

    def any_rank(self, flag: bool, device: torch.device | None = None) -> bool:
        """Whether ``flag`` is True on any rank (a sync point under NCCL: every N steps, on every rank)."""
        return flag


class DataParallel(Strategy):
    """Shared by DDP and FSDP2: averaging over the process group."""

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        # SUM then divide: gloo's AVG has had a silent-correctness bug in some versions.
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.div_(self.world)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        return (
            cast("DTensor", tensor).full_tensor()
            if is_loaded_instance(tensor, "torch.distributed.tensor", "DTensor")
            else tensor
        )

    def any_rank(self, flag: bool, device: torch.device | None = None) -> bool:
        t = torch.tensor(int(flag), device=device or collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())  # sync: the agreed answer is needed on the host


class DDP(DataParallel):
    name = "ddp"

    def __init__(self, plan: ParallelPlan, device: torch.device) -> None:
        super().__init__(plan)
        self.device = device

    def wrap_data(
        self, model: nn.Module, optimizer: Optimizer | None, experts: list[nn.Parameter]
    ) -> nn.Module:
        if experts:
            # the one private call kept: DDP (torch 2.13) has no public way to leave parameters out;
            # this static method is the one its own tests and torchrec use
            names = [name for name, p in model.named_parameters() if any(p is e for e in experts)]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        cfg = self.plan.settings
        # the data dimension spans every rank (no pipeline or tensor dimension yet): the default group
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            static_graph=cfg.static_graph,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        )

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        # the flag DDP's no_sync() context sets (the window holds what wrap() returned: a DDP)
        cast(DistributedDataParallel, model).require_backward_grad_sync = sync


class FSDP(DataParallel):
    name = "fsdp"

    def wrap_data(
        self, model: nn.Module, optimizer: Optimizer | None, experts: list[nn.Parameter]
    ) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # ~0.5 s: fsdp runs only

        names = {id(p): name for name, p in model.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=self.dtypes[0], reduce_dtype=self.dtypes[1])
        reshard = self.plan.settings.reshard_after_forward
        # the plan's mesh (its only dimension here is data: FSDP with experts is refused when resolved)
        mesh = self.plan.mesh["data"] if self.plan.mesh is not None else None
        for block in repeated_blocks(model) or ():
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        if optimizer is not None:
            if optimizer.state:
                raise ConfigError(
                    "distributed.strategy = 'fsdp' shards the parameters: call engine.setup(model, optimizer) "
                    "before the optimizer's first step"
                )
            sharded = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def build_strategy(plan: ParallelPlan, device: torch.device) -> Strategy:
    """The strategy that carries ``plan`` out on ``device``, after joining its process groups."""
    plan.join(device)
    if plan.strategy == "single":
        return Strategy(plan)
    return DDP(plan, device) if plan.strategy == "ddp" else FSDP(plan)
