"""``turbotrain train``: train a preset on the built-in corpus or your data.

Exit status: 0 trained (to max_steps, or to stop_after_steps); 2 a mistake to fix, said in one
line; 75 stopped by SIGTERM or SIGINT with everything saved (a checkpoint at the step it stopped,
or nothing trained yet): continue with ``--resume``; 130 a second Ctrl-C interrupted it at once
(the last periodic checkpoint is intact); 1 a bug, with its traceback, or under torchrun another
rank lost (one line: continue with ``--resume``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig, describe, load_config, parse_overrides
from ..distributed import ReportedByMainRank, Topology, decided_by_main, join_process_group, local_device
from ..engine import resolve_device
from ..errors import ConfigError, TurbotrainError
from ..report import write_report
from ..rundir import find_run_dir, new_run_dir, resume_config, run_name
from ..runlock import RunLock
from ..training import StoppedBySignal, check_launch, stopped_by_signal, train
from .report import print_report

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: "try again later", here: continue with --resume
EXIT_PEER_LOST = 1  # under torchrun: another rank died or a collective timed out (said in one line)


def default_preset() -> str:
    """gpt2-small on a GPU, gpt-tiny (a few minutes) on CPU."""
    return "gpt2-small" if torch.cuda.is_available() else "gpt-tiny"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a model (default: a GPT on the built-in corpus)",
        description="Train a GPT. Any config field can be set with --section.key=value "
        "(see --help-config), e.g. --train.max_steps=300 --precision.mode=bf16-mixed.",
    )
    p.add_argument("--preset", help="preset name (gpt-tiny, gpt2-small, gpt2-medium) or a .toml path; "
                   "default: gpt2-small on a GPU, gpt-tiny on CPU")
    p.add_argument("--data", help="a .bin token file, a text file or a folder (default: built-in corpus)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN",
                   help="continue a run from its latest checkpoint: a run name or directory "
                   "(default: --run.name, else the latest run)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--help-config", action="store_true", help="list every config field with its default and meaning")
    p.epilog = (f"exit status: 0 trained; 2 a mistake to fix (one line says what); {EXIT_STOPPED} stopped by SIGTERM/SIGINT "
                "with everything saved, continue with --resume; 130 interrupted by a second Ctrl-C")
    p.set_defaults(command=main_train, accepts_overrides=True)
    return p


def main_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.help_config:
        print(describe())
        return 0
    topology = Topology.from_env()
    if topology.rank > 0:  # under torchrun: rank 0 prints; the others only warnings and errors, with their rank
        _quiet_logging(topology.rank)
    if topology.world > 1:
        # torchrun's agent sends SIGTERM to every rank as soon as one fails. While training,
        # StopOnSignal handles it (and start-up ends with StoppedBySignal); outside those, the
        # default action would kill a rank silently while it is still writing the summary or
        # saying in one line why it stopped. Ignored there: the rank finishes its last words.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        # Checked on every rank before any joins the process group: the same mistake everywhere,
        # said once by rank 0; the others end quietly (exit 0) instead of waiting for it.
        overrides = parse_overrides(extra)
        if args.data is not None:
            overrides.setdefault("data", {})["path"] = args.data
        if args.no_progress:
            overrides.setdefault("monitor", {})["progress"] = "false"
        if args.resume and "name" in overrides.get("run", {}):
            raise ConfigError("name the run to resume once: --resume RUN or --resume --run.name NAME, not both")
        if args.resume is not None:  # the run's saved config with the overrides applied: what the resume will train
            resumed = _resumed_run(args, overrides)
            base = resumed[1]
        else:
            base = load_config(args.preset or default_preset(), overrides)
        check_launch(base, topology)
        join_process_group(base.distributed, local_device(resolve_device(base.run.device), topology), topology)
        # Rank 0 finds or names the run (a timestamped name, a resumed run's saved config); all use its answer.
        run_dir, config = decided_by_main(lambda: resumed if args.resume is not None else _new_run(base))
        check_launch(config, topology)
    except TurbotrainError:
        if topology.rank > 0:
            return 0
        raise
    resume = args.resume is not None
    if topology.rank > 0:
        return _train_other_rank(config, run_dir, resume, topology.rank)
    if resume:
        print(f"resuming {run_dir}")
    # The run's lock for the whole command (train() takes it too): no other process trains in
    # the run while this one trains it or writes its report.
    with RunLock(run_dir):
        try:
            summary = train(config, resume_dir=run_dir if resume else None, run_dir=run_dir)
        except StoppedBySignal as exc:
            print(f"turbotrain train: {exc}", file=sys.stderr)
            return EXIT_STOPPED
        except Exception as exc:
            lost = _peer_lost(exc, topology, run_dir)
            if lost is None:
                raise
            print(f"turbotrain train: {lost}", file=sys.stderr)
            return EXIT_PEER_LOST
        _print_summary(summary, run_dir)
        print_report(write_report(run_dir))  # plots + summary.md, as `turbotrain report RUN` would
    if stopped_by_signal(summary):
        print(f"turbotrain train: {summary['stop_reason']} stopped the run at step {summary['steps']}, checkpoint saved; "
              f"continue with `turbotrain train --resume {run_dir}`", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def _resumed_run(args: argparse.Namespace, overrides: dict) -> tuple[Path, RunConfig]:
    """The run to resume and its saved config with ``overrides`` applied, validated as a whole (not
    the overrides against a preset the run may never have used). Its folder: ``--resume RUN`` or
    ``--run.name``, in ``--run.out_dir`` (else the preset's), or else the latest run there."""
    run = overrides.get("run", {})
    out_dir = run.get("out_dir") or load_config(args.preset or default_preset()).run.out_dir
    run_dir = find_run_dir(out_dir, args.resume or run.get("name", ""))
    return run_dir, resume_config(run_dir, overrides)


def _new_run(base: RunConfig) -> tuple[Path, RunConfig]:
    """A new run's directory and config, its automatic name fixed once."""
    config = base.replace(run={"name": run_name(base)})
    return new_run_dir(config), config


def _train_other_rank(config: RunConfig, run_dir: Path, resume: bool, rank: int) -> int:
    """A rank other than 0: the same training in rank 0's run directory, printing nothing but its errors."""
    try:
        train(config, resume_dir=run_dir if resume else None, run_dir=run_dir, progress=False)
    except ReportedByMainRank:
        return 0  # rank 0 failed at start-up and says why
    except StoppedBySignal:
        return EXIT_STOPPED
    except TurbotrainError as exc:
        raise TurbotrainError(f"[rank {rank}] {exc}") from None
    except Exception as exc:
        lost = _peer_lost(exc, Topology.from_env(), run_dir)
        if lost is None:
            raise
        print(f"turbotrain train: {lost}", file=sys.stderr)
        return EXIT_PEER_LOST
    return 0


def _peer_lost(exc: BaseException, topology: Topology, run_dir: Path) -> str | None:
    """A collective that failed because another rank died or timed out, as one line that says
    so and how to continue (None for any other error, which keeps its traceback)."""
    if topology.world < 2 or not isinstance(exc, (dist.DistError, RuntimeError)) or isinstance(exc, torch.OutOfMemoryError):
        return None
    text = " ".join(str(exc).split())
    if not isinstance(exc, dist.DistError) and not any(k in text.lower() for k in ("gloo", "nccl", "connection", "timed out", "timeout")):
        return None
    return (f"[rank {topology.rank}] another rank stopped or was lost: a collective failed ({text[:200]}); checkpoints "
            f"already written are kept: continue with `torchrun ... -m turbotrain train --resume {run_dir}`")


def _quiet_logging(rank: int) -> None:
    """Ranks other than 0 log warnings and errors only, each line prefixed with the rank."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))


def _print_summary(summary: dict, run_dir: Path) -> None:
    r = summary["resolved"]
    rate = summary.get("tokens_per_s_median")
    lines = [
        f"run {run_dir}: {summary['status']} at step {summary['steps']}/{summary['max_steps']}"
        + (f" ({summary['stop_reason']})" if summary.get("stop_reason") else ""),
        f"  {r['device']} | {r['precision']} | compile {r['compile']} | {r['optimizer']} | {r['params']:,} params"
        + (f" | {r['strategy']} x {r['world_size']} processes, global batch {r['global_batch']}"
           if r.get("world_size", 1) > 1 else ""),
    ]
    if summary.get("final_val_loss") is not None:
        train_loss = summary.get("final_train_loss")
        lines.append(f"  val loss {summary['final_val_loss']:.4f} at step {summary['final_val_step']}"
                     + (f" | train loss {train_loss:.4f}" if train_loss is not None else ""))
    if rate:
        first = summary.get("first_step_s")  # None when this invocation trained no step (a finished run resumed)
        per_rank = summary.get("rank_tokens_per_s_median") if r.get("world_size", 1) > 1 else None
        lines.append(f"  {rate:,.0f} tokens/s (median" + (f"; {per_rank:,.0f} per process)" if per_rank else ")")
                     + (f" | first step {first:.2f} s" if first is not None else "")
                     + f" | {summary['elapsed_s']:.1f} s total")
    for e in summary.get("events", []):
        lines.append(f"  event at step {e['step']}: {e['kind']}: {e['detail']}")
    print("\n".join(lines))
