"""``turbotrain train``: train a preset on the built-in corpus or your data.

Exit statuses: :data:`EPILOG` (docs/resume.md, docs/cluster.md); 1 is a bug with its traceback, or
under torchrun another rank lost (one line: continue with ``--resume``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..app.local_launch import launch_local
from ..app.prepare import RunRequest, StoppedBySignal
from ..app.report import more_metrics
from ..app.restart import resume_command
from ..app.run import RunOutcome, train_run
from ..base.config import describe, parse_overrides
from ..base.errors import LOG_FORMAT, TurbotrainError
from ..base.launch import Topology
from ..base.signals import REQUEUE_SIGNAL
from .options import Options, add_command, number, switch
from .report import print_report

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: "try again later", here: continue with --resume
# 79: stopped by SIGUSR1 with everything saved, "requeue me". Its own code, not 75, so that the batch
# script requeues only a job that SLURM warned of its time limit (--signal=USR1@N), never one stopped
# by scancel, a SIGTERM or Ctrl-C (75); outside the sysexits range 64-78 and the shell's 126+.
EXIT_REQUEUE = 79
EXIT_PEER_LOST = 1  # under torchrun: another rank died or a collective timed out (said in one line)

OPTIONS: Options = {
    "--preset": "preset name (gpt-tiny, gpt2-small, gpt2-medium) or a .toml path; "
    "default: gpt2-small on a GPU, gpt-tiny on CPU",
    "--model": "train your own model and data: FUNC() returns "
    "turbotrain.Workload(model=..., train_loader=..., loss_fn=..., eval_loader=..., metrics_fn=...) "
    "(also package.module:FUNC); the preset then only sets speed and training settings",
    "--data": "a .bin token file, a text file or a folder (default: built-in corpus)",
    "--resume": {
        "nargs": "?",
        "const": "",
        "default": None,
        "metavar": "RUN",
        "help": "continue a run from its latest checkpoint: a run name or directory "
        "(default: --run.name, else the latest run)",
    },
    "--no-progress": switch("plain log lines instead of a progress bar"),
    "--nproc": {
        "metavar": "N",
        "help": "start N processes on this machine (torchrun's launcher; 'auto': one per visible GPU), "
        "as `torchrun --standalone --nproc-per-node N -m turbotrain train` would",
    },
    "--max-restarts": number(
        0,
        "with --nproc: start the group again up to K times after a failure (it resumes itself)",
        metavar="K",
    ),
    "--help-config": switch("list every config field with its default and meaning"),
}


HELP = "train a model (default: a GPT on the built-in corpus; --model FILE.py:FUNC: yours)"
DESCRIPTION = (
    "Train a GPT, or your own model and data with --model FILE.py:FUNC. Any config field can be set with "
    "--section.key=value (see --help-config), e.g. --train.max_steps=300 --precision.mode=bf16-mixed."
)
EPILOG = (
    f"exit status: 0 trained; 2 a mistake to fix (one line says what); {EXIT_STOPPED} stopped by SIGTERM/SIGINT "
    f"with everything saved, continue with --resume; {EXIT_REQUEUE} the same after SIGUSR1 (SLURM's warning "
    "before the time limit): requeue the job; 130 interrupted by a second Ctrl-C"
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(
        subparsers, main_train, HELP, OPTIONS, description=DESCRIPTION, epilog=EPILOG, overrides=True
    )


def main_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.help_config:
        print(describe())
        return 0
    if args.nproc is not None:  # this process only launches: the N processes train
        return launch_local(args.nproc, _child_argv(args, extra), args.max_restarts)
    if args.max_restarts:
        raise TurbotrainError("--max-restarts restarts the processes --nproc starts; give --nproc N too")
    topology = Topology.from_env()
    # under torchrun: rank 0 prints; the others only warnings and errors, with their rank
    if topology.rank > 0:
        root = logging.getLogger()
        root.setLevel(logging.WARNING)
        for handler in root.handlers:
            handler.setFormatter(logging.Formatter(f"[rank {topology.rank}] {LOG_FORMAT}"))
    try:
        overrides = parse_overrides(extra)  # with --data and --no-progress as their config fields
        if args.data is not None:
            overrides.setdefault("data", {})["path"] = args.data
        if args.no_progress:
            overrides.setdefault("monitor", {})["progress"] = "false"
        outcome = train_run(RunRequest(args.preset, overrides, args.resume, args.model))
    except TurbotrainError:
        if topology.rank > 0:
            return 0  # the same mistake on every rank, said once by rank 0
        raise
    except StoppedBySignal as exc:
        code = stopped_exit(exc.signame)
        if topology.rank > 0:
            return code  # rank 0 says it
        resume = f"`{resume_command(exc.run_dir or '', topology)}`"
        print(f"turbotrain train: {exc.line(resume)}", file=sys.stderr)
        return code
    return _exit_status(outcome, topology)


def _child_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The command line of each process ``--nproc`` starts: this one without --nproc and --max-restarts."""
    argv: list[str] = []
    for name in ("preset", "model", "data"):
        if getattr(args, name) is not None:
            argv += [f"--{name}", getattr(args, name)]
    if args.resume is not None:
        argv += ["--resume", args.resume] if args.resume else ["--resume"]
    return argv + (["--no-progress"] if args.no_progress else []) + extra


