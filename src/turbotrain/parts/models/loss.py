"""Language-model loss without the full logits: a chunked, fused linear + cross-entropy.

GPT-2 small's plain loss materialises B x T x 50304 logits (1.65 GB in bf16 at B=16, T=1024), their
fp32 upcast (3.3 GB more) and their gradient. Here the tokens go through the output layer
``chunk`` rows at a time, each chunk's fp32 logits giving its loss and, in the same forward, its
gradient (softmax - one-hot), multiplied back at once into the gradients of the hidden states and
of the weight: only those two are kept, memory no longer grows with the vocabulary and no matmul
is recomputed. The math is the plain mean cross-entropy (tests hold it to 1e-5).
:func:`fused_cross_entropy` is the same idea from PyTorch itself (``linear_cross_entropy``, torch
2.13); where the installed torch lacks it, :data:`FUSED_MISSING` says what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# torch >= 2.13: the fused linear + cross-entropy, chunked (never the N x V logits)
FUSED_AVAILABLE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
FUSED_MISSING = (
    f"model.loss = 'fused' needs torch.nn.functional.linear_cross_entropy, which torch {torch.__version__} "
    "does not have (torch 2.13 does): use --model.loss=chunked (turbotrain's own, the same math) or "
    "--model.loss=full"
)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """mean_i CE(hidden_i @ weight.T, target_i), with the gradient computed in forward."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = _chunked(hidden, weight, targets, chunk, grad_hidden, grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.n, ctx.weight_dtype = hidden.shape[0], weight.dtype
        return loss / ctx.n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_out / ctx.n
        return (
            grad_hidden * scale.to(grad_hidden.dtype),
            (grad_weight * scale).to(ctx.weight_dtype),
            None,
            None,
        )


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    grad_hidden: torch.Tensor | None = None,
    grad_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross-entropy by ``chunk`` rows; with the buffers, its gradients written into them."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        logits = (h @ weight.t()).float()  # (chunk, V): under autocast the matmul runs in bf16/fp16
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
        if grad_hidden is not None and grad_weight is not None:
            g = torch.exp(logits.sub_(lse[:, None]))  # softmax, reusing the logits' memory
            g.scatter_add_(1, t[:, None], torch.full_like(lse[:, None], -1.0))  # - one-hot
            g = g.to(h.dtype)
            grad_hidden[start : start + chunk] = g @ weight.to(h.dtype)
            grad_weight += (g.t() @ h).float()
    return loss


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T``, ``chunk`` tokens at a time (no gradients: the loss)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)
    return _chunked(hidden, weight, targets, chunk) / hidden.shape[0]


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (-100 skipped) through
    PyTorch's chunked ``linear_cross_entropy``, as an fp32 scalar: under autocast the matmuls run in
    its dtype and the op returns it, so the per-token losses are averaged in fp32 (a bf16 mean of
    GPT-2's ~10 nats would be off by up to 0.03). torch.compile runs the op eagerly (a graph break)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    # the op's autocast policy is not declared: cast above, accumulate in fp32 inside
    with torch.autocast(device, enabled=False):
        per_token = F.linear_cross_entropy(  # type: ignore[attr-defined]
            hidden,
            weight,
            targets,
            reduction="none",
            options=torch.nn.LinearCrossEntropyOptions(acc_dtype=torch.float32),  # type: ignore[attr-defined]
        )
    # a device-side count (no host sync): the tokens not skipped
    return per_token.float().sum() / (targets != -100).sum()


def lm_loss(x: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, mode: str) -> torch.Tensor:
    """Mean cross-entropy of the output layer ``head`` on hidden states ``x`` (B, T, C) against
    ``targets`` (B, T), by ``model.loss``: 'full' (logits, then fp32 cross-entropy), 'chunked' or 'fused'."""
    if mode == "chunked":
        return chunked_cross_entropy(x.reshape(-1, x.size(-1)), head.weight, targets.reshape(-1))
    if mode == "fused":
        return fused_cross_entropy(x.reshape(-1, x.size(-1)), head.weight, targets.reshape(-1))
    logits = head(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
