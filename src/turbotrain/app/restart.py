"""A run started again by its launcher (a requeued SLURM job, a worker group torchrun starts again:
both repeat the first start's command): which start continues which run, at which batch, and what a
rank says when another was lost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..base.config import RunConfig
from ..base.errors import ConfigError
from ..base.launch import Launch, Topology
from ..base.rundir import CONFIG_FILE, read_launch
from ..core.main_rank import ReportedByAnotherRank, reported_elsewhere
from ..core.plan import ParallelPlan


def resume_command(run_dir: Path | str, topology: Topology) -> str:
    """The command that continues the run in ``run_dir`` (torchrun's for several processes)."""
    target = f"--resume {run_dir}".rstrip()
    if topology.world < 2:
        return f"turbotrain train {target}"
    if topology.launcher == "slurm":
        return f"srun ... (as before) python -m turbotrain train {target}"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world))
    launch = f"--nproc-per-node {local}" if local == topology.world else "... (as before)"
    return f"torchrun {launch} -m turbotrain train {target}"


def relaunched_run(
    config: RunConfig, topology: Topology, launch: Launch
) -> tuple[Path, str, dict[str, Any] | None] | None:
    """The run this start continues by itself (:meth:`Launch.relaunch_of` decides), why, and the job
    record it keeps: ``run.name`` (or the job's :meth:`Launch.default_name`) in ``run.out_dir``.
    None for a new start, a run not made yet, or one without a name (said once)."""
    if not (launch.job_known or launch.slurm_restart or launch.restart):
        return None  # a plain process, or a first start
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


def named_for_restarts(config: RunConfig, launch: Launch) -> RunConfig:
    """A new run torchrun may restart, named so its restarts find it (a launch they cannot tell: refused)."""
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


def batch_record(settings: RunConfig, plan: ParallelPlan) -> dict[str, Any]:
    """The global batch this start trains at, kept with the job record for a relaunch to keep."""
    b = settings.batch
    return {
        "world_size": plan.world,
        **({"global_batch": b.micro * b.accumulation * plan.data} if isinstance(b.micro, int) else {}),
    }


def keep_global_batch(config: RunConfig, recorded: Mapping[str, Any] | None, topology: Topology) -> RunConfig:
    """A relaunch at another world size keeps the run's global batch by accumulation, when the
    micro-batch times the new world divides it (otherwise the resume refuses in one line)."""
    old, b = (recorded or {}).get("global_batch"), config.batch
    if not isinstance(old, int) or b.global_size or not isinstance(b.micro, int):
        return config  # batch.global_size already keeps it (resolve_accumulation); 'auto' searches anew
    if old == b.micro * b.accumulation * topology.world or old % (b.micro * topology.world):
        return config
    return config.replace(batch={"global_size": old, "accumulation": 1})


def peer_lost(exc: BaseException, topology: Topology, run_dir: Path) -> str | None:
    """A collective failed because another rank died or timed out: one line saying so and how to
    continue (None for any other error). Raises :class:`ReportedByAnotherRank` when that rank said why."""
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
