"""AdamW with the right implementation for the device; warmup + decay schedules, the adaptive
(plateau) one, and the LR scaling rule for a changed global batch."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from ..base.config import LR_SCALINGS, OPTIM_IMPLEMENTATIONS, SCHEDULES, OptimConfig, choice_error


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay; norms, biases and embeddings (incl. tied heads) do not."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(
            module, (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)
        ):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():  # parameters() deduplicates tied weights
        if not p.requires_grad:
            continue
        (rest if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


@functools.cache
def has_fused_adamw(device_type: str) -> bool:
    """Whether the installed torch has a fused AdamW kernel for this device type (asked by building one)."""
    try:
        torch.optim.AdamW([nn.Parameter(torch.zeros(1, device=device_type))], fused=True)
        return True
    except (RuntimeError, ValueError):
        return False


def resolve_implementation(implementation: str, device: torch.device) -> str:
    """'auto' -> 'fused' wherever torch has the kernel, else 'foreach'. On the 2-core CPU fused was
    1.7x (tiny MLP) to >10x (4-layer GPT) faster than foreach, the same losses to 5e-7 over 60 steps."""
    if implementation == "auto":
        return "fused" if has_fused_adamw(device.type) else "foreach"
    if implementation not in OPTIM_IMPLEMENTATIONS:
        raise choice_error("optim.implementation", implementation, ("auto", *OPTIM_IMPLEMENTATIONS))
    return implementation


def build_optimizer(
    model: nn.Module,
    device: torch.device,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    implementation: str = "auto",
) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters with decay groups and the device's fastest kernel."""
    impl = resolve_implementation(implementation, device)
    flags = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **flags)


def apply_fast_adam_kernel(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Switch a user's ``torch.optim.Adam``/``AdamW`` to the fused kernel (else foreach) in place, so
    a scheduler holding it stays valid; what changed (``"AdamW: fused"``), or None."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    groups = optimizer.param_groups
    impl = resolve_implementation("auto", device)
    if any(g.get("differentiable") for g in groups) or all(g.get(impl) for g in groups):
        return None
    if impl == "foreach" and any(torch.is_tensor(g["lr"]) and not g.get("capturable") for g in groups):
        return None
    flags = {"fused": impl == "fused", "foreach": impl == "foreach"}
    for group in groups:
        group.update(flags)
    optimizer.defaults.update(flags)  # groups added later get the same kernel
    if impl == "fused":
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]  # as Adam.__init__(fused=True) sets it
    if optimizer.state:  # stepped before: fused wants its step counters as float32 on the parameters' device
        optimizer.load_state_dict(optimizer.state_dict())
    return f"{type(optimizer).__name__}: {impl}"


def optimizer_from_config(model: nn.Module, device: torch.device, c: OptimConfig) -> torch.optim.AdamW:
    """:func:`build_optimizer` with the run's ``optim`` section (lr, decay, betas, eps, kernel)."""
    return build_optimizer(
        model,
        device,
        lr=c.lr,
        weight_decay=c.weight_decay,
        betas=(c.beta1, c.beta2),
        eps=c.eps,
        implementation=c.implementation,
    )


AUTO_WARMUP_SHARE, AUTO_WARMUP_MAX = 0.1, 30  # optim.warmup_steps = 'auto': 10 % of the run, at most 30


def warmup_length(warmup_steps: int | str, max_steps: int) -> int:
    """The warmup in optimizer steps: ``warmup_steps``, or for 'auto' 10 % of ``max_steps`` in [1, 30]."""
    if isinstance(warmup_steps, int):
        return warmup_steps
    return max(1, min(AUTO_WARMUP_MAX, int(AUTO_WARMUP_SHARE * max_steps)))


def warmup_factor(s: int, warmup_steps: int) -> float:
    """Linear warmup: the share of the peak LR at optimizer step ``s`` (1.0 once it is over)."""
    return (s + 1) / warmup_steps if s < warmup_steps else 1.0


