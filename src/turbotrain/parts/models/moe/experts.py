"""Routing and expert compute of the mixture-of-experts layer (:class:`~turbotrain.parts.models.moe.layer.MoE`):
top-k routing in fp32, the load-balancing loss, the assignments per expert, and the three ways to
run every expert over its rows (one grouped GEMM, a padded ``bmm``, a reference loop). Pure
functions of tensors: the layer's module docstring says why each is the way it is."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

GROUP_ALIGN = 16  # rows per expert group in the grouped GEMM's input (16-byte strides for any dtype)

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def compute_dtype(x: torch.Tensor, otherwise: torch.dtype) -> torch.dtype:
    """What matmuls on ``x``'s device compute in: autocast's dtype while it is on, else ``otherwise``."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if kind != "meta" and torch.is_autocast_enabled(kind) else otherwise


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of tokens ``x`` (N, d) in fp32: (mixing weights (N, k) fp32 summing to 1 per
    token, experts (N, k) int64, router probabilities (N, E) fp32). ``bias`` (E,) shifts which
    experts are *selected*, not the weights."""
    kind = x.device.type  # autocast off (the meta device has none to turn off)
    with torch.autocast(kind, enabled=False) if kind != "meta" else contextlib.nullcontext():
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
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


def group_starts(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


def experts_loop(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul pair per expert over its contiguous rows of ``x`` (sorted by expert)."""
    sizes = counts.tolist()  # sync: the loop needs each expert's row count on the host (reference path only)
    out = [F.gelu(part @ w1[e], approximate="tanh") @ w2[e] for e, part in enumerate(torch.split(x, sizes))]
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[-1])


def _scatter_rows(x: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    buf = x.new_zeros(n_rows, x.shape[1])
    return buf.index_put((rows,), x)


def experts_batched(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, capacity: int | None = None
) -> torch.Tensor:
    """All experts as one ``bmm`` over an (E, C, d) buffer, C the largest group (read on the host)
    or ``capacity`` (rows past it, already dropped by the caller, come back as zeros)."""
    E = w1.shape[0]
    if capacity is None:
        capacity = int(counts.max()) if counts.numel() else 0  # sync: the padded size (CUDA fp32/fp16 path)
    capacity = max(capacity, 1)
    sorted_e = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=x.shape[0])
    pos = torch.arange(x.shape[0], device=x.device) - group_starts(counts)[sorted_e]
    keep = pos < capacity
    trash = E * capacity  # rows past the capacity land in one spare row
    rows = torch.where(keep, sorted_e * capacity + pos, torch.full_like(pos, trash))
    buf = _scatter_rows(x, rows, trash + 1)[:trash].view(E, capacity, -1)
    y = torch.bmm(F.gelu(torch.bmm(buf, w1), approximate="tanh"), w2)  # autocast casts both when on
    y = torch.cat([y.reshape(trash, -1), y.new_zeros(1, y.shape[-1])])
    return y[rows]


def experts_grouped(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """All experts as one grouped GEMM per projection (``F.grouped_mm``): no loop, no host sync."""
    E, M = w1.shape[0], x.shape[0]
    dtype = compute_dtype(x, x.dtype)
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    n_rows = (M + E * GROUP_ALIGN + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    sorted_e = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=M)
    pos = torch.arange(M, device=x.device) - group_starts(counts)[sorted_e]
    rows = group_starts(padded)[sorted_e] + pos
    offs = torch.cumsum(padded, 0).to(torch.int32)
    offs[-1] = n_rows  # the slack belongs to the last expert: its rows are zeros
    buf = _scatter_rows(x.to(dtype), rows, n_rows)
    mm = grouped_mm_any if dtype != torch.bfloat16 and torch.compiler.is_compiling() else _grouped_mm
    h = F.gelu(mm(buf, w1.to(dtype), offs=offs), approximate="tanh")
    return mm(h, w2.to(dtype), offs=offs)[rows]


@torch.library.custom_op("turbotrain::grouped_mm", mutates_args=())
def grouped_mm_any(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` as an opaque op with its own shapes and backward, for any
    dtype under ``torch.compile`` (whose fake implementation takes bf16 only): ``a`` (M, K) with ``b``
    (G, K, N) -> (M, N); ``a`` (K, M) with ``b`` (M, N), groups along M -> (G, K, N)."""
    return _grouped_mm(a, b, offs=offs)


@grouped_mm_any.register_fake
def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[-1])


def _grouped_mm_save(
    ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], output: torch.Tensor
) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(
    ctx: Any, grad: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    """(M, K) x (G, K, N): d a = grad x b^T per group, d b = a^T x grad per group (2-D x 2-D)."""
    a, b, offs = ctx.saved_tensors
    grad_a = grouped_mm_any(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_any(a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm_any.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_save)
