"""Mixture-of-experts GPT: the reference GPT (:mod:`.gpt`) with routed expert MLPs in every
``moe_every``-th block (workload W3: the GPT-2 small backbone with 8 experts, top-2).

Why each piece is the way it is:

- **Router in fp32**: the softmax over experts decides which weights a token meets; bf16 scores
  flip near-ties between steps, so the router's matmul and softmax run in fp32 even under autocast.
- **Top-k, dropless by default**: each token goes to its ``top_k`` best experts, weighted by its
  router probabilities renormalised over those k (Mixtral). ``capacity_factor > 0`` instead gives
  each expert ``ceil(capacity_factor x tokens x top_k / n_experts)`` slots and drops the
  assignments past them in token order (DeepSpeed / GShard); a dropped assignment adds nothing
  (the token keeps its residual).
- **Load balancing**, two ways that can be combined: the auxiliary loss ``aux_loss_coef x E x
  sum_e f_e P_e`` (Switch / GShard: ``f_e`` the share of assignments, ``P_e`` the mean router
  probability), added to the training loss only (validation reports plain cross-entropy); and the
  auxiliary-loss-free expert bias of DeepSeek-V3 (``router_bias_update`` = its update rate gamma):
  a per-expert bias added to the scores for *selection only* (the mixing weights stay unbiased),
  moved by ``gamma x sign(mean load - load)`` once per optimizer step, from the loads of that
  step: every micro-batch of it, summed over all ranks (the global batch's loads, one all-reduce
  on the device per step), so any split of the global batch (processes x accumulation) moves it
  alike. The :class:`~turbotrain.engine.Engine` marks the steps (``engine.step``, see
  :meth:`MoEMLP.follow_optimizer_steps`); a loop without the engine calls
  :func:`follow_optimizer_steps` once and :func:`end_optimizer_step` after each optimizer step,
  or else the bias moves after every training forward (the same thing without accumulation); a
  loop set up by the engine that steps the optimizer itself, not through ``engine.step``, calls
  :func:`end_optimizer_step` after each step (else the bias stays put).
  The update happens at the start of the next top-level training forward, never inside a block,
  so activation checkpointing's recompute routes exactly as the forward did.
- **Grouped expert compute**: tokens are sorted by expert and all experts run as one grouped GEMM
  (``F.grouped_mm``) per projection on CUDA with bf16 compute and on CPU: no Python loop over
  experts and no host sync; each expert's group is padded to ``GROUP_ALIGN`` rows into a buffer of
  static size (the slack goes to the last group, so every row is defined). (On CPU, torch 2.13's
  fp32 grouped GEMM backward fails only for stride-0 output gradients, such as ``y.sum()``'s; the
  gradient reaching it here comes through the row gather and is dense.) Elsewhere (CUDA fp32/fp16)
  a batched path pads the groups to the largest and runs ``bmm``: it reads that size on the host
  once per layer (marked ``# sync:``), and computes the padding (2.2x the loop's step time on the
  CPU bench, whose loads are uneven). ``moe_impl='loop'`` runs one matmul pair per expert: the
  reference the tests compare with, and the bench's ablation baseline.
- **Observability without syncs**: each MoE layer keeps the tokens it routed to each expert in a
  device tensor (:attr:`MoEMLP.load`), summed over training forwards; :mod:`turbotrain.experts_monitor`
  reads and clears it at the logging cadence.
- **Expert parallelism** plugs in through :attr:`MoEMLP.dispatcher` (see
  :mod:`turbotrain.models.moe.parallel`): the layer then holds only its rank's slice of the experts and
  the dispatcher moves the sorted tokens to the rank of their expert and back.

FLOPs count the *active* parameters per token (:meth:`MoEGPT.flops_per_token`): the experts a
token does not visit cost it nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...config import MOE_IMPLS
from ..gpt import GPT, GPTConfig

GROUP_ALIGN = 16  # rows per expert group in the grouped GEMM's input (16-byte strides for any dtype)

EXTRA_STATE_KEY = "_extra_state"  # a MoE layer's state-dict entry for its router-bias loads not yet applied (get_extra_state)

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1  # block i (0-based) is a MoE block when (i + 1) % moe_every == 0
    expert_hidden: int = 0  # hidden width of each expert's MLP; 0 = 4 x d_model (the dense GPT's)
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0  # 0 = dropless
    router_bias_update: float = 0.0  # DeepSeek-V3 gamma; 0 = no bias
    moe_impl: str = "auto"  # see MOE_IMPLS

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k = {self.top_k} must be between 1 and n_experts = {self.n_experts}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl = {self.moe_impl!r} is not valid; choose one of: {', '.join(MOE_IMPLS)}")

    @property
    def hidden(self) -> int:
        return self.expert_hidden or 4 * self.d_model

    def is_moe_block(self, i: int) -> bool:
        return (i + 1) % self.moe_every == 0


class Dispatcher(Protocol):
    """Moves expert-sorted tokens to the ranks holding their experts and back (expert parallelism)."""

    def dispatch(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(rows for this rank's experts sorted by local expert, their counts per local expert, state for combine)."""
        ...

    def combine(self, y_local: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' outputs back on the ranks and in the order ``dispatch`` received them."""
        ...


# ----------------------------------------------------------------------------- routing


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of tokens ``x`` (N, d) in fp32: (mixing weights (N, k) fp32 summing to 1 per
    token, experts (N, k) int64, router probabilities (N, E) fp32). ``bias`` (E,) shifts which
    experts are *selected*, not the weights."""
    with torch.autocast(x.device.type, enabled=False):
        probs = F.linear(x.float(), router_weight.float()).softmax(dim=-1)
    choose = probs if bias is None else probs + bias
    experts = torch.topk(choose, top_k, dim=-1, sorted=False).indices
    weights = probs.gather(1, experts)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probs


def load_balance_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E x sum_e f_e P_e``: 1.0 at a perfectly even load, up to E
    when one expert takes everything. ``f_e`` (share of assignments) carries no gradient."""
    n_experts = probs.shape[-1]
    share = counts.float() / max(probs.shape[0] * top_k, 1)
    return n_experts * (share * probs.mean(dim=0)).sum()


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert (E,) int64, on the device (no host sync; shape is static)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


# ----------------------------------------------------------------------------- expert compute


def _group_starts(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def experts_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul pair per expert over its contiguous rows of ``x`` (sorted by expert)."""
    sizes = counts.tolist()  # sync: the loop needs each expert's row count on the host (reference path only)
    out = [F.gelu(part @ w1[e], approximate="tanh") @ w2[e] for e, part in enumerate(torch.split(x, sizes))]
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[-1])


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    buf = x.new_zeros(n_rows, x.shape[1])
    return buf.index_put((rows,), x)


def experts_batched(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    capacity: int | None = None) -> torch.Tensor:
    """All experts as one ``bmm`` over an (E, C, d) buffer: each expert's rows padded to C, the
    largest group (read on the host) or ``capacity`` (then rows past it must already be dropped by
    the caller: they are not computed and come back as zeros)."""
    E = w1.shape[0]
    if capacity is None:
        capacity = int(counts.max()) if counts.numel() else 0  # sync: the padded size (CPU/fp32 fallback path)
    capacity = max(capacity, 1)
    sorted_e = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=x.shape[0])
    pos = torch.arange(x.shape[0], device=x.device) - _group_starts(counts)[sorted_e]
    keep = pos < capacity
    trash = E * capacity  # rows past the capacity land in one spare row
    rows = torch.where(keep, sorted_e * capacity + pos, torch.full_like(pos, trash))
    buf = _scatter_rows(x, rows, trash + 1)[:trash].view(E, capacity, -1)
    y = torch.bmm(F.gelu(torch.bmm(buf, w1), approximate="tanh"), w2)  # autocast casts both when on
    y = torch.cat([y.reshape(trash, -1), y.new_zeros(1, y.shape[-1])])
    return y[rows]


def experts_grouped(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """All experts as one grouped GEMM per projection (``F.grouped_mm``): no loop, no host sync.

    Groups are padded to :data:`GROUP_ALIGN` rows in a buffer of static size ``rows + E x
    GROUP_ALIGN`` (rounded to the alignment); the last group takes the slack, whose zero rows
    give zero outputs, so every output row is defined."""
    E, M = w1.shape[0], x.shape[0]
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    n_rows = (M + E * GROUP_ALIGN + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    sorted_e = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=M)
    pos = torch.arange(M, device=x.device) - _group_starts(counts)[sorted_e]
    rows = _group_starts(padded)[sorted_e] + pos
    offs = torch.cumsum(padded, 0).to(torch.int32)
    offs[-1] = n_rows  # the slack belongs to the last expert: its rows are zeros
    buf = _scatter_rows(x.to(dtype), rows, n_rows)
    h = F.gelu(_grouped_mm(buf, w1.to(dtype), offs=offs), approximate="tanh")
    return _grouped_mm(h, w2.to(dtype), offs=offs)[rows]


# ----------------------------------------------------------------------------- growing


GROW_NOISE = 0.01  # new experts: a copy of an existing one plus noise of this x the tensor's std


def grown_order(old: int, new: int, ranks: int = 1) -> list[tuple[int, bool]]:
    """Where each of ``new`` experts comes from when a checkpoint with ``old`` experts loads into a
    model with more: ``(source expert, is_new)`` per position. Positions are dealt to ``ranks``
    contiguous slices of ``new / ranks`` (the expert-parallel layout); each old expert, then each
    new one, goes to the rank holding the fewest so far (ties: the lowest rank), so the copies
    spread over the ranks. New expert i copies old expert ``i mod old``."""
    per_rank = new // ranks
    held: list[list[tuple[int, bool]]] = [[] for _ in range(ranks)]
    for item in [(e, False) for e in range(old)] + [(i % old, True) for i in range(new - old)]:
        min(held, key=len).append(item)  # min() takes the first (lowest) rank among the fewest
    assert all(len(h) == per_rank for h in held)
    return [item for h in held for item in h]


def grow_experts(tensor: torch.Tensor, order: list[tuple[int, bool]], noise: float, seed: int) -> torch.Tensor:
    """``tensor`` (old experts first dim) laid out by ``order``; new rows get ``noise`` x std noise."""
    g = torch.Generator().manual_seed(seed)
    rows = tensor[[src for src, _ in order]].clone()
    if noise > 0:
        scale = noise * float(tensor.float().std()) if tensor.numel() > 1 else 0.0
        for i, (_, is_new) in enumerate(order):
            if is_new:
                rows[i] += (scale * torch.randn(rows[i].shape, generator=g)).to(rows.dtype)
    return rows


# ----------------------------------------------------------------------------- the layer


class MoEMLP(nn.Module):
    """Routed expert MLPs for (B, T, d) input. Expert weights are ``w1`` (E, d, hidden) and
    ``w2`` (E, hidden, d), GELU between (the dense GPT's MLP, without biases); under expert
    parallelism they hold only this rank's ``n_local`` experts starting at ``first_expert``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        E, d, h = cfg.n_experts, cfg.d_model, cfg.hidden
        self.n_experts, self.top_k = E, cfg.top_k
        self.capacity_factor, self.impl = cfg.capacity_factor, cfg.moe_impl
        self.router = nn.Linear(d, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, d, h))
        self.w2 = nn.Parameter(torch.empty(E, h, d))
        nn.init.normal_(self.router.weight, std=0.02)
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02 / math.sqrt(2 * cfg.n_layer))  # GPT-2's residual-projection scaling
        self.register_buffer("expert_bias", torch.zeros(E))  # selection bias (router_bias_update); saved
        self.use_bias = cfg.router_bias_update > 0
        self.first_expert, self.n_local = 0, E
        self.dispatcher: Dispatcher | None = None
        # written by forward, read by MoEGPT and the experts monitor (plain attributes: DDP does not
        # broadcast them, checkpoints do not hold them)
        self.last_counts: torch.Tensor | None = None  # (E,) this forward's assignments per expert
        self.last_aux: torch.Tensor | None = None  # this forward's load-balancing loss (before the coefficient)
        self.last_dropped: torch.Tensor | None = None  # assignments dropped by the capacity
        self.load: torch.Tensor | None = None  # (E,) assignments summed over training forwards since the last read
        self.dropped: torch.Tensor | None = None  # () dropped assignments since the last read
        self.pending: torch.Tensor | None = None  # (E,) loads of finished steps, for the next bias update
        self.step_load: torch.Tensor | None = None  # (E,) this optimizer step's loads so far (per-step mode)
        self.per_step = False  # True: the bias moves once per optimizer step (follow_optimizer_steps)
        self.grew_from = 0  # experts in the checkpoint this layer was grown from (0: not grown)
        self.register_load_state_dict_pre_hook(MoEMLP._grow_on_load)  # called as (module, state, prefix, ...)
        self.register_load_state_dict_pre_hook(MoEMLP._default_extra_state)

    # Checkpoints hold the router-bias loads not applied yet (``pending``: the last optimizer
    # step's, or the last training forward's without step marks, which the next training forward
    # applies) as this layer's extra state, summed over the ranks, so a resume at any world size
    # moves the bias as the uninterrupted run would. A step's loads not finished yet
    # (``step_load``) are not saved: like its gradients, they belong to a step a resume redoes.

    def get_extra_state(self) -> torch.Tensor:
        """The (E,) loads since the last bias update, summed over every rank (zeros when none). A
        collective when there are some under a process group: every rank saves together, and
        every rank has them after the same training forwards."""
        if self.pending is None:
            return torch.zeros(self.n_experts, dtype=torch.long, device=self.expert_bias.device)
        total = self.pending.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def set_extra_state(self, state: Any) -> None:
        """The saved sum becomes rank 0's pending loads (zeros on the others): the bias update's
        all-reduce gives every rank the saved sum again. Zeros (nothing pending) or another expert
        count (grown): nothing pending. Either way no step is under way."""
        self.pending = self.step_load = None
        if not isinstance(state, torch.Tensor) or state.shape != (self.n_experts,) or not bool(state.any()):
            return
        state = state.to(self.expert_bias.device, torch.long)
        main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        self.pending = state.clone() if main else torch.zeros_like(state)

    def _default_extra_state(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint written before the extra state existed: nothing pending (not a missing key)."""
        state.setdefault(prefix + EXTRA_STATE_KEY, torch.zeros(self.n_experts, dtype=torch.long))

    def _grow_on_load(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint with fewer experts: grow it to this layer's (see :func:`grown_order`)
        before anything else reads it (expert parallelism's slicing comes after)."""
        w1 = state.get(prefix + "w1")
        if not isinstance(w1, torch.Tensor) or w1.shape[0] >= self.n_experts:
            return
        old = w1.shape[0]
        order = grown_order(old, self.n_experts, self.n_experts // self.n_local)
        self.grew_from = old
        for i, (name, noise) in enumerate((("w1", GROW_NOISE), ("w2", GROW_NOISE), ("router.weight", GROW_NOISE),
                                           ("expert_bias", 0.0))):
            if isinstance(state.get(prefix + name), torch.Tensor):
                state[prefix + name] = grow_experts(state[prefix + name], order, noise, seed=1000 * old + i)

    def capacity(self, n_tokens: int) -> int | None:
        """Slots per expert with a capacity factor; None when dropless."""
        if self.capacity_factor <= 0:
            return None
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def resolved_impl(self, x: torch.Tensor) -> str:
        """'auto' -> grouped where the grouped GEMM runs: on CUDA with bf16 compute (autocast or
        bf16 weights) and on CPU (fp32 and bf16); batched elsewhere (CUDA fp32/fp16)."""
        if self.impl != "auto":
            return self.impl
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.w1.dtype
        if kind == "cpu" and (dtype == torch.bfloat16 or (dtype == torch.float32 and not torch.compiler.is_compiling())):
            return "grouped"  # compiled, the grouped GEMM's meta function takes bf16 only
        return "grouped" if kind == "cuda" and dtype == torch.bfloat16 else "batched"

    def compute(self, x: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
        """This rank's experts over rows sorted by (local) expert, ``counts`` (n_local,) rows each."""
        impl = self.resolved_impl(x)
        if impl == "loop":
            return experts_loop(x, counts, self.w1, self.w2)
        if impl == "grouped" and capacity is None:
            return experts_grouped(x, counts, self.w1, self.w2)
        return experts_batched(x, counts, self.w1, self.w2, capacity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        capacity = self.capacity(N)
        if capacity is not None:  # drop assignments past each expert's capacity, in token order
            sorted_e = flat_e[order]
            pos = torch.arange(order.numel(), device=x.device) - _group_starts(counts)[sorted_e]
            keep = pos < capacity
            w = w * keep
            self.last_dropped = (~keep).sum()
        else:
            self.last_dropped = None
        x_sorted = x[token]
        if self.dispatcher is None:
            y_sorted = self.compute(x_sorted, counts, capacity)
        else:  # expert parallel: capacity drops by zero weight (the rows still travel and compute)
            x_local, local_counts, state = self.dispatcher.dispatch(x_sorted, counts)
            y_sorted = self.dispatcher.combine(self.compute(x_local, local_counts), state)
        out = torch.zeros_like(x, dtype=y_sorted.dtype).index_add_(0, token, y_sorted * w[:, None].to(y_sorted.dtype))
        return out.view(shape).to(x.dtype) if out.dtype != x.dtype else out.view(shape)

    def follow_optimizer_steps(self) -> None:
        """From now on the bias moves once per optimizer step: the caller calls
        :meth:`end_optimizer_step` after each one (the engine does both, see ``Engine.setup``)."""
        self.per_step = True

    def end_optimizer_step(self) -> None:
        """An optimizer step ended (taken or skipped): its loads, every micro-batch's, become the
        loads the next training forward applies (after summing them over the ranks). Host only:
        no collective, no sync."""
        if self.step_load is not None:
            self.pending = self.step_load if self.pending is None else self.pending + self.step_load
            self.step_load = None

    def discard_optimizer_step(self) -> None:
        """The step under way is dropped (the out-of-memory policy re-runs its batches): forget
        its loads, so the re-run counts them once."""
        self.step_load = None

    @torch.no_grad()
    def record(self, update_rate: float) -> None:
        """After a training forward: add this forward's counts to the monitor's and the bias's
        tallies (device tensors, no sync): the step's loads when following optimizer steps, else
        the loads the next training forward applies."""
        if self.last_counts is None:
            return
        if self.load is None or self.load.device != self.last_counts.device:
            self.load = torch.zeros_like(self.last_counts)
            self.dropped = torch.zeros((), dtype=torch.long, device=self.last_counts.device)
        self.load += self.last_counts
        if self.last_dropped is not None:
            self.dropped += self.last_dropped
        if update_rate > 0 and self.per_step:
            self.step_load = self.last_counts.clone() if self.step_load is None else self.step_load + self.last_counts
        elif update_rate > 0:
            self.pending = self.last_counts.clone() if self.pending is None else self.pending + self.last_counts

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts and
        lower it for over-loaded ones by ``rate`` (kept centred), from the loads since the last
        update: the last optimizer step's (:meth:`follow_optimizer_steps`), else the last forward's.

        Data parallel (a process group): the loads of the whole global batch, summed over every
        rank (each counted only its own tokens, before any expert-parallel dispatch), so the
        replicated biases move alike on every rank. A collective every rank calls at the same
        forward (the first training forward after a step: once per step); the sum stays on the
        device (no host sync)."""
        if self.pending is None:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.pending, op=dist.ReduceOp.SUM)  # every rank's tokens, on the device
        load = self.pending.float()
        delta = rate * torch.sign(load.mean() - load)
        self.expert_bias += delta - delta.mean()
        self.pending = None

    def take_load(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (E,) tally and dropped count since the last call, still on the device, and reset."""
        if self.load is None or self.dropped is None:
            return None
        load, dropped = self.load, self.dropped
        self.load, self.dropped = torch.zeros_like(load), torch.zeros_like(dropped)
        return load, dropped


class MoEGPT(GPT):
    """The reference GPT whose every ``moe_every``-th block has a :class:`MoEMLP`.
    ``model(idx)`` -> logits; ``model(idx, targets)`` -> cross-entropy, plus ``aux_loss_coef`` x
    the mean load-balancing loss over MoE blocks while training."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.cfg: MoEConfig = cfg
        self._moe: list[MoEMLP] = []  # the same objects for the model's life (wrappers wrap blocks, not these)
        for i, block in enumerate(self.blocks):
            if cfg.is_moe_block(i):
                block.mlp = MoEMLP(cfg)
                self._moe.append(block.mlp)

    def moe_layers(self) -> list[MoEMLP]:
        """The MoE layers, in block order (not walked per forward: read from a list kept at build)."""
        return list(self._moe)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        layers = self.moe_layers()
        rate = self.cfg.router_bias_update
        if self.training and rate > 0:
            for layer in layers:  # the previous step's (or forward's) loads, applied before any block runs
                layer.update_bias(rate)
        out = super().forward(idx, targets, attn_mask)
        if self.training:
            for layer in layers:
                layer.record(rate)
            if targets is not None and self.cfg.aux_loss_coef > 0 and layers:
                aux = torch.stack([layer.last_aux for layer in layers if layer.last_aux is not None]).mean()
                out = out + self.cfg.aux_loss_coef * aux
        return out

    def num_active_params(self, non_embedding: bool = True) -> int:
        """Parameters one token meets: all but the experts it is not routed to."""
        c = self.cfg
        layers = self.moe_layers()
        local = sum(layer.w1.numel() + layer.w2.numel() for layer in layers)  # this rank's experts
        per_expert = sum(layer.w1[0].numel() + layer.w2[0].numel() for layer in layers)
        return self.num_params(non_embedding) - local + c.top_k * per_expert

    def num_total_params(self, non_embedding: bool = True) -> int:
        """Every expert counted, also those other ranks hold under expert parallelism."""
        layers = self.moe_layers()
        local = sum(layer.w1.numel() + layer.w2.numel() for layer in layers)
        per_expert = sum(layer.w1[0].numel() + layer.w2[0].numel() for layer in layers)
        return self.num_params(non_embedding) - local + self.cfg.n_experts * per_expert

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token on *active* parameters: 6 N_active + 12 L H Q T."""
        cfg = self.cfg
        T = seq_len or cfg.block_size
        return 6 * self.num_active_params() + 12 * cfg.n_layer * cfg.n_head * (cfg.d_model // cfg.n_head) * T


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoEMLP]]:
    """Every MoE layer of ``model`` (wrapped or not) with its qualified name."""
    for name, module in model.named_modules():
        if isinstance(module, MoEMLP):
            yield name, module


def follow_optimizer_steps(model: nn.Module) -> None:
    """A loop without the :class:`~turbotrain.engine.Engine` (which does this in ``setup``):
    every MoE layer of ``model`` moves its router bias once per optimizer step, from the loads of
    all the step's micro-batches; call :func:`end_optimizer_step` after each optimizer step."""
    for _, layer in moe_layers(model):
        layer.follow_optimizer_steps()


def end_optimizer_step(model: nn.Module) -> None:
    """After each optimizer step of a loop that called :func:`follow_optimizer_steps` (every rank)."""
    for _, layer in moe_layers(model):
        layer.end_optimizer_step()
