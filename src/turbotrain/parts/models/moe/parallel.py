"""Expert parallelism (docs/moe.md): each MoE block's experts spread over an expert-parallel group,
tokens sent to their expert's rank with an all-to-all and back; the expert dimension of the run's
:class:`turbotrain.core.plan.ParallelPlan`, placed by :func:`place_experts` in ``engine.setup``.

Degree ``P``: ranks ``[g P, (g + 1) P)`` form expert-parallel group g; rank r holds experts
``[(r mod P) E/P, (r mod P + 1) E/P)`` of every block, and the ranks with the same ``r mod P`` are
its replica group. The per-expert counts travel first and the split sizes are read on the host
(the one sync an uneven all-to-all needs), then the rows (``all_to_all_single_autograd``: backward
sends the gradients back). Expert gradients skip DDP: a hook reduces each over its replica group
on every backward (accumulation sums already-reduced gradients: the same result). Checkpoints hold
every expert whole (the state-dict hooks gather the shards: a collective).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from ....base.config import setting
from ....base.errors import ConfigError
from .grow import grow_experts, grown_order, new_positions
from .layer import MoE, moe_layers

log = logging.getLogger(__name__)

GradNormFn = Callable[[Sequence[torch.Tensor]], torch.Tensor]
"""``fn(params) -> total gradient norm`` (2-norm over every ``p.grad``, a 0-dim device tensor)."""


class AllToAllDispatcher:
    """Moves expert-sorted rows to their experts' ranks within ``group`` and back."""

    def __init__(self, group: Any, size: int, n_local: int) -> None:
        self.group, self.size, self.n_local = group, size, n_local

    def dispatch(
        self, x_sorted: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        P, E_l = self.size, self.n_local
        recv_counts = torch.empty_like(counts)
        # E_l counts to each rank: its experts' rows from me
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv = recv_counts.view(P, E_l)  # [source rank, local expert]
        # sync: uneven all-to-all splits on the host
        sizes = torch.cat([counts.view(P, E_l).sum(1), recv.sum(1)]).tolist()
        send_sizes, recv_sizes = sizes[:P], sizes[P:]
        x_recv = all_to_all_single_autograd(x_sorted, recv_sizes, send_sizes, self.group)
        # rows arrive grouped by (source rank, local expert): regroup them by local expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(E_l, device=counts.device).repeat(P), recv.reshape(-1), output_size=x_recv.shape[0]
        )
        order = torch.argsort(expert_of_row, stable=True)
        return x_recv[order], recv.sum(0), (order, send_sizes, recv_sizes)

    def combine(self, y_local: torch.Tensor, state: Any) -> torch.Tensor:
        order, send_sizes, recv_sizes = state
        # back to (source rank, expert) order
        y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)
        return all_to_all_single_autograd(y_recv, send_sizes, recv_sizes, self.group)


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank sits: its expert-parallel group (size ``degree``) and replica group."""

    degree: int
    world: int
    rank: int
    ep_group: Any = None
    replica_group: Any = None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.degree

    @property
    def replicas(self) -> int:
        return self.world // self.degree


def check_degree(degree: int, world: int, n_experts: int | None) -> None:
    """One-line errors for a degree that does not divide the world size or the expert count
    (None: not known yet, a workload's MoE layers are checked when they are sharded)."""
    if degree < 1 or world % degree:
        example = world if n_experts is None or n_experts % world == 0 else 1
        raise ConfigError(
            f"distributed.expert_parallel = {degree} must divide the world size {world} "
            f"(processes launched), e.g. {setting('distributed.expert_parallel', example)}"
        )
    if n_experts is not None and n_experts % degree:
        raise ConfigError(
            f"distributed.expert_parallel = {degree} must divide the {n_experts} experts of each MoE block"
        )


def _reduce_hook(layout: ExpertLayout) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # This rank's expert gradient sums the contributions of every rank in its expert-parallel
        # group (the all-to-all brought them here); DDP averages the others over `world`, so divide
        # by `world` and add the replicas' sums: the gradient of the mean loss over all ranks.
        grad = grad / layout.world
        if layout.replicas > 1:
            # SUM: gloo's AVG has had bugs
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=layout.replica_group)
        return grad

    return hook


@dataclass(frozen=True)
class PlacedExperts:
    """This rank's expert parameters (left out of data parallelism) and the global gradient norm."""

    params: list[nn.Parameter]
    grad_norm: GradNormFn | None = None