def lr_lambda(schedule: str, warmup_steps: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak LR at step ``s``: linear warmup, then cosine, linear or constant."""
    if schedule not in SCHEDULES or schedule == "plateau":
        raise choice_error("optim.schedule", schedule, [s for s in SCHEDULES if s != "plateau"])

    def factor(s: int) -> float:
        if s < warmup_steps:
            return warmup_factor(s, warmup_steps)
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, max_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * shape

    return factor


class PlateauLR(torch.optim.lr_scheduler.LRScheduler):
    """Adaptive LR: linear warmup, then the peak lowered by ``factor`` when the validation loss has not
    improved for more than ``patience`` evaluations (never below ``min_ratio``); ReduceLROnPlateau's
    rule, decided in :meth:`observe` from a host float (no sync); its state is resumed with the run."""

    THRESHOLD = 1e-4  # relative improvement that counts, as ReduceLROnPlateau's default

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        factor: float = 0.5,
        patience: int = 2,
        min_ratio: float = 0.0,
    ) -> None:
        if not 0.0 < factor < 1.0:
            raise ValueError(f"optim.plateau_factor = {factor} must be in (0, 1)")
        self.warmup_steps, self.factor = warmup_steps, factor
        self.patience, self.min_ratio = patience, min_ratio
        self.scale = 1.0  # the peak's multiplier after the lowerings so far
        self.best = math.inf  # best validation loss after warmup
        self.bad_evals = 0  # evaluations since it last improved
        self.lowerings = 0
        super().__init__(optimizer)

    def get_lr(self) -> list[float | torch.Tensor]:
        factor = warmup_factor(self.last_epoch, self.warmup_steps) * self.scale
        return [base * factor for base in self.base_lrs]

    def observe(self, val_loss: float) -> bool:
        """Count one evaluation's loss (a host float); True when the LR was lowered now."""
        if self.last_epoch < self.warmup_steps:
            return False
        if val_loss < self.best * (1.0 - self.THRESHOLD):
            self.best, self.bad_evals = val_loss, 0
            return False
        self.bad_evals += 1
        if self.bad_evals <= self.patience:
            return False
        self.bad_evals = 0
        scale = max(self.scale * self.factor, self.min_ratio)
        if self.scale - scale <= 1e-12:
            return False  # already at min_lr
        self.scale, self.lowerings = scale, self.lowerings + 1
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
        return True


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    schedule: str,
    warmup_steps: int,
    max_steps: int,
    lr: float,
    min_lr: float,
    plateau_factor: float = 0.5,
    plateau_patience: int = 2,
) -> torch.optim.lr_scheduler.LRScheduler:
    """The LR schedule stepped after every optimizer step: warmup, then ``schedule``."""
    ratio = min_lr / lr if lr > 0 else 0.0
    if schedule == "plateau":
        return PlateauLR(
            optimizer,
            warmup_steps=warmup_steps,
            factor=plateau_factor,
            patience=plateau_patience,
            min_ratio=ratio,
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, warmup_steps, max_steps, ratio))


def scheduler_from_config(
    optimizer: torch.optim.Optimizer, c: OptimConfig, max_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """:func:`build_scheduler` with the run's ``optim`` section, spanning ``max_steps`` optimizer steps."""
    return build_scheduler(
        optimizer,
        schedule=c.schedule,
        warmup_steps=warmup_length(c.warmup_steps, max_steps),
        max_steps=max_steps,
        lr=c.lr,
        min_lr=c.min_lr,
        plateau_factor=c.plateau_factor,
        plateau_patience=c.plateau_patience,
    )


def lr_batch_factor(rule: str, reference_batch: int, global_batch: int) -> float:
    """What ``optim.lr_scaling`` multiplies the LR by for ``global_batch`` instead of ``reference_batch``."""
    if rule not in LR_SCALINGS:
        raise choice_error("optim.lr_scaling", rule, LR_SCALINGS)
    if rule == "none" or reference_batch <= 0 or global_batch == reference_batch:
        return 1.0
    ratio = global_batch / reference_batch
    return ratio if rule == "linear" else math.sqrt(ratio)


def rescale_lr(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None, factor: float
) -> None:
    """Multiply the peak LR of ``optimizer`` and its ``scheduler`` by ``factor``, before training."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if scheduler is not None:
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
