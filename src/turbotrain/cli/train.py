"""``turbotrain train``: train a preset on the built-in corpus or your data.

Exit status: 0 trained (to max_steps, or to stop_after_steps); 2 a mistake to fix, said in one
line; 75 stopped by SIGTERM or SIGINT with everything saved (a checkpoint at the step it stopped,
or nothing trained yet): continue with ``--resume``; 79 the same after SIGUSR1, the signal a SLURM job
asks for before its time limit (``--signal=USR1@90``): the batch script requeues the job on 79, and
a requeued job (``SLURM_RESTART_COUNT`` > 0) resumes its run by itself; 130 a second signal interrupted it at once
(the last periodic checkpoint is intact); 1 a bug, with its traceback, or under torchrun another
rank lost (one line: continue with ``--resume``; under ``torchrun --max-restarts N`` torchrun starts
the group again and it resumes by itself, the restart recorded in metrics.jsonl and the summary).

Signals (:mod:`turbotrain.base.signals`) are handled from the moment the command starts until it exits,
in every phase alike: during start-up one stops it at once (75; a new run leaves nothing behind),
while training it stops after the current step and saves (75), after training it lets the summary
be written and skips the plots (75). A process started with SIGINT ignored (a background job of a
non-interactive shell) keeps ignoring SIGINT; SIGTERM still stops it. Under torchrun the line that
says how to continue names the torchrun command; torchrun itself, when it is the one signalled,
forwards the signal to the ranks (which save and exit 75) and then ends with its own
``SignalException`` traceback and status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..app.choose.session import choose_for_run
from ..app.report import read_metrics, write_report
from ..app.training import StoppedBySignal, plan_run, split_batch, stop_startup, stopped_by_signal, train
from ..app.warmstart import WarmStart
from ..base.config import RunConfig, describe, load_config, parse_overrides, read_preset
from ..base.errors import ConfigError, TurbotrainError
from ..base.launch import Launch, Topology
from ..base.rundir import (
    CHECKPOINTS,
    CONFIG_FILE,
    METRICS_FILE,
    find_run_dir,
    new_run_dir,
    read_launch,
    resume_config,
    run_name,
    truncate_metrics,
    write_launch,
)
from ..base.runlock import RunLock
from ..base.signals import REQUEUE_SIGNAL, StopSignals
from ..base.signals import active as active_signals
from ..base.signals import held as held_signals
from ..core.device import local_device, resolve_device
from ..core.main_rank import ReportedByAnotherRank, decided_by_main, reported_elsewhere
from ..core.plan import ParallelPlan
from ..loop.checkpoint import checkpoint_step, latest_verified
from ..parts.models.registry import spec_for
from ..parts.models.spec import ModelSpec
from ..parts.models.workload_spec import WorkloadSpec
from .report import print_report

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: "try again later", here: continue with --resume
# 79: stopped by SIGUSR1 with everything saved, "requeue me". Its own code, not 75, so that the batch
# script requeues only a job that SLURM warned of its time limit (--signal=USR1@N), never one stopped
# by scancel, a SIGTERM or Ctrl-C (75); outside the sysexits range 64-78 and the shell's 126+.
EXIT_REQUEUE = 79
EXIT_PEER_LOST = 1  # under torchrun: another rank died or a collective timed out (said in one line)


def default_preset() -> str:
    """gpt2-small on a GPU, gpt-tiny (a few minutes) on CPU."""
    return "gpt2-small" if torch.cuda.is_available() else "gpt-tiny"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a model (default: a GPT on the built-in corpus; --model FILE.py:FUNC: yours)",
        description="Train a GPT, or your own model and data with --model FILE.py:FUNC. Any config field can be set with --section.key=value "
        "(see --help-config), e.g. --train.max_steps=300 --precision.mode=bf16-mixed.",
    )
    p.add_argument(
        "--preset",
        help="preset name (gpt-tiny, gpt2-small, gpt2-medium) or a .toml path; "
        "default: gpt2-small on a GPU, gpt-tiny on CPU",
    )
    p.add_argument(
        "--model",
        metavar="FILE.py:FUNC",
        help="train your own model and data: FUNC() returns "
        "turbotrain.Workload(model=..., train_loader=..., loss_fn=..., eval_loader=..., metrics_fn=...) "
        "(also package.module:FUNC); the preset then only sets speed and training settings",
    )
    p.add_argument("--data", help="a .bin token file, a text file or a folder (default: built-in corpus)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="RUN",
        help="continue a run from its latest checkpoint: a run name or directory "
        "(default: --run.name, else the latest run)",
    )
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument(
        "--help-config", action="store_true", help="list every config field with its default and meaning"
    )
    p.epilog = (
        f"exit status: 0 trained; 2 a mistake to fix (one line says what); {EXIT_STOPPED} stopped by SIGTERM/SIGINT "
        f"with everything saved, continue with --resume; {EXIT_REQUEUE} the same after SIGUSR1 (SLURM's warning "
        "before the time limit): requeue the job; 130 interrupted by a second Ctrl-C"
    )
    p.set_defaults(command=main_train, accepts_overrides=True)
    return p


def main_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.help_config:
        print(describe())
        return 0
    # SIGTERM/SIGINT from here until the command returns, whichever phase they land in: one
    # saves what there is to save and stops (75), two stop at once (130). Under torchrun the
    # agent also sends SIGTERM to every rank when one fails: after training it is only recorded,
    # so the rank still finishes its last words (the summary, or one line saying why it stopped).
    with held_signals() as signals:
        try:
            return _train_command(args, extra, signals)
        except StoppedBySignal as exc:
            topology = Topology.from_env()
            code = stopped_exit(signals)
            if topology.rank > 0:
                return code  # rank 0 says it
            then = (
                f"continue with `{resume_command(exc.run_dir or '', topology)}`"
                if exc.resumable
                else "nothing was written; start it again"
            )
            print(
                f"turbotrain train: stopped by {exc.signame} during start-up, before the first step; {then}",
                file=sys.stderr,
            )
            return code


def stopped_exit(signals: StopSignals | None) -> int:
    """The exit status of a command stopped by a signal with everything saved: 79 (requeue) when
    the first signal was SIGUSR1, else 75. A rank stopped because another rank got the signal
    says 75; ``srun`` reports the highest status of its tasks, so the job still ends 79."""
    return EXIT_REQUEUE if signals is not None and signals.first == REQUEUE_SIGNAL else EXIT_STOPPED


class _ReportStopped(KeyboardInterrupt):
    """A signal while the report was being made (each file is written whole or not at all)."""


def _stop_report(name: str) -> None:
    raise _ReportStopped(name)


def resume_command(run_dir: Path | str, topology: Topology) -> str:
    """The command that continues the run in ``run_dir``: the torchrun one for a run of several
    processes (a ddp/fsdp run refuses a plain ``turbotrain train --resume``)."""
    target = f"--resume {run_dir}".rstrip()
    if topology.world < 2:
        return f"turbotrain train {target}"
    if topology.launcher == "slurm":
        return f"srun ... (as before) python -m turbotrain train {target}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world))
    launch = f"--nproc-per-node {local}" if local == topology.world else "... (as before)"
    return f"torchrun {launch} -m turbotrain train {target}"


def _train_command(args: argparse.Namespace, extra: list[str], signals: StopSignals) -> int:
    topology = Topology.from_env()
    launch = Launch.from_env()
    resume = args.resume is not None
    relaunch = ""  # why this start continues its run by itself (a SLURM requeue, a torchrun restart)
    recorded: dict | None = None  # what the run keeps of the job that last started it
    signals.on_first(lambda name: stop_startup(name, None, resume))
    # under torchrun: rank 0 prints; the others only warnings and errors, with their rank
    if topology.rank > 0:
        _quiet_logging(topology.rank)
    try:
        # Checked on every rank before any joins the process group: the same mistake everywhere,
        # said once by rank 0; the others end quietly (exit 0) instead of waiting for it.
        overrides = parse_overrides(extra)
        if args.data is not None:
            overrides.setdefault("data", {})["path"] = args.data
        if args.model is not None:
            if resume:
                raise ConfigError(
                    "--model names the workload of a new run; a resume trains the run's own "
                    "(its config.toml's model.workload): leave --model out"
                )
            overrides.setdefault("model", {})["workload"] = args.model
        if args.no_progress:
            overrides.setdefault("monitor", {})["progress"] = "false"
        if args.resume and "name" in overrides.get("run", {}):
            raise ConfigError(
                "name the run to resume once: --resume RUN or --resume --run.name NAME, not both"
            )
        if not resume:  # a requeued SLURM job or a restarted torchrun group continues its run by itself
            found = _relaunched_run(args, overrides, topology, launch)
            if found is not None:
                found_dir, relaunch, recorded = found
                args.resume, resume = str(found_dir), True
                overrides.get("run", {}).pop("name", None)  # named by the path now
        if resume:  # the run's saved config with the overrides applied: what the resume will train
            resumed = _resumed_run(args, overrides)
            if relaunch:
                resumed = (resumed[0], _keep_global_batch(resumed[1], recorded, topology))
            base = resumed[1]
            signals.on_first(lambda name: stop_startup(name, resumed[0], True))
        else:
            base = _named_for_restarts(load_config(_preset(args), overrides), launch)
        spec = spec_for(base)  # made once: a workload's FUNC is called once per process
        if not resume and isinstance(spec, WorkloadSpec) and not _micro_given(args, overrides):
            # the loader's batch size
            base = base.replace(batch={"micro": spec.micro_batch(base.run.seed) or base.batch.micro})
        _, plan = plan_run(base, topology, spec)  # the one resolution of this process's parallel plan
        plan.join(local_device(resolve_device(base.run.device), topology))
        # Rank 0 finds or names the run (a timestamped name, a resumed run's saved config); all use its answer.
        run_dir, config = decided_by_main(lambda: resumed if resume else _new_run(base))
    except TurbotrainError:
        if topology.rank > 0:
            return 0
        raise
    # a resume at another world size keeps the checkpoint's global batch unless the command sets the batch
    # (a relaunch repeats the first start's command: its batch settings are no choice made for this resume)
    batch_given = (
        resume
        and not relaunch
        and bool({"micro", "global_size", "accumulation"} & set(overrides.get("batch", {})))
    )
    if topology.rank > 0:
        return _train_other_rank(config, run_dir, resume, plan, spec, batch_given)
    if resume:
        print(f"resuming {run_dir}" + (f" ({relaunch})" if relaunch else ""))
    # The run's lock for the whole command (train() takes it too): no other process trains in
    # the run while this one trains it or writes its report.
    with RunLock(run_dir):
        if launch.run_id or launch.slurm_job:  # the job a restart of this one finds the run by
            write_launch(run_dir, {**launch.record(), **_batch_record(config, plan)})
        if relaunch:
            _record_restart(run_dir, relaunch, topology.world)
        # settings left at auto, by measurement (a resume never re-measures)
        if not resume and topology.world == 1:
            config = choose_for_run(config, run_dir)
        # compile artefacts of an earlier run of this model: loaded before the first step
        warm = WarmStart(config)
        warm.begin()
        try:
            summary = train(
                config,
                resume_dir=run_dir if resume else None,
                run_dir=run_dir,
                batch_given=batch_given,
                plan=plan,
                spec=spec,
            )
        except Exception as exc:
            lost = _peer_lost(exc, topology, run_dir)
            if lost is None:
                raise
            print(f"turbotrain train: {lost}", file=sys.stderr)
            return EXIT_PEER_LOST
        warm.save()
        _print_summary(summary, run_dir)
        if not signals.received:  # a signal after training stops the report: it can be made later
            with contextlib.suppress(_ReportStopped):
                signals.on_first(_stop_report)
                print_report(write_report(run_dir))  # plots + summary.md, as `turbotrain report RUN` would
            signals.on_first(None)
    if stopped_by_signal(summary):
        code = stopped_exit(signals)
        then = (
            f"exit {code} for the batch script to requeue the job, which resumes by itself; or continue with "
            if code == EXIT_REQUEUE
            else "continue with "
        )
        print(
            f"turbotrain train: {summary['stop_reason']} stopped the run at step {summary['steps']}, checkpoint saved; "
            f"{then}`{resume_command(run_dir, topology)}`",
            file=sys.stderr,
        )
        return code
    if signals.received:
        print(
            f"turbotrain train: {signals.first} arrived as the run was ending; it {summary['status']} at step "
            f"{summary['steps']} with everything saved (the plots: `turbotrain report {run_dir}`)"
            + (
                f"; continue with `{resume_command(run_dir, topology)}`"
                if summary["steps"] < summary["max_steps"]
                else ""
            ),
            file=sys.stderr,
        )
        return stopped_exit(signals)
    return 0


def _preset(args: argparse.Namespace) -> str | None:
    """The preset of a new run: ``--preset``, else the default for the device (none for ``--model``:
    the config's defaults, with the workload's own model and data)."""
    return args.preset or (None if args.model else default_preset())


def _micro_given(args: argparse.Namespace, overrides: dict) -> bool:
    """Whether the command or its preset sets ``batch.micro`` (else a workload's loader does)."""
    preset = _preset(args)
    return "micro" in overrides.get("batch", {}) or (
        preset is not None and "micro" in read_preset(preset).get("batch", {})
    )


def _resumed_run(args: argparse.Namespace, overrides: dict) -> tuple[Path, RunConfig]:
    """The run to resume and its saved config with ``overrides`` applied, validated as a whole (not
    the overrides against a preset the run may never have used). Its folder: ``--resume RUN`` or
    ``--run.name``, in ``--run.out_dir`` (else the preset's), or else the latest run there."""
    run = overrides.get("run", {})
    out_dir = run.get("out_dir") or load_config(args.preset or default_preset()).run.out_dir
    run_dir = find_run_dir(out_dir, args.resume or run.get("name", ""))
    return run_dir, resume_config(run_dir, overrides)


def _relaunched_run(
    args: argparse.Namespace, overrides: dict, topology: Topology, launch: Launch
) -> tuple[Path, str, dict | None] | None:
    """The run this start continues by itself (:meth:`Launch.relaunch_of` decides: a requeued
    SLURM job, a worker group torchrun started again in the same job), why, and the job record it
    keeps: ``run.name`` (or the name :meth:`Launch.default_name` gives every start of the job) in
    ``run.out_dir``. None for a new start, and when the run does not exist yet (the job stopped
    before it made it: it starts as new) or has no name (an automatic name differs at every
    start: said once)."""
    if not (launch.job_known or launch.slurm_restart or launch.restart):
        return None  # a plain process, or a first start
    config = load_config(args.preset or default_preset(), overrides)
    name = config.run.name or launch.default_name(config.preset)
    path = Path(config.run.out_dir) / name if name else None
    exists = path is not None and (path / CONFIG_FILE).is_file()
    recorded = read_launch(path) if path is not None and exists else None
    why = launch.relaunch_of(recorded, main=topology.rank == 0)
    if not why:
        if topology.rank == 0 and launch.restart and not launch.job_known and recorded is not None:
            print(
                f"turbotrain train: torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT={launch.restart}), but "
                f"{path} was started by another torchrun (another launch, or rank 0 on another node), so it is not "
                "taken over; to resume across nodes give torchrun --rdzv-id=UNIQUE_ID",
                file=sys.stderr,
            )
        return None
    if path is None:
        if topology.rank == 0:
            print(
                f"turbotrain train: {why}, but the run has no --run.name, so its first start cannot be found: a new "
                "run starts; name the run (e.g. --run.name=$SLURM_JOB_NAME-$SLURM_JOB_ID) to resume automatically",
                file=sys.stderr,
            )
        return None
    return (path, why, recorded) if exists else None


def _named_for_restarts(config: RunConfig, launch: Launch) -> RunConfig:
    """A new run that torchrun may restart (``--max-restarts``) needs a name its restarts find
    again: without ``--run.name`` it is named from the job (:meth:`Launch.default_name`); and a
    launch its restarts can be told by (:attr:`Launch.restart_unfindable`): refused at the start
    otherwise, in one line, rather than a restart that finds its run taken."""
    if not launch.restartable:
        return config
    if not config.run.name:
        name = launch.default_name(config.preset)
        if not name:
            raise ConfigError(
                "torchrun --max-restarts starts the workers again with the same command, which must find its "
                "run: name it with --run.name=NAME (or give torchrun --rdzv-id, which names it)"
            )
        config = config.replace(run={"name": name})
    if launch.restart_unfindable:
        raise ConfigError(
            "torchrun --max-restarts starts the workers again with the same command, but this launch gives "
            "them nothing to know their run by (TORCHELASTIC_RUN_ID=none and no torchrun agent known): "
            "give torchrun --rdzv-id=UNIQUE_ID (or --standalone on one node)"
        )
    return config


def _batch_record(config: RunConfig, plan: ParallelPlan) -> dict:
    """The global batch this start trains at, kept with the job record (what a relaunch at another
    world size keeps: :func:`_keep_global_batch`)."""
    b = split_batch(config, plan).batch
    return {
        "world_size": plan.world,
        **({"global_batch": b.micro * b.accumulation * plan.data} if isinstance(b.micro, int) else {}),
    }


def _keep_global_batch(config: RunConfig, recorded: dict | None, topology: Topology) -> RunConfig:
    """A relaunch at another world size (an elastic group that lost or gained a node) keeps the
    global batch the run trained at, by accumulation, when the micro-batch times the new world
    divides it; otherwise the resume refuses in one line, as a ``--resume`` would, naming the
    settings that keep it. Any split of the same global batch trains on the same rows per step."""
    old, b = (recorded or {}).get("global_batch"), config.batch
    if not isinstance(old, int) or b.global_size or not isinstance(b.micro, int):
        return config  # batch.global_size already keeps it (split_batch); 'auto' searches anew
    if old == b.micro * b.accumulation * topology.world or old % (b.micro * topology.world):
        return config
    return config.replace(batch={"global_size": old, "accumulation": 1})


def _record_restart(run_dir: Path, why: str, world: int) -> None:
    """An event record in metrics.jsonl for a relaunch, at the step it resumes from (the newest
    verified checkpoint, which the resume loads; 0 without one): when, why, the checkpoint, how
    many logged steps run again and on how many processes. The report counts them in the summary."""
    newest = latest_verified(run_dir / CHECKPOINTS)
    step = checkpoint_step(newest) if newest is not None else 0
    metrics = run_dir / METRICS_FILE
    before = read_metrics(metrics)[0] if metrics.is_file() else []
    reached = max((r["step"] for r in before if "event" not in r), default=step)  # logged before the failure
    truncate_metrics(metrics, step)  # as the resume will: the later steps and a torn last line go first
    record = {
        "step": step,
        "event": "restart",
        "restart": 1 + sum(r.get("event") == "restart" for r in before if r["step"] <= step),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "why": why,
        "resumed_from": newest.name if newest is not None else "",
        "steps_redone": max(0, reached - step),
        "world_size": world,
    }
    with open(metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _new_run(base: RunConfig) -> tuple[Path, RunConfig]:
    """A new run's directory and config, its automatic name fixed once."""
    config = base.replace(run={"name": run_name(base)})
    return new_run_dir(config), config


def _train_other_rank(
    config: RunConfig,
    run_dir: Path,
    resume: bool,
    plan: ParallelPlan,
    spec: ModelSpec,
    batch_given: bool = False,
) -> int:
    """A rank other than 0: the same training in rank 0's run directory, printing nothing but its errors."""
    rank = plan.rank
    try:
        summary = train(
            config,
            resume_dir=run_dir if resume else None,
            run_dir=run_dir,
            progress=False,
            batch_given=batch_given,
            plan=plan,
            spec=spec,
        )
    except ReportedByAnotherRank:
        return 0  # rank 0 (or the rank that found it) failed and says why
    except StoppedBySignal:
        return stopped_exit(active_signals())
    except TurbotrainError as exc:
        raise TurbotrainError(f"[rank {rank}] {exc}") from None
    except Exception as exc:
        lost = _peer_lost(exc, Topology.from_env(), run_dir)
        if lost is None:
            raise
        print(f"turbotrain train: {lost}", file=sys.stderr)
        return EXIT_PEER_LOST
    return stopped_exit(active_signals()) if stopped_by_signal(summary) else 0


def _peer_lost(exc: BaseException, topology: Topology, run_dir: Path) -> str | None:
    """A collective that failed because another rank died or timed out, as one line that says
    so and how to continue (None for any other error, which keeps its traceback)."""
    if (
        topology.world < 2
        or not isinstance(exc, (dist.DistError, RuntimeError))
        or isinstance(exc, torch.OutOfMemoryError)
    ):
        return None
    text = " ".join(str(exc).split())
    if not isinstance(exc, dist.DistError) and not any(
        k in text.lower() for k in ("gloo", "nccl", "connection", "timed out", "timeout")
    ):
        return None
    reported = reported_elsewhere()
    if reported is not None:  # that rank stopped with its own one-line error: said once, there
        raise ReportedByAnotherRank(reported) from None
    launch = Launch.from_env()
    then = (
        f"torchrun starts the workers again (restart {launch.restart + 1} of --max-restarts {launch.max_restarts}), "
        "which resume from the newest one by themselves"
        if launch.restart < launch.max_restarts
        else f"continue with `{resume_command(run_dir, topology)}`"
    )
    return (
        f"[rank {topology.rank}] another rank stopped or was lost: a collective failed ({text[:200]}); checkpoints "
        f"already written are kept: {then}"
    )


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
    metrics = [
        f"{k[len('final_val_') :].replace('_', ' ')} {v:.4f}"
        for k, v in summary.items()
        if k.startswith("final_val_") and k not in ("final_val_loss", "final_val_step") and v is not None
    ]
    if metrics:
        lines.append("  validation " + " | ".join(metrics))
    samples = (summary.get("steady_state") or {}).get("samples_per_s")
    if not rate and samples:  # not a language model: throughput in samples
        first = summary.get("first_step_s")
        lines.append(
            f"  {samples:,.1f} samples/s (median)"
            + (f" | first step {first:.2f} s" if first is not None else "")
            + f" | {summary['elapsed_s']:.1f} s total"
        )
    if rate:
        # None when this invocation trained no step (a finished run resumed)
        first = summary.get("first_step_s")
        per_rank = summary.get("rank_tokens_per_s_median") if r.get("world_size", 1) > 1 else None
        lines.append(
            f"  {rate:,.0f} tokens/s (median"
            + (f"; {per_rank:,.0f} per process)" if per_rank else ")")
            + (f" | first step {first:.2f} s" if first is not None else "")
            + f" | {summary['elapsed_s']:.1f} s total"
        )
    for e in summary.get("events", []):
        lines.append(f"  event at step {e['step']}: {e['kind']}: {e['detail']}")
    print("\n".join(lines))