# optimizers whose state follows the experts
_attached: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def place_experts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: ExpertLayout | None
) -> PlacedExperts:
    """The expert dimension of a parallel plan, before the data-parallel wrapper: with a ``layout``
    (degree > 1), keep this rank's slice of every MoE block's experts (:func:`shard_experts`) and
    point ``optimizer`` (still without state) at the slices; for any MoE model the optimizer's
    state then follows the experts (:func:`attach_optimizer`). A ``layout`` for a model without
    MoE layers is one line. Placing twice does nothing more."""
    layers = [layer for _, layer in moe_layers(model)]
    if layout is not None and not layers:
        raise ConfigError(
            f"distributed.expert_parallel = {layout.degree} needs a mixture-of-experts model "
            f"({setting('model.arch', 'moe')}, or a --model with turbotrain.MoE layers)"
        )
    if layout is not None and not any(isinstance(layer.dispatcher, AllToAllDispatcher) for layer in layers):
        check_degree(layout.degree, layout.world, layers[0].n_experts)
        if optimizer is not None and optimizer.state:
            raise ConfigError(
                f"distributed.expert_parallel = {layout.degree} keeps a slice of the experts on each rank: "
                "call engine.setup(model, optimizer) before the optimizer's first step"
            )
        slices = shard_experts(layers, layout)
        for group in optimizer.param_groups if optimizer is not None else ():
            group["params"] = [slices.get(id(p), p) for p in group["params"]]
    if optimizer is not None:
        attach_optimizer(model, optimizer)
    spread = layout is not None and layout.degree > 1
    return PlacedExperts(
        [p for layer in layers for p in (layer.w1, layer.w2)] if spread else [],
        grad_norm(model) if spread else None,
    )


def shard_experts(layers: list[MoE], layout: ExpertLayout) -> dict[int, nn.Parameter]:
    """Keep this rank's slice of every MoE block's experts; returns the new parameter for each old ``id``."""
    n_local = layers[0].n_experts // layout.degree
    first = layout.ep_rank * n_local
    hook = _reduce_hook(layout)
    slices: dict[int, nn.Parameter] = {}
    for layer in layers:
        old = (layer.w1, layer.w2)
        with torch.no_grad():
            layer.w1 = nn.Parameter(layer.w1[first : first + n_local].clone())
            layer.w2 = nn.Parameter(layer.w2[first : first + n_local].clone())
        layer.first_expert, layer.n_local = first, n_local
        slices.update({id(o): n for o, n in zip(old, (layer.w1, layer.w2))})
        layer.dispatcher = AllToAllDispatcher(layout.ep_group, layout.degree, n_local)
        for p in (layer.w1, layer.w2):
            p.register_hook(hook)
        layer.register_state_dict_post_hook(_full_experts_hook(layout))  # checkpoints hold every expert
        layer.register_load_state_dict_pre_hook(_local_experts_hook(layer))
    log.info(
        "expert parallel: degree %d, rank %d holds experts %d..%d of each MoE block",
        layout.degree,
        layout.rank,
        first,
        first + n_local - 1,
    )
    return slices


def grad_norm(model: nn.Module) -> GradNormFn | None:
    """The global gradient norm under expert parallelism, for ``engine.set_grad_norm``: the fp32
    2-norm over the non-expert gradients and every rank's expert gradients, the same on every rank;
    a collective over the expert-parallel group every rank calls at every step. None (the engine's
    default norm) when no experts are sharded (call it after :func:`shard_experts`)."""
    layers = [layer for _, layer in moe_layers(model) if isinstance(layer.dispatcher, AllToAllDispatcher)]
    if not layers:
        return None
    first = layers[0].dispatcher
    assert isinstance(first, AllToAllDispatcher)  # the filter above
    group = first.group  # every MoE block shares this rank's expert-parallel group
    experts = {id(p) for layer in layers for p in (layer.w1, layer.w2)}

    def norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
        dense = [p.grad for p in params if p.grad is not None and id(p) not in experts]
        local = [p.grad for p in params if p.grad is not None and id(p) in experts]
        device = next((p.device for p in params), torch.device("cpu"))
        # every rank joins the all-reduce, with or without gradients
        squared = (
            torch.nn.utils.get_total_norm(local, foreach=True).to(device, torch.float32).square()
            if local
            else torch.zeros((), device=device)
        )
        # all the experts of this group: every expert once
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
        if dense:
            squared = squared + torch.nn.utils.get_total_norm(dense, foreach=True).float().square()
        return squared.sqrt()

    return norm