def _exit_status(outcome: RunOutcome, topology: Topology) -> int:
    """Say how the run ended (rank 0) and map it to the exit status (the module docstring)."""
    if outcome.quiet:
        return 0  # another rank failed and says why
    if outcome.lost:
        print(f"turbotrain train: {outcome.lost}", file=sys.stderr)
        return EXIT_PEER_LOST
    summary, run = outcome.summary, outcome.run
    assert summary is not None and run is not None
    if not run.main:
        return stopped_exit(outcome.signal) if outcome.stopped_by_signal else 0
    _print_summary(summary, run.run_dir)
    if outcome.report is not None:
        print_report(outcome.report)
    resume, code = f"`{resume_command(run.run_dir, topology)}`", stopped_exit(outcome.signal)
    if outcome.stopped_by_signal:
        requeue = f"exit {code} for the batch script to requeue the job, which resumes by itself; or "
        print(
            f"turbotrain train: {summary['stop_reason']} stopped the run at step {summary['steps']}, checkpoint "
            f"saved; {requeue if code == EXIT_REQUEUE else ''}continue with {resume}",
            file=sys.stderr,
        )
        return code
    if outcome.signal:
        more = f"; continue with {resume}" if summary["steps"] < summary["max_steps"] else ""
        print(
            f"turbotrain train: {outcome.signal} arrived as the run was ending; it {summary['status']} at step "
            f"{summary['steps']} with everything saved (the plots: `turbotrain report {run.run_dir}`){more}",
            file=sys.stderr,
        )
        return code
    return 0


def stopped_exit(first_signal: str) -> int:
    """79 (requeue) when the first signal was SIGUSR1, else 75 (a rank stopped because another got it
    says 75; ``srun`` reports the highest status of its tasks, so the job still ends 79)."""
    return EXIT_REQUEUE if first_signal == REQUEUE_SIGNAL else EXIT_STOPPED


def _print_summary(summary: dict, run_dir: Path) -> None:
    r = summary["resolved"]
    lines = [
        f"run {run_dir}: {summary['status']} at step {summary['steps']}/{summary['max_steps']}"
        + (f" ({summary['stop_reason']})" if summary.get("stop_reason") else ""),
        f"  {r['device']} | {r['precision']} | compile {r['compile']} | {r['optimizer']} | {r['params']:,} params"
        + (
            f" | {r['strategy']} x {r['world_size']} processes, global batch {r['global_batch']}"
            if r.get("world_size", 1) > 1
            else ""
        ),
    ]
    if summary.get("final_val_loss") is not None:
        train_loss = summary.get("final_train_loss")
        lines.append(
            f"  val loss {summary['final_val_loss']:.4f} at step {summary['final_val_step']}"
            + (f" | train loss {train_loss:.4f}" if train_loss is not None else "")
        )
    metrics = [f"{k} {v:.4f}" for k, v in more_metrics(summary, "final_val_") if v is not None]
    if metrics:
        lines.append("  validation " + " | ".join(metrics))
    best = summary.get("best") or {}
    if best.get("value") is not None:  # [best]: the best pass, not the last one, and its checkpoint
        kept = f"; checkpoint {run_dir / best['checkpoint']}" if best.get("checkpoint") else ""
        lines.append(
            f"  best {best['metric']} {best['value']:.4f} at step {best['step']} ({best['mode']}){kept}"
        )
    lines += _throughput_lines(summary, r.get("world_size", 1) > 1)
    lines += [f"  event at step {e['step']}: {e['kind']}: {e['detail']}" for e in summary.get("events", [])]
    print("\n".join(lines))


def _throughput_lines(summary: dict, distributed: bool) -> list[str]:
    """Tokens/s for a language model, else samples/s; none when this invocation trained no step."""
    rate = summary.get("tokens_per_s_median")
    samples = (summary.get("steady_state") or {}).get("samples_per_s")
    first = summary.get("first_step_s")
    tail = (
        f" | first step {first:.2f} s" if first is not None else ""
    ) + f" | {summary['elapsed_s']:.1f} s total"
    if rate:
        per_rank = summary.get("rank_tokens_per_s_median") if distributed else None
        return [
            f"  {rate:,.0f} tokens/s (median"
            + (f"; {per_rank:,.0f} per process)" if per_rank else ")")
            + tail
        ]
    if samples:  # not a language model: throughput in samples
        return [f"  {samples:,.1f} samples/s (median)" + tail]
    return []
