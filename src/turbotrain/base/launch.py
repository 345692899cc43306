"""Where this process sits in its launch (:class:`Topology`) and which launcher job started it, how
often (:class:`Launch`), read from the environment in one place, before any process group exists.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank among ``world`` processes and its device index on the node."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    launched: bool = False  # started by a launcher: torchrun (RANK/WORLD_SIZE) or SLURM's srun
    launcher: str = ""  # "torchrun" or "slurm" when launched
    # SLURM only: where rank 0 hosts the rendezvous (torchrun's come from its own variables)
    master_addr: str = ""
    master_port: int = 0

    @classmethod
    def from_env(cls, environ: Any = None) -> Topology:
        """torchrun's variables win; else a SLURM ``srun`` of 2+ tasks; else a plain process."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(
                int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]), True, "torchrun"
            )
        return slurm_topology(env) or cls()


SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000  # the rendezvous port: MASTER_PORT, else base + job id % span


def slurm_topology(env: Any) -> Topology | None:
    """The topology of a task started by SLURM's ``srun``, as Lightning's ``SLURMEnvironment`` reads
    it; None for one task, an interactive job (``bash``, ``interactive``) or a missing variable."""
    need = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS")
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if any(k not in env for k in need) or not nodes or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    try:
        world, rank = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
        local = int(env.get("SLURM_LOCALID", 0))
        job = int(str(env["SLURM_JOB_ID"]).split("_")[0])
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else SLURM_PORT_BASE + job % SLURM_PORT_SPAN
    except ValueError as exc:
        raise ConfigError(
            f"a SLURM variable is not a number ({exc}); check SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, "
            "SLURM_JOB_ID and MASTER_PORT"
        ) from None
    if world < 2:
        return None
    if not 0 <= rank < world:
        raise ConfigError(f"SLURM_PROCID = {rank} is outside SLURM_NTASKS = {world}")
    return Topology(rank, local, world, True, "slurm", env.get("MASTER_ADDR") or first_host(nodes), port)


def slurm_hosts(nodelist: str) -> list[str]:
    """The hosts of a compact SLURM node list, in order: ``node[01-03,07],gpu5`` -> node01, node02,
    node03, node07, gpu5 (zero padding kept; one bracket group per name)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            if not (lo.isdigit() and hi.isdigit()):
                raise ConfigError(f"cannot read the SLURM node list {nodelist!r} (range {part!r})")
            hosts += [f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi) + 1)]
    if not hosts:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}")
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (where rank 0 runs: SLURM gives task 0 the first node)."""
    return slurm_hosts(nodelist)[0]


def _count(env: Any, key: str) -> int:
    try:
        return max(0, int(env.get(key) or 0))
    except ValueError:
        return 0


@dataclass(frozen=True)
class Launch:
    """The launcher's job this process belongs to: the one place that decides whether a start is a
    relaunch of the same run (a requeued SLURM job; a torchrun restart of the same rendezvous id,
    or of the same agent without one, checked by rank 0) or a new start (docs/resume.md)."""

    # torchrun's rendezvous id ("" outside torchrun; "none" when multi-node without --rdzv-id)
    run_id: str = ""
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS
    slurm_job: str = ""
    slurm_restart: int = 0  # SLURM_RESTART_COUNT
    agent: str = ""  # the torchrun agent that started this process, the same at its every restart

    @classmethod
    def from_env(cls, environ: Any = None) -> Launch:
        """torchrun's variables win; else a SLURM ``srun`` of 2+ tasks; else a plain process."""
        env = os.environ if environ is None else environ
        torchrun = "RANK" in env and "WORLD_SIZE" in env
        slurm = "SLURM_JOB_ID" in env
        return cls(
            env.get("TORCHELASTIC_RUN_ID", "") if torchrun else "",
            _count(env, "TORCHELASTIC_RESTART_COUNT") if torchrun else 0,
            _count(env, "TORCHELASTIC_MAX_RESTARTS") if torchrun else 0,
            env["SLURM_JOB_ID"] if slurm else "",
            _count(env, "SLURM_RESTART_COUNT") if slurm else 0,
            torchrun_agent(env, parent=environ is None) if torchrun and "TORCHELASTIC_RUN_ID" in env else "",
        )

    @property
    def job_known(self) -> bool:
        return self.run_id not in ("", "none")

    @property
    def restartable(self) -> bool:
        """torchrun may start this worker group again (``--max-restarts`` > 0)."""
        return self.max_restarts > 0

    @property
    def restart_unfindable(self) -> bool:
        """torchrun may restart the workers, but a restart could not find its run (no id, no agent)."""
        return self.restartable and not self.job_known and not self.agent

    def record(self) -> dict[str, Any]:
        """What a run directory keeps of the job that last started it (see :meth:`relaunch_of`)."""
        return {
            "torchrun_run_id": self.run_id,
            "slurm_job": self.slurm_job,
            **({"torchrun_agent": self.agent} if self.agent else {}),
        }

    def relaunch_of(self, recorded: Any, main: bool = True) -> str:
        """Why this start continues the run that last :meth:`record` ``recorded``; "" for a new start."""
        if self.slurm_restart > 0:
            return f"SLURM requeued the job: SLURM_RESTART_COUNT={self.slurm_restart}"
        if (
            not self.run_id
            or not isinstance(recorded, dict)
            or recorded.get("torchrun_run_id") != self.run_id
        ):
            return ""
        restarted = f"torchrun restarted the workers: TORCHELASTIC_RESTART_COUNT={self.restart} of {self.max_restarts}"
        if self.job_known:
            return (
                restarted
                if self.restart > 0
                else "torchrun restarted the workers after the elastic group changed"
            )
        same_agent = bool(self.agent) and recorded.get("torchrun_agent") == self.agent
        return restarted if self.restart > 0 and (same_agent or not main) else ""

    def default_name(self, preset: str) -> str:
        """A run name the same at every start of this job, for a run torchrun may restart ("" if unneeded)."""
        if not (self.restartable and self.job_known):
            return ""
        job = re.sub(r"[^A-Za-z0-9._-]", "_", self.run_id)
        if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", job):
            job = job[:8]  # the id --standalone draws: its first 8 hex digits are enough
        return f"{preset}-{job}"


def torchrun_agent(env: Any, parent: bool = True) -> str:
    """The torchrun agent that started this worker, the same at its restarts: its log directory, else
    (``parent``) the parent's pid and start time, with the host; "" when neither is known."""
    host = socket.gethostname()
    match = re.fullmatch(r"(.+)/attempt_\d+/\d+/error\.json", env.get("TORCHELASTIC_ERROR_FILE") or "")
    if match is not None:
        return f"{host}:{match.group(1)}"
    if not parent:
        return ""
    pid = os.getppid()
    try:  # field 22 of /proc/PID/stat: the start time, which tells a reused pid apart
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
    return f"{host}:pid {pid} started {start}"
