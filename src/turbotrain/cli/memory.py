"""``turbotrain memory``: where a config's training step puts its memory, per phase and per kind,
for each activation-checkpointing mode; ``--measure`` adds one real step on the run's device."""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..app.measure import Target
from ..base.batch import batch_size, move_to
from ..base.config import RunConfig
from ..base.errors import ConfigError, TurbotrainError
from ..base.failure import workload_failed
from ..base.units import GIB, unit_for
from ..base.version import collect_git
from ..core.assembly import build_trainable
from ..parts.models.registry import spec_for
from ..parts.workload import load_workload, rebuild_loader
from ..tools.memory.stats import (
    COMPARED_MODES,
    MemoryStats,
    NotEstimable,
    default_vocab_size,
    estimate_memory,
    estimate_step_memory,
    measure_step_memory,
    resolve_precision_name,
)
from .options import TARGET_OPTIONS, Options, add_command, switch, target_of

ROWS = [
    ("parameters", "params_bytes"),
    ("gradients", "grads_bytes"),
    ("optimizer state", "optimizer_bytes"),
    ("activations", "activations_bytes"),
    ("peak: forward", "forward_peak_bytes"),
    ("peak: backward", "backward_peak_bytes"),
    ("peak: optimizer step", "optimizer_peak_bytes"),
]


