"""``turbotrain memory``: where a config's training step puts its memory, per phase and per kind,
for each activation-checkpointing mode; ``--measure`` adds one real step on the run's device."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..core.assembly import build_trainable
from ..base.version import collect_git
from ..base.config import load_config, parse_overrides
from ..base.errors import ConfigError
from ..tools.memory.finder import token_batches
from ..tools.memory.stats import MemoryStats, compare_checkpointing, default_vocab_size, measure_step_memory, resolve_precision_name
from ..parts.models.registry import build_model
from ..base.units import GIB

ROWS = [
    ("parameters", "params_bytes"),
    ("gradients", "grads_bytes"),
    ("optimizer state", "optimizer_bytes"),
    ("activations", "activations_bytes"),
    ("peak: forward", "forward_peak_bytes"),
    ("peak: backward", "backward_peak_bytes"),
    ("peak: optimizer step", "optimizer_peak_bytes"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "memory",
        help="memory of a config's training step: params, grads, optimizer state, activations, peaks",
        description="Estimate (on the meta device, in about a second, for any size) the memory of one training "
        "step per phase and per kind, with activation checkpointing off, selective and full. Any config field can "
        "be set with --section.key=value, e.g. --precision.mode=bf16-mixed to estimate for a GPU from a CPU.",
    )
    p.add_argument("--preset", help="preset name or .toml path (default: gpt2-small on a GPU, gpt-tiny on CPU)")
    p.add_argument("--micro", type=int, help="micro-batch in sequences (default: the config's; 8 when 'auto')")
    p.add_argument("--measure", action="store_true", help="also run one real step on the config's device and measure it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(command=main_memory, accepts_overrides=True)
    return p


def _default_preset() -> str:
    return "gpt2-small" if torch.cuda.is_available() else "gpt-tiny"


def measure(config: Any, micro: int) -> MemoryStats:
    """One real training step of ``config``'s GPT at ``micro`` on the config's device, set up
    by the Engine (precision, checkpointing, compile), measured per phase."""
    torch.manual_seed(config.run.seed)
    vocab = default_vocab_size(config)
    t = build_trainable(config, build_model(config, vocab))
    t.model.train()
    batch = token_batches(vocab, config.model.block_size, t.engine.device)(micro)
    return measure_step_memory(t.model, t.optimizer, batch, autocast=t.engine.autocast, precision=t.engine.precision.name,
                               checkpointing=config.memory.checkpointing)


def main_memory(args: argparse.Namespace, extra: list[str]) -> int:
    config = load_config(args.preset or _default_preset(), parse_overrides(extra))
    micro = args.micro if args.micro is not None else config.batch.micro if isinstance(config.batch.micro, int) else 8
    if micro < 1:
        raise ConfigError(f"--micro = {micro} must be >= 1")
    precision = resolve_precision_name(config)
    estimates = compare_checkpointing(config, micro=micro, precision=precision)
    measured = measure(config, micro) if args.measure else None
    n_params = estimates["off"].params_bytes // (2 if precision == "bf16-true" else 4)
    if args.json:
        out: dict[str, Any] = {
            "preset": config.preset, "micro_batch": micro, "seq_len": config.model.block_size, "precision": precision,
            "checkpointing": config.memory.checkpointing, "estimate": {k: v.to_dict() for k, v in estimates.items()},
            "git": collect_git(),
        }
        if measured is not None:
            out["measured"] = measured.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    print(format_table(config, micro, precision, n_params, estimates, measured))
    return 0


def format_table(config: Any, micro: int, precision: str, n_params: int, estimates: dict[str, MemoryStats],
                 measured: MemoryStats | None) -> str:
    """The text report: one row per kind/phase, one column per checkpointing mode (+ measured)."""
    own = config.memory.checkpointing
    heads = [f"ckpt {m}{'*' if m == own else ''}" for m in estimates]
    cols: list[MemoryStats] = list(estimates.values())
    if measured is not None:
        heads.append(f"measured ({measured.device})")
        cols.append(measured)
    lines = [
        f"turbotrain memory: {config.preset}, {n_params:,} parameters, micro-batch {micro} x {config.model.block_size} "
        f"tokens, {precision}, AdamW",
        f"{'GiB':<22}" + "".join(f"{h:>20}" for h in heads),
    ]
    for label, key in ROWS:
        lines.append(f"{label:<22}" + "".join(f"{getattr(c, key) / GIB:>20.3f}" for c in cols))
    lines.append(f"{'peak':<22}" + "".join(f"{c.peak_bytes / GIB:>20.3f}" for c in cols))
    lines.append(
        "estimates: one step on the meta device (tensor bytes; the allocator's cache, fragmentation and library "
        "workspaces come on top: keep ~10% free). * = this config's memory.checkpointing."
    )
    if measured is not None:
        how = "CUDA allocator counters" if measured.method == "cuda-allocator" else "tensors tracked per op (CPU has no allocator statistics)"
        total = f"; device memory {measured.device_total_bytes / GIB:.1f} GiB" if measured.device_total_bytes else ""
        lines.append(f"measured: one real step with {own} checkpointing, {how}{total}.")
    return "\n".join(lines)
