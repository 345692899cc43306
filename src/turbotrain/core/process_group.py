"""This process's membership of the launcher's process group: joining it once, noticing when the
launcher is gone, the gloo groups beside NCCL, and leaving cleanly at exit. Everything else asks
torch.distributed through here, so a one-process run never touches it.
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
    """Join the launcher's process group once (NCCL on CUDA, gloo on CPU); no-op in a plain process."""
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
    """torchrun's store under a prefix per worker group: the agent keeps one store for every group it
    starts, so without one a restarted rank can read a gone rank's address ("Connection refused")."""
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
    """Stop as for SIGTERM when the launcher (the parent) is gone: a kill -9 of torchrun leaves its
    ranks (each in its own session) training as orphans. A daemon thread, once per process."""
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
    """This process's rank and the world size of its process group: (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if in_group() else (0, 1)


def collective_device() -> torch.device:
    """Where a small tensor for a collective must live: the GPU under NCCL, else the CPU."""
    if in_group() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_leaving: list[bool] = []  # the exit hook, once registered
_gloo_groups: list[dist.ProcessGroup] = []  # gloo groups made beside another default backend (NCCL)


def new_gloo_group() -> dist.ProcessGroup:
    """A gloo group of every rank (a collective), left by :func:`shutdown`."""
    group = dist.new_group(backend="gloo")
    _gloo_groups.append(group)
    return group


def shutdown() -> None:
    """Leave this process's gloo groups (local: it cannot wait on a gone rank). NCCL's default group
    is left to torch: its teardown is collective in some versions and would hang after a lost peer."""
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
    """How many of this process's threads called ``name`` are running (Linux's /proc; else 0)."""
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
    """atexit: leave the gloo groups, then wait (GIL released, at most ``GLOO_IDLE_WAIT_S``) until
    gloo's workers are idle, while the interpreter is whole. Else a worker freeing a tensor during
    teardown takes the GIL and dies in pthread_exit: "terminate called without an active
    exception" (SIGABRT) after the script's last line."""
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - an exit hook must not turn a finished run into a traceback
        log.warning("leaving the process group at exit failed: %s", exc)
    deadline = time.monotonic() + GLOO_IDLE_WAIT_S
    while True:
        time.sleep(0.005)  # the GIL released: a worker that finished a collective drops its references now
        if not _running_threads(GLOO_WORKER) or time.monotonic() > deadline:
            return
