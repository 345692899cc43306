"""The mixture-of-experts layer, for any model: :class:`MoE` (``turbotrain.MoE``; docs/moe.md).
The whys the docs leave out:

- **Router in fp32**: bf16 scores flip near-ties between steps.
- **The expert bias** (DeepSeek-V3, ``router_bias_update``) moves once per optimizer step from the
  loads of every micro-batch summed over all ranks (one all-reduce on the device per step), so any
  split of the global batch moves it alike; at the start of a training forward, never in
  activation checkpointing's recompute, which so routes as the forward did.
- **Grouped expert compute** pads each expert's group to ``experts.GROUP_ALIGN`` rows in a buffer
  of static size (the slack goes to the last group: every row is defined). torch 2.13's CPU fp32
  grouped GEMM backward fails only for stride-0 output gradients; here the gradient comes through
  the row gather and is dense. The batched path (CUDA fp32/fp16) pads to the largest group and
  reads it on the host (``# sync:``, one graph break): a static bound would compute E/k times the
  experts' FLOPs (3.4x at E 8, k 2 on CPU), more than a break costs. torch's grouped GEMM has a
  fake implementation for bf16 only, hence :func:`grouped_mm_any` for fp32.
- **Expert parallelism** plugs in through :attr:`MoE.dispatcher` (:mod:`.parallel`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ....base.errors import ConfigError
from .experts import (
    compute_dtype,
    expert_counts,
    experts_batched,
    experts_grouped,
    experts_loop,
    group_starts,
    load_balance_loss,
    route,
)
from .grow import GROW_NOISE, grow_experts, grown_order
from .settings import MOE_IMPLS

EXTRA_STATE_KEY = "_extra_state"  # a MoE layer's state-dict entry for its router-bias loads not yet applied (get_extra_state)


class Dispatcher(Protocol):
    """Moves expert-sorted tokens to the ranks holding their experts and back (expert parallelism)."""

    def dispatch(
        self, x_sorted: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(rows for this rank's experts sorted by local expert, their counts per local expert, state for combine)."""
        ...

    def combine(self, y_local: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs back on the ranks and in the order ``dispatch`` received them."""
        ...


class MoE(nn.Module):
    """A mixture-of-experts layer for any model: ``(..., d_model)`` in, the same shape out (every
    vector is routed on its own).

    ``n_experts`` expert MLPs (``d_model -> hidden -> d_model``, GELU, no biases; ``hidden`` 0 =
    4 x d_model), each vector sent to its ``top_k`` best by a linear router and mixed by the
    router's probabilities; ``capacity_factor`` > 0 caps each expert's slots (0 = dropless);
    ``aux_loss_coef`` weights the load-balancing loss the engine adds to the training loss (0 =
    none); ``router_bias_update`` > 0 turns on DeepSeek-V3's auxiliary-loss-free balancing;
    ``impl`` picks the expert compute (``auto``, ``grouped``, ``batched``, ``loop``); the weights
    start from N(0, ``init_std``) (``out_std`` for the second projection, default ``init_std``).
    Expert weights are ``w1`` (E, d, hidden) and ``w2`` (E, hidden, d); under expert parallelism
    this rank's ``n_local`` experts from ``first_expert``."""

    expert_bias: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        d_model: int,
        n_experts: int = 8,
        top_k: int = 2,
        hidden: int = 0,
        *,
        capacity_factor: float = 0.0,
        aux_loss_coef: float = 0.01,
        router_bias_update: float = 0.0,
        impl: str = "auto",
        init_std: float = 0.02,
        out_std: float | None = None,
    ) -> None:
        super().__init__()
        check_settings(
            d_model, n_experts, top_k, hidden, capacity_factor, aux_loss_coef, router_bias_update, impl
        )
        E, d, h = n_experts, d_model, hidden or 4 * d_model
        self.n_experts, self.top_k = E, top_k
        self.capacity_factor, self.impl = capacity_factor, impl
        self.aux_loss_coef, self.update_rate = aux_loss_coef, router_bias_update
        self.router = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, d, h))
        self.w2 = nn.Parameter(torch.empty(E, h, d))
        nn.init.normal_(self.router.weight, std=init_std)
        nn.init.normal_(self.w1, std=init_std)
        nn.init.normal_(self.w2, std=init_std if out_std is None else out_std)
        self.register_buffer("expert_bias", torch.zeros(E))  # selection bias (router_bias_update); saved
        self.use_bias = router_bias_update > 0
        self.managed = False  # True: an enclosing model (MoEGPT) moves the bias and counts the tokens
        self.first_expert, self.n_local = 0, E
        self.dispatcher: Dispatcher | None = None
        # The last forward's results (plain attributes: not broadcast by DDP, not checkpointed):
        self.last_counts: torch.Tensor | None = None  # (E,) assignments per expert
        self.last_aux: torch.Tensor | None = None  # load-balancing loss (before the coefficient)
        self.pending_aux: torch.Tensor | None = None  # aux_loss_coef x last_aux, until taken
        self.last_dropped: torch.Tensor | None = None  # assignments dropped by the capacity
        # Tallies moved with the module (_apply), never None: a compiled forward that met None
        # in its first step would compile again in its second. Since the last read:
        self.load: torch.Tensor = torch.zeros(E, dtype=torch.long)  # (E,) assignments
        self.dropped: torch.Tensor = torch.zeros((), dtype=torch.long)  # dropped assignments
        self.pending: torch.Tensor | None = self._nothing_pending()  # (E,) finished steps' loads
        self.step_load: torch.Tensor | None = None  # (E,) this optimizer step's loads (per-step mode)
        self.per_step = False  # True: the bias moves once per optimizer step (follow_optimizer_steps)
        self.grew_from = 0  # experts in the checkpoint this layer was grown from (0: not grown)
        self.register_load_state_dict_pre_hook(MoE._grow_on_load)  # called as (module, state, prefix, ...)
        self.register_load_state_dict_pre_hook(MoE._default_extra_state)

    # Checkpoints hold the router-bias loads not applied yet (``pending``) as the extra state,
    # summed over the ranks, so a resume at any world size moves the bias as the uninterrupted run
    # would. An unfinished step's loads (``step_load``) are not saved: a resume redoes that step.

    def _apply(self, fn: Any, recurse: bool = True) -> MoE:
        """``.to()``/``.cuda()`` move the token tallies too (plain attributes, not buffers)."""
        super()._apply(fn, recurse)
        device = self.expert_bias.device
        self.load, self.dropped = self.load.to(device), self.dropped.to(device)
        self.pending, self.step_load = (
            None if t is None else t.to(device) for t in (self.pending, self.step_load)
        )
        return self

    def _nothing_pending(self) -> torch.Tensor | None:
        """Zero loads with the router bias on (they move it by sign(0) = 0), None without: the first
        training forward meets a tensor as every later one does (no recompile at the second step)."""
        return (
            torch.zeros(self.n_experts, dtype=torch.long, device=self.expert_bias.device)
            if self.use_bias
            else None
        )

    def get_extra_state(self) -> torch.Tensor:
        """The (E,) loads since the last bias update, summed over every rank (a collective), zeros if none."""
        if self.pending is None:
            return torch.zeros(self.n_experts, dtype=torch.long, device=self.expert_bias.device)
        total = self.pending.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def set_extra_state(self, state: Any) -> None:
        """The saved sum becomes rank 0's pending loads (zeros on the others: the bias update's
        all-reduce gives every rank the sum again); zeros or another expert count: nothing pending."""
        self.pending, self.step_load = self._nothing_pending(), None
        if not isinstance(state, torch.Tensor) or state.shape != (self.n_experts,) or not bool(state.any()):
            return
        state = state.to(self.expert_bias.device, torch.long)
        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.pending = state.clone() if main else torch.zeros_like(state)

    def _default_extra_state(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint written before the extra state existed: nothing pending (not a missing key)."""
        state.setdefault(prefix + EXTRA_STATE_KEY, torch.zeros(self.n_experts, dtype=torch.long))

    def _grow_on_load(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint with fewer experts grows to this layer's before expert parallelism slices it."""
        w1 = state.get(prefix + "w1")
        if not isinstance(w1, torch.Tensor) or w1.shape[0] >= self.n_experts:
            return
        old = w1.shape[0]
        order = grown_order(old, self.n_experts, self.n_experts // self.n_local)
        self.grew_from = old
        for i, (name, noise) in enumerate(
            (("w1", GROW_NOISE), ("w2", GROW_NOISE), ("router.weight", GROW_NOISE), ("expert_bias", 0.0))
        ):
            if isinstance(state.get(prefix + name), torch.Tensor):
                state[prefix + name] = grow_experts(state[prefix + name], order, noise, seed=1000 * old + i)

    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert with a capacity factor; None when dropless."""
        if self.capacity_factor <= 0:
            return None
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def resolved_impl(self, x: torch.Tensor) -> str:
        """'auto' -> grouped where the grouped GEMM runs (CUDA bf16 compute, CPU fp32/bf16), else batched."""
        if self.impl != "auto":
            return self.impl
        kind, dtype = x.device.type, compute_dtype(x, self.w1.dtype)
        cpu = kind == "cpu" and dtype in (torch.bfloat16, torch.float32)
        return "grouped" if cpu or (kind == "cuda" and dtype == torch.bfloat16) else "batched"

    def compute(self, x: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """This rank's experts over rows sorted by (local) expert, ``counts`` (n_local,) rows each."""
        impl = self.resolved_impl(x)
        if impl == "loop":
            return experts_loop(x, counts, self.w1, self.w2)
        if impl == "grouped" and capacity is None:
            return experts_grouped(x, counts, self.w1, self.w2)
        return experts_batched(x, counts, self.w1, self.w2, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, compute and mix ``x``. In a training forward (not a recompute) of a layer not
        ``managed``, first apply the router-bias loads, then count the tokens and keep the
        load-balancing loss for :meth:`take_aux_loss`."""
        own = self.training and not self.managed and not _recomputing()
        if own and self.update_rate > 0:
            self.update_bias(self.update_rate)
        out = self.mix(x)
        if own:
            self.record(self.update_rate)
            if self.aux_loss_coef > 0 and torch.is_grad_enabled() and self.last_aux is not None:
                self.pending_aux = self.aux_loss_coef * self.last_aux
        return out

    def take_aux_loss(self) -> torch.Tensor | None:
        """``aux_loss_coef x`` the load-balancing loss of the last training forward, once; None in
        evaluation, under ``no_grad`` or with ``aux_loss_coef`` 0 (``engine.backward`` adds it)."""
        aux, self.pending_aux = self.pending_aux, None
        return aux

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's computation alone (sets ``last_counts``, ``last_aux``, ``last_dropped``)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, E, k = x.shape[0], self.n_experts, self.top_k
        weights, experts, probs = route(x, self.router.weight, k, self.expert_bias if self.use_bias else None)
        counts = expert_counts(experts, E)
        self.last_counts = counts
        self.last_aux = load_balance_loss(probs, counts, k)
        flat_e = experts.reshape(-1)
        order = torch.argsort(flat_e, stable=True)  # assignments grouped by expert, token order kept
        token = order // k
        w = weights.reshape(-1)[order]
        capacity, self.last_dropped = self.capacity(N), None
        if capacity is not None:  # drop assignments past each expert's capacity, in token order
            sorted_e = flat_e[order]
            pos = torch.arange(order.numel(), device=x.device) - group_starts(counts)[sorted_e]
            keep = pos < capacity
            w = w * keep
            self.last_dropped = (~keep).sum()
        x_sorted = x[token]
        if self.dispatcher is None:
            y_sorted = self.compute(x_sorted, counts, capacity)
        else:  # expert parallel: capacity drops by zero weight (the rows still travel and compute)
            x_local, local_counts, state = self.dispatcher.dispatch(x_sorted, counts)
            y_sorted = self.dispatcher.combine(self.compute(x_local, local_counts), state)
        out = torch.zeros_like(x, dtype=y_sorted.dtype).index_add_(
            0, token, y_sorted * w[:, None].to(y_sorted.dtype)
        )
        return out.view(shape).to(x.dtype) if out.dtype != x.dtype else out.view(shape)

    def follow_optimizer_steps(self) -> None:
        """From now on the bias moves once per optimizer step: the caller calls
        :meth:`end_optimizer_step` after each one (the engine does both, see ``Engine.setup``)."""
        self.per_step = True

    def end_optimizer_step(self) -> None:
        """An optimizer step ended: its loads are the next training forward's to apply (host only, no sync)."""
        if self.step_load is not None:
            self.pending, self.step_load = _plus(self.pending, self.step_load), None

    def discard_optimizer_step(self) -> None:
        """The step under way is dropped (the out-of-memory policy re-runs it): forget its loads."""
        self.step_load = None

    @torch.no_grad()
    def record(self, update_rate: float) -> None:
        """After a training forward: add its counts to the monitor's and the bias's tallies (no sync)."""
        if self.last_counts is None:
            return
        self.load += self.last_counts
        if self.last_dropped is not None:
            self.dropped += self.last_dropped
        if update_rate > 0 and self.per_step:
            self.step_load = _plus(self.step_load, self.last_counts)
        elif update_rate > 0:
            self.pending = _plus(self.pending, self.last_counts)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: move the bias of under- and over-loaded
        experts by ``rate`` (kept centred) from the loads since the last update. Under a process
        group the loads of the whole global batch, summed over the ranks on the device (a
        collective at the first training forward after a step), so every rank's bias moves alike."""
        if self.pending is None:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.pending, op=dist.ReduceOp.SUM)  # every rank's tokens, on the device
        load = self.pending.float()
        delta = rate * torch.sign(load.mean() - load)
        self.expert_bias += delta - delta.mean()
        self.pending = None

    def take_load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (E,) tally and dropped count since the last call, still on the device, and reset."""
        load, dropped = self.load, self.dropped
        self.load, self.dropped = torch.zeros_like(load), torch.zeros_like(dropped)
        return load, dropped


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """Every MoE layer of ``model`` (wrapped or not) with its qualified name."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            yield name, module


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The load-balancing losses of ``model``'s MoE layers from their last training forward, summed
    and taken, for a loop without the :class:`~turbotrain.Engine` (which adds them in ``backward``):
    ``(loss + aux_loss(model)).backward()``. 0.0 when there are none."""
    total: torch.Tensor | float = 0.0
    for _, layer in moe_layers(model):
        aux = layer.take_aux_loss()
        if aux is not None:
            total = total + aux
    return total


def check_settings(
    d_model: int,
    n_experts: int,
    top_k: int,
    hidden: int,
    capacity_factor: float,
    aux_loss_coef: float,
    router_bias_update: float,
    impl: str,
) -> None:
    """One line naming the argument and what it may be (a ConfigError), for each bad one."""
    if d_model < 1 or n_experts < 1 or hidden < 0:
        raise ConfigError(
            f"MoE(d_model={d_model}, n_experts={n_experts}, hidden={hidden}): d_model and n_experts "
            "must be >= 1, hidden >= 0 (0 = 4 x d_model)"
        )
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"MoE(top_k={top_k}): top_k must be between 1 and n_experts = {n_experts}")
    for name, value in (
        ("capacity_factor", capacity_factor),
        ("aux_loss_coef", aux_loss_coef),
        ("router_bias_update", router_bias_update),
    ):
        if not value >= 0:
            raise ConfigError(f"MoE({name}={value}): must be >= 0 (0 = off)")
    if impl not in MOE_IMPLS:
        raise ConfigError(f"MoE(impl={impl!r}) is not valid; choose one of: {', '.join(MOE_IMPLS)}")


def _plus(total: torch.Tensor | None, loads: torch.Tensor) -> torch.Tensor:
    return loads.clone() if total is None else total + loads


def _recomputing() -> bool:
    """True inside activation checkpointing's eager recompute (it runs in autograd's backward)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def follow_optimizer_steps(model: nn.Module) -> None:
    """A loop without the :class:`~turbotrain.Engine` (which does this in ``setup``):
    every MoE layer of ``model`` moves its router bias once per optimizer step, from the loads of
    all the step's micro-batches; call :func:`end_optimizer_step` after each optimizer step."""
    for _, layer in moe_layers(model):
        layer.follow_optimizer_steps()


def end_optimizer_step(model: nn.Module) -> None:
    """After each optimizer step of a loop that called :func:`follow_optimizer_steps` (every rank)."""
    for _, layer in moe_layers(model):
        layer.end_optimizer_step()