HELP = "memory of a config's training step: params, grads, optimizer state, activations, peaks"
DESCRIPTION = (
    "Estimate (on the meta device, in about a second, for any size) the memory of one training "
    "step per phase and per kind, with activation checkpointing off, selective and full, for a preset's GPT or "
    "your model (--model FILE.py:FUNC, on one batch of its train_loader). Any config field can be set with "
    "--section.key=value, e.g. --precision.mode=bf16-mixed to estimate for a GPU from a CPU."
)
OPTIONS: Options = {
    "--micro": {
        "type": int,
        "help": "micro-batch (default: the config's, 8 when 'auto'; with --model: the "
        "loader's batch_size, rebuilt with this one)",
    },
    "--measure": switch("also run one real step on the config's device and measure it"),
    "--json": "print one JSON object instead of a table",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tables = (TARGET_OPTIONS, OPTIONS)  # --preset, --model: as profile and tune take them
    return add_command(subparsers, main_memory, HELP, *tables, description=DESCRIPTION, overrides=True)


def measure(
    config: Any, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None
) -> MemoryStats:
    """One real training step of ``model`` on ``batch`` as the Engine sets it up, measured per phase."""
    t = build_trainable(config, model)
    t.model.train()
    return measure_step_memory(
        t.model,
        t.optimizer,
        move_to(batch, t.engine.device),
        loss_fn=loss_fn,
        autocast=t.engine.autocast,
        precision=t.engine.precision.name,
        checkpointing=config.memory.checkpointing,
    )


@dataclass
class Report:
    """What ``turbotrain memory`` prints."""

    config: RunConfig
    what: str  # the first line: the model, its size, the micro-batch, the precision
    micro: int
    precision: str
    estimates: dict[str, MemoryStats]
    measured: MemoryStats | None
    notes: list[str]


def estimate_modes(
    estimate: Callable[[str], MemoryStats], measuring: bool
) -> tuple[dict[str, MemoryStats], list[str]]:
    """``estimate(mode)`` for each checkpointing mode that applies, and the lines that say why any is
    missing (without ``--measure``, none at all is one error line)."""
    estimates: dict[str, MemoryStats] = {}
    for mode in COMPARED_MODES:
        try:
            estimates[mode] = estimate(mode)
        except NotEstimable as exc:
            if not measuring:
                raise NotEstimable(f"{exc}; measure one real step with --measure") from None
            return estimates, [f"not estimated: {exc}"]
        except ConfigError as exc:  # nothing to checkpoint: the off column stands alone
            if mode == "off":
                raise
            return estimates, [f"checkpointing not estimated: {exc}"]
    return estimates, []


def preset_report(args: argparse.Namespace, target: Target) -> Report:
    """The preset's GPT: estimated on the meta device, measured on a batch of random tokens."""
    config = target.config()
    micro = args.micro if args.micro is not None else config.batch.micro
    micro = micro if isinstance(micro, int) else 8
    precision = resolve_precision_name(config)
    estimates, notes = estimate_modes(
        lambda mode: estimate_memory(config, micro=micro, checkpointing=mode, precision=precision),
        args.measure,
    )
    spec, vocab = spec_for(config), default_vocab_size(config)
    torch.manual_seed(config.run.seed)
    if args.measure:
        model = spec.build_model(config, vocab)
        measured = measure(config, model, spec.random_batch(config, vocab, torch.device("cpu"))(micro))
        n_params = sum(p.numel() for p in model.parameters())
    else:
        measured, n_params = None, estimates["off"].params_bytes // (2 if precision == "bf16-true" else 4)
    what = f"{config.preset}, {n_params:,} parameters, micro-batch {micro} x {spec.seq_len(config)} tokens, {precision}, AdamW"
    return Report(config, what, micro, precision, estimates, measured, notes)


def workload_report(args: argparse.Namespace, target: Target) -> Report:
    """``--model FILE.py:FUNC``: its model and loss on the first batch of its train_loader (rebuilt
    without workers), estimated on a copy on the meta device, measured on the config's device."""
    config = target.config({"model": {"workload": args.model}})
    w = load_workload(args.model, seed=config.run.seed)
    loader = w.train_loader
    if args.micro is not None or isinstance(loader, DataLoader):
        loader = rebuild_loader(loader, batch_size=args.micro, num_workers=0)
    batch = next(iter(loader), None)
    if batch is None:
        raise TurbotrainError(f"--model {args.model}: its train_loader gave no batch to measure")
    precision = resolve_precision_name(config)
    estimates, notes = estimate_modes(
        lambda mode: estimate_step_memory(
            copy.deepcopy(w.model),
            batch,
            config=config,
            loss_fn=w.loss_fn,
            checkpointing=mode,
            precision=precision,
        ),
        args.measure,
    )
    n_params = sum(p.numel() for p in w.model.parameters())
    measured = measure(config, w.model, batch, w.loss_fn) if args.measure else None
    what = f"{args.model} ({type(w.model).__name__}), {n_params:,} parameters, micro-batch {batch_size(batch)}, {precision}, AdamW"
    return Report(config, what, batch_size(batch), precision, estimates, measured, notes)


def main_memory(args: argparse.Namespace, extra: list[str]) -> int:
    if args.micro is not None and args.micro < 1:
        raise ConfigError(f"--micro = {args.micro} must be >= 1")
    target = target_of(args, extra)
    try:
        r = (workload_report if args.model else preset_report)(args, target)
    except Exception as exc:  # the user's own forward or loss failing on its batch: one line
        failed = workload_failed(f"memory --model {args.model}", exc) if args.model else None
        if failed is None:
            raise
        raise failed from None
    if not args.json:
        print(format_table(r))
        return 0
    out: dict[str, Any] = {
        "preset": r.config.preset,
        "model": args.model,
        "micro_batch": r.micro,
        "seq_len": None if args.model else spec_for(r.config).seq_len(r.config),
        "precision": r.precision,
        "checkpointing": r.config.memory.checkpointing,
        "estimate": {k: v.to_dict() for k, v in r.estimates.items()},
        "notes": r.notes,
        "git": collect_git(),
        **({"measured": r.measured.to_dict()} if r.measured is not None else {}),
    }
    print(json.dumps(out, indent=2))
    return 0


def format_table(r: Report) -> str:
    """One row per kind/phase, one column per checkpointing mode (+ measured)."""
    config, estimates, measured = r.config, r.estimates, r.measured
    own = config.memory.checkpointing
    heads = [f"ckpt {m}{'*' if m == own else ''}" for m in estimates]
    cols: list[MemoryStats] = list(estimates.values())
    if measured is not None:
        heads.append(f"measured ({measured.device})")
        cols.append(measured)
    unit, scale = unit_for(max((c.peak_bytes for c in cols), default=0))
    lines = [f"turbotrain memory: {r.what}", *r.notes, f"{unit:<22}" + "".join(f"{h:>20}" for h in heads)]
    for label, key in ROWS:
        lines.append(f"{label:<22}" + "".join(f"{getattr(c, key) / scale:>20.3f}" for c in cols))
    lines.append(f"{'peak':<22}" + "".join(f"{c.peak_bytes / scale:>20.3f}" for c in cols))
    if estimates:
        lines.append(
            "estimates: one step on the meta device (tensor bytes; the allocator's cache, fragmentation and "
            "library workspaces come on top: keep ~10% free). * = this config's memory.checkpointing."
        )
    if measured is not None:
        cuda, gib = measured.method == "cuda-allocator", (measured.device_total_bytes or 0) / GIB
        how = (
            "CUDA allocator counters" if cuda else "tensors tracked per op (CPU has no allocator statistics)"
        )
        total = f"; device memory {gib:.1f} GiB" if measured.device_total_bytes else ""
        lines.append(f"measured: one real step with {own} checkpointing, {how}{total}.")
    return "\n".join(lines)
