"""``turbotrain tune``: search the fastest settings for a preset or your model with Optuna, and
write them as a preset ``turbotrain train --preset PATH.toml`` reads."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import torch

from ..app.tune import TuneOptions, require_optuna, summary, tune
from ..base.errors import ConfigError
from ..base.process import exit_on_sigterm
from .options import TARGET_OPTIONS, Options, add_command, check_at_least, live_log, number, switch, target_of

# Trial length per device: (warm-up, timed steps, steps per pruning window). CPU steps of the
# small presets take 0.1-1 s; a GPU's take milliseconds, so more of them cost less.
TRIAL_STEPS = {"cpu": (3, 12, 4), "cuda": (5, 30, 10)}


HELP = "search the fastest settings (precision, compile, micro-batch, workers, ...) with Optuna"
DESCRIPTION = (
    "An Optuna study over precision, compile scope and mode, micro-batch (accumulation keeps the global "
    "batch), loader workers, activation checkpointing, optimizer implementation and attention. Each trial runs in "
    "its own process; out-of-memory, over-budget and failed trials are penalised constraint violations. Takes "
    "--preset, --model and --section.key=value like train (a setting given is not searched); "
    "--batch.max_memory_gib caps memory. Needs the [tune] extra (pip install 'turbotrain[tune]')."
)
OPTIONS: Options = {
    "--trials": number(20, "trials to run (default 20); over-budget and invalid proposals are not counted"),
    "--out": {
        "metavar": "PATH.toml",
        "help": "where to write the best settings (default: best.toml in the run folder)",
    },
    "--trial-warmup": {"type": int, "help": "untimed steps per trial (default: 3 on CPU, 5 on CUDA)"},
    "--trial-steps": {"type": int, "help": "timed steps per trial (default: 12 on CPU, 30 on CUDA)"},
    "--window": {
        "type": int,
        "help": "timed steps per value reported to the pruner (default: 4 on CPU, 10 on CUDA)",
    },
    "--trial-timeout-s": number(600.0, "per-trial time limit in seconds (default 600)"),
    "--threads": "CPU threads per trial process (0 = torch's default)",
    "--seed": "the sampler's seed (default 0)",
    "--no-prune": switch("run every trial to the end"),
    "--confirm": number(
        2,
        "re-measure the best and the baseline this many times each, interleaved, before "
        "writing the preset; a best not >= 1.05x the baseline is not written (default 2, 0 = off)",
    ),
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tables = (TARGET_OPTIONS, OPTIONS)
    return add_command(subparsers, main_tune, HELP, *tables, description=DESCRIPTION, overrides=True)


def main_tune(args: argparse.Namespace, extra: list[str]) -> int:
    require_optuna()
    target = target_of(args, extra)
    device = target.config().run.device
    kind = "cuda" if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "cpu"
    warmup, steps, window = TRIAL_STEPS[kind]
    args.trial_warmup = args.trial_warmup or warmup
    args.trial_steps = args.trial_steps or steps
    args.window = args.window or window
    check_at_least(args, trials=1, trial_warmup=1, trial_steps=2, window=1, threads=0, confirm=0)
    options = TuneOptions(
        trials=args.trials,
        warmup=args.trial_warmup,
        steps=args.trial_steps,
        window=args.window,
        timeout_s=args.trial_timeout_s,
        prune=not args.no_prune,
        threads=args.threads,
        seed=args.seed,
        confirm=args.confirm,
    )
    if args.out and not args.out.endswith(".toml"):
        raise ConfigError(
            f"--out {args.out}: give a path ending in .toml (it is read back with --preset PATH.toml)"
        )
    exit_on_sigterm()  # a running trial is ended too
    with live_log() as log:
        doc = tune(target, options, Path(args.out) if args.out else None, log)
    print(summary(doc))
    if doc["interrupted"]:
        print(
            f"interrupted ({doc['interrupted']}): continue the study with the same command and {doc['resume']}"
        )
        return 128 + signal.SIGTERM if doc["interrupted"].startswith("SIGTERM") else 130
    return 0 if doc.get("best") else 1
