"""This process's membership of the launcher's process group: joining it once (NCCL on CUDA, gloo
on CPU; torchrun's store under a prefix per worker group, SLURM's rendezvous at rank 0's node),
noticing when the launcher is gone, the extra gloo groups beside NCCL, and leaving cleanly at exit.

Everything else asks torch.distributed through here (:func:`in_group`, :func:`rank_world`,
:func:`collective_device`), so a one-process run never touches it.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..base.config import DistributedConfig
from ..base.launch import Topology

log = logging.getLogger(__name__)


def join_process_group(cfg: DistributedConfig, device: torch.device, topology: Topology) -> None:
    """Join the launcher's process group (NCCL on CUDA, gloo on CPU) once; a no-op in a plain
    process or when already joined. ``distributed.timeout_s`` bounds every collective, so a rank
    whose peer died ends with an error instead of waiting for ever. From here on a rank whose
    launcher dies stops as if told to (:func:`watch_launcher`)."""
    if not topology.launched or dist.is_initialized():
        return
    watch_launcher()
    backend = "nccl" if device.type == "cuda" else "gloo"
    where: dict[str, Any] = {}
    if topology.launcher == "slurm":  # no torchrun variables: rank 0 hosts the store at the first node
        host = f"[{topology.master_addr}]" if ":" in topology.master_addr else topology.master_addr
        where = {
            "init_method": f"tcp://{host}:{topology.master_port}",
            "rank": topology.rank,
            "world_size": topology.world,
        }
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        where = _restart_safe_store(topology, cfg.timeout_s)
    if device.type == "cuda":
        where["device_id"] = device
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s), **where)
    if not _leaving:
        _leaving.append(True)
        atexit.register(_leave_at_exit)


def _restart_safe_store(topology: Topology, timeout_s: float) -> dict[str, Any]:
    """torchrun's store for this worker group, under a prefix of its own. torchrun's agent keeps
    one store for all the groups it starts (``--max-restarts``, elastic membership changes), so
    without a prefix a restarted rank can read the address a rank of the group before left there
    and connect to a process that is gone (gloo: "Connection refused", or a hang). A new group has
    a new restart count (after a failure) or a new world size (a node joined)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        topology.world,
        is_master=False,
        timeout=timeout,
    )
    group = f"turbotrain/group/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{topology.world}/"
    return {"store": dist.PrefixStore(group, store), "rank": topology.rank, "world_size": topology.world}


LAUNCHER_POLL_S = 1.0
_watching: list[int] = []  # the launcher's pid, once a watcher runs


def watch_launcher(poll_s: float = LAUNCHER_POLL_S) -> None:
    """A rank started by a launcher (torchrun's agent, its parent) notices when the launcher is
    gone and stops as for SIGTERM: after the current step, with a checkpoint (under
    ``turbotrain train``'s signal handling, the ranks agree on the step). torchrun starts each
    rank in its own session, so a kill -9 of torchrun's process group leaves the ranks running as
    orphans, training to the end with no one to report to. A daemon thread compares the parent
    pid every ``poll_s`` seconds (a re-parented orphan gets init's or a subreaper's) and signals
    this process once. Started once per process; a no-op on a plain process."""
    if _watching or not hasattr(os, "getppid"):
        return
    launcher = os.getppid()
    _watching.append(launcher)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.warning(
            "the launcher of this rank (process %d, torchrun) is gone: stopping after this step with a "
            "checkpoint, as for SIGTERM",
            launcher,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="turbotrain-launcher-watch", daemon=True).start()


def in_group() -> bool:
    """Whether this process has joined a torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size of its process group: (0, 1) without one. The one
    place that asks torch.distributed; everything else reads it through here."""
    return (dist.get_rank(), dist.get_world_size()) if in_group() else (0, 1)


def collective_device() -> torch.device:
    """Where a small tensor for a collective of the current group must live: this process's GPU
    under NCCL (which has no CPU transport), the CPU under gloo or without a group."""
    if in_group() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_leaving: list[bool] = []  # the exit hook, once registered
_gloo_groups: list[dist.ProcessGroup] = []  # gloo groups made beside another default backend (NCCL)


def new_gloo_group() -> dist.ProcessGroup:
    """A gloo group of every rank (for host-side collectives beside NCCL: a background checkpoint
    write's), left by :func:`shutdown`. Making a group is a collective: every rank calls this at
    the same point."""
    group = dist.new_group(backend="gloo")
    _gloo_groups.append(group)
    return group


def shutdown() -> None:
    """Leave the gloo process groups of this process (a no-op without one): under a gloo default
    group, all of them; under NCCL, the gloo groups :func:`new_gloo_group` made. Leaving gloo is
    local (no collective), so it cannot wait on a rank that is gone. NCCL's default group is left
    to torch: its teardown is collective in some NCCL versions and would hang an exit after a peer
    was lost."""
    if not in_group():
        _gloo_groups.clear()
        return
    if dist.get_backend() == "gloo":
        dist.destroy_process_group()
    else:
        for group in _gloo_groups:
            dist.destroy_process_group(group)
    _gloo_groups.clear()


GLOO_WORKER = "pt_gloo_runloop"  # the thread name torch gives gloo's worker threads
GLOO_IDLE_WAIT_S = 1.0  # at most this long at exit for gloo's workers to finish (normally a few ms)


def _running_threads(name: str) -> int:
    """How many of this process's threads called ``name`` are running or runnable (Linux's
    /proc; 0 where it cannot tell)."""
    count = 0
    try:
        for task in os.scandir("/proc/self/task"):
            with open(f"{task.path}/stat") as f:
                stat = f.read()
            comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
            count += comm == name and state == "R"
    except OSError:
        return 0
    return count


def _leave_at_exit() -> None:
    """atexit, registered when this process joins the launcher's group: leave the gloo groups, then
    let gloo's worker threads go idle, while the interpreter is whole. The cause it removes (a core
    dump's stacks): a gloo worker thread that has completed a collective drops its reference to
    the work after the caller's wait returned; when that was the last reference to a tensor Python
    had seen, freeing it takes the GIL, and a thread that takes the GIL while the interpreter is
    being torn down is ended by pthread_exit, whose unwinding through the work's destructor
    calls std::terminate: "terminate called without an active exception" (SIGABRT, reported by
    torchrun as the rank's failure) after the script's last line. The groups are not freed while
    DDP or FSDP still hold them, so leaving them is not enough: this waits, the GIL released,
    until no gloo worker is running (bounded by ``GLOO_IDLE_WAIT_S``). Interpreter exit joins
    non-daemon threads (a background checkpoint write) before it runs this."""
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - an exit hook must not turn a finished run into a traceback
        log.warning("leaving the process group at exit failed: %s", exc)
    deadline = time.monotonic() + GLOO_IDLE_WAIT_S
    while True:
        time.sleep(0.005)  # the GIL released: a worker that finished a collective drops its references now
        if not _running_threads(GLOO_WORKER) or time.monotonic() > deadline:
            return