def gather_experts(local: torch.Tensor, degree: int, group: Any) -> torch.Tensor:
    """The whole (n_experts, ...) tensor from each rank's (n_local, ...) slice: a collective over
    the expert-parallel ``group`` of ``degree`` ranks (every rank of it calls it, in the same order)."""
    parts = [torch.empty_like(local) for _ in range(degree)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts)


def _full_experts_hook(layout: ExpertLayout) -> Any:
    def hook(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in ("w1", "w2"):
            state[prefix + name] = gather_experts(state[prefix + name], layout.degree, layout.ep_group)

    return hook


def _local_experts_hook(layer: MoE) -> Any:
    """Loading: a checkpoint's full expert tensors (any degree wrote them) -> this rank's slice."""

    def hook(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in ("w1", "w2"):
            value = state.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.shape[0] == layer.n_experts != layer.n_local:
                state[prefix + name] = value[layer.first_expert : layer.first_expert + layer.n_local]

    return hook


def attach_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """For a MoE model, make the optimizer's state follow the experts: under expert parallelism
    ``state_dict()`` holds every expert's state (gathered) and ``load_state_dict`` keeps this
    rank's slice, so a checkpoint resumes at any degree; a checkpoint with fewer experts (grown on
    load) gives the new experts and their router rows zero moments. Nothing for other models or
    an optimizer attached already. Call after the experts are placed (the hooks find the
    parameters by identity): :func:`place_experts` does."""
    layers = [layer for _, layer in moe_layers(model)]
    if not layers or optimizer in _attached:
        return
    _attached.add(optimizer)
    routed = {
        id(p): (layer, sharded)
        for layer in layers
        for p, sharded in ((layer.w1, True), (layer.w2, True), (layer.router.weight, False))
    }

    def positions() -> dict[int, tuple[MoE, bool]]:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i: routed[id(p)] for i, p in enumerate(params) if id(p) in routed}

    # The hooks replace entries in new dicts: state_dict()'s per-parameter dicts are the optimizer's
    # live state, and load_state_dict's argument is the caller's.
    def gather(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["state"] = dict(state_dict["state"])
        for i, (layer, sharded) in sorted(positions().items()):
            if not sharded or layer.dispatcher is None or i not in state_dict["state"]:
                continue
            entry = state_dict["state"][i] = dict(state_dict["state"][i])
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == layer.n_local:
                    group = getattr(layer.dispatcher, "group", None)
                    entry[key] = gather_experts(value, layer.n_experts // layer.n_local, group)
        return state_dict

    def scatter(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict["state"] = dict(state_dict["state"])
        for i, (layer, sharded) in positions().items():
            key_i = _saved_key(state_dict, i)
            if key_i is None:
                continue
            entry = state_dict["state"][key_i] = dict(state_dict["state"][key_i])
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entry[key] = _local_experts(value, layer, sharded)
        return state_dict

    optimizer.register_state_dict_post_hook(gather)
    optimizer.register_load_state_dict_pre_hook(scatter)


def _local_experts(value: torch.Tensor, layer: MoE, sharded: bool) -> torch.Tensor:
    """A saved per-expert optimizer state grown to the layer's experts (new ones 0), this rank's slice."""
    if value.shape[0] < layer.n_experts and value.shape[0] == layer.grew_from:
        order = grown_order(value.shape[0], layer.n_experts, layer.n_experts // layer.n_local)
        value = grow_experts(value, order, 0.0, 0)
        value[new_positions(order)] = 0
    if sharded and value.shape[0] == layer.n_experts != layer.n_local:
        value = value[layer.first_expert : layer.first_expert + layer.n_local]
    return value


def _saved_key(state_dict: dict[str, Any], position: int) -> Any:
    """The key of this optimizer's ``position``-th parameter's state in a state dict to load, found
    as ``Optimizer.load_state_dict`` finds it (the saved ``param_groups`` list the keys in parameter
    order): a position, its string (JSON) or a parameter name (``set_state_dict`` of
    ``torch.distributed.checkpoint``); None when the state holds nothing for it."""
    state = state_dict["state"]
    saved = [key for group in state_dict.get("param_groups", ()) for key in group.get("params", ())]
    key = saved[position] if position < len(saved) else position
    for candidate in (key, str(key)):
        if candidate in state:
            return candidate
    return None
