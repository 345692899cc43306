"""Plain PyTorch, hand-tuned the way an expert would: the ``handtuned`` contender (its recipe:
``CONTENDERS["handtuned"]``), using nothing of turbotrain's training code.

On CPU it trains fp32 (a CPU without bf16 units runs bf16 autocast ~14x slower) and eager
(compiling costs ~40 s for ~6% there); the spec's ``handtuned`` entry may set ``compile`` and
``bf16`` to "auto" (on for CUDA, off for CPU), "on" or "off".
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...base.batch import map_tensors
from .protocol import Job, make_loader


def _flag(job: Job, name: str, cuda: bool) -> bool:
    value = job.spec.get("handtuned", {}).get(name, "auto")
    return cuda if value == "auto" else value == "on"


def train_handtuned(job: Job) -> dict[str, Any]:
    """The expert's loop: every switch set by hand, the batches copied asynchronously."""
    dev, clock, o = job.device, job.clock, job.optim
    cuda = dev.type == "cuda"
    use_bf16, use_compile = _flag(job, "bf16", cuda), _flag(job, "compile", cuda)
    resident = cuda and job.spec.get("resident", False)
    clock.start()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_flush_denormal(True)  # CPU: no slow denormal arithmetic
    fmt = torch.channels_last if (cuda and job.has_conv) else torch.preserve_format
    model = job.model.to(dev, memory_format=fmt)  # type: ignore[call-overload]  # torch's stub omits memory_format
    opt, sched = job.plain_optimizer(model, fused=True)
    step_fn = cast(nn.Module, torch.compile(model)) if use_compile else model  # an OptimizedModule
    params = list(model.parameters())
    model.train()

    def to_device(t: torch.Tensor) -> torch.Tensor:  # images channels_last, everything asynchronously
        return (
            t.to(dev, non_blocking=True, memory_format=fmt) if t.ndim == 4 else t.to(dev, non_blocking=True)
        )

    for batch in make_loader(job.batches, pin_memory=cuda and not resident):
        batch = map_tensors(batch, to_device)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = job.loss(step_fn, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o["grad_clip"], foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        clock.mark(loss)
    recipe = ", ".join(
        [
            "bf16 autocast" if use_bf16 else "fp32",
            "torch.compile" if use_compile else "eager",
            "fused AdamW",
            *(["TF32", "cuDNN benchmark"] if cuda else []),
            *(["channels_last"] if cuda and job.has_conv else []),
            *(["pinned non_blocking copies"] if cuda and not resident else []),
        ]
    )
    return job.plain_result(torch.bfloat16 if use_bf16 else None, compiled=use_compile, recipe=recipe)
