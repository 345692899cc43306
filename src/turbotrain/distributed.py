"""Data parallelism on torch.distributed, resolved once into a strategy the Engine calls.

``torchrun`` starts the processes and sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; this module
joins them into a process group (NCCL on CUDA, one device per ``LOCAL_RANK``; gloo on CPU) and
wraps the model:

- ``single``: one process; every method does nothing (the base class).
- ``ddp``: ``DistributedDataParallel`` (bucket size, static graph, gradients as bucket views).
  Gradient sync is switched off for the micro-steps before an accumulation boundary (what
  ``no_sync()`` does, but settable from an own loop that calls ``engine.backward``).
- ``fsdp``: FSDP2 ``fully_shard`` on each repeated block and on the root, with a mixed-precision
  policy from the precision plugin's dtypes (its ``compute_dtype`` for the all-gathered parameters,
  bf16 in the mixed modes and fp8, and its ``reduce_dtype`` for gradient reduction, fp32 in all
  built-in modes);
  reshard-after-forward configurable. Parameters become DTensors, so the optimizer, built before,
  is pointed at them (its state is still empty then).

Across ranks the engine averages each step's loss on the device (a small all-reduce, no host
sync), so every rank's non-finite guard sees the same value and they skip together.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# torch.distributed.fsdp and .tensor (DTensor) cost ~0.5 s to import: only an fsdp run imports
# them (FSDP.wrap), so ``import turbotrain`` and a one-process run stay light.

from .config import DIST_STRATEGIES, DistributedConfig, choice_error, setting
from .errors import ConfigError, TurbotrainError
from .models.blocks import repeated_blocks

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank among ``world`` processes and its device index on the node."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    launched: bool = False  # started by a launcher: torchrun (RANK/WORLD_SIZE) or SLURM's srun
    launcher: str = ""  # "torchrun" or "slurm" when launched
    master_addr: str = ""  # SLURM only: where rank 0 hosts the rendezvous (torchrun's come from its own variables)
    master_port: int = 0

    @classmethod
    def from_env(cls, environ: Any = None) -> "Topology":
        """The launch, read from the environment in one place: torchrun's variables (``RANK``,
        ``WORLD_SIZE``, ``LOCAL_RANK``; also set by a Kubernetes PyTorchJob and TorchX) win; else
        the tasks of a SLURM ``srun`` with more than one task (:func:`slurm_topology`); else a
        plain process, rank 0 of 1."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]), True, "torchrun")
        return slurm_topology(env) or cls()


SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000  # the rendezvous port: MASTER_PORT, else base + job id % span


def slurm_topology(env: Any) -> "Topology | None":
    """The topology of a task started by SLURM's ``srun`` (no torchrun), as Lightning's
    ``SLURMEnvironment`` reads it: rank ``SLURM_PROCID`` of ``SLURM_NTASKS``, local rank
    ``SLURM_LOCALID``; rank 0 listens on the first host of ``SLURM_JOB_NODELIST`` (or
    ``SLURM_NODELIST``) unless ``MASTER_ADDR`` is set, at ``MASTER_PORT`` or else a port derived
    from ``SLURM_JOB_ID`` (the same on every task of the job). None when this is not such a task:
    one task (an interactive ``salloc`` shell, ``srun -n 1``), an interactive job (named ``bash``
    or ``interactive``), or a variable missing. Start it with ``srun``: the batch script itself
    also sees ``SLURM_NTASKS`` and ``SLURM_PROCID=0``, and a bare ``python`` there would wait for
    the other tasks until ``distributed.timeout_s``."""
    need = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS")
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if any(k not in env for k in need) or not nodes or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    try:
        world, rank, local = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0))
        job = int(str(env["SLURM_JOB_ID"]).split("_")[0])
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else SLURM_PORT_BASE + job % SLURM_PORT_SPAN
    except ValueError as exc:
        raise ConfigError(f"a SLURM variable is not a number ({exc}); check SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID, "
                          "SLURM_JOB_ID and MASTER_PORT") from None
    if world < 2:
        return None
    if not 0 <= rank < world:
        raise ConfigError(f"SLURM_PROCID = {rank} is outside SLURM_NTASKS = {world}")
    return Topology(rank, local, world, True, "slurm", env.get("MASTER_ADDR") or first_host(nodes), port)


def slurm_hosts(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list in its compact form, in order: ``node[01-03,07],gpu5`` ->
    node01, node02, node03, node07, gpu5 (zero padding kept; one bracket group per name, which is
    what SLURM prints for a job's nodes)."""
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
    """The launcher's job this process belongs to, and how often that job started it again: the
    one place that decides whether a start is a relaunch of the same run (which then resumes by
    itself) or a new start (which refuses an existing run directory, as always).

    - SLURM: a requeued job (``SLURM_RESTART_COUNT`` > 0) continues its run.
    - torchrun: a worker group that torchrun started again in the same job (``--max-restarts``
      after a failure: ``TORCHELASTIC_RESTART_COUNT`` > 0; an elastic ``--nnodes MIN:MAX``
      membership change, which keeps the count) continues the run that this job, known by its
      rendezvous id ``TORCHELASTIC_RUN_ID``, last started (:meth:`record`, kept in the run
      directory). A new torchrun gets a new id (``--standalone`` and one-node runs draw one), so
      it cannot take over a run of another job even under the same name."""

    run_id: str = ""  # torchrun's rendezvous id ("" outside torchrun; "none" when multi-node without --rdzv-id)
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS
    slurm_job: str = ""
    slurm_restart: int = 0  # SLURM_RESTART_COUNT

    @classmethod
    def from_env(cls, environ: Any = None) -> "Launch":
        env = os.environ if environ is None else environ
        torchrun = "RANK" in env and "WORLD_SIZE" in env
        slurm = "SLURM_JOB_ID" in env
        return cls(env.get("TORCHELASTIC_RUN_ID", "") if torchrun else "",
                   _count(env, "TORCHELASTIC_RESTART_COUNT") if torchrun else 0,
                   _count(env, "TORCHELASTIC_MAX_RESTARTS") if torchrun else 0,
                   env["SLURM_JOB_ID"] if slurm else "", _count(env, "SLURM_RESTART_COUNT") if slurm else 0)

    @property
    def job_known(self) -> bool:
        return self.run_id not in ("", "none")

    @property
    def restartable(self) -> bool:
        """torchrun may start this worker group again (``--max-restarts`` > 0)."""
        return self.max_restarts > 0

    def record(self) -> dict[str, Any]:
        """What a run directory keeps of the job that last started it (see :meth:`relaunch_of`)."""
        return {"torchrun_run_id": self.run_id, "slurm_job": self.slurm_job}

    def relaunch_of(self, recorded: Any) -> str:
        """Why this start continues the run whose directory holds ``recorded`` (its last
        :meth:`record`, None when it has none), in words for the "resuming" line; "" when it is a
        new start."""
        if self.slurm_restart > 0:
            return f"SLURM requeued the job: SLURM_RESTART_COUNT={self.slurm_restart}"
        if self.job_known and isinstance(recorded, dict) and recorded.get("torchrun_run_id") == self.run_id:
            if self.restart > 0:
                return f"torchrun restarted the workers: TORCHELASTIC_RESTART_COUNT={self.restart} of {self.max_restarts}"
            return "torchrun restarted the workers after the elastic group changed"
        return ""

    def default_name(self, preset: str) -> str:
        """A run name the same at every start of this job, for a run without ``--run.name`` that
        torchrun may restart (a timestamped name would differ); "" when none is needed or known."""
        if not (self.restartable and self.job_known):
            return ""
        job = re.sub(r"[^A-Za-z0-9._-]", "_", self.run_id)
        if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", job):
            job = job[:8]  # the id --standalone draws: its first 8 hex digits are enough
        return f"{preset}-{job}"


def is_loaded_instance(obj: Any, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` without importing ``module`` (a costly one, imported on first
    use): while ``module`` was never imported, no object of its classes can exist."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


class Strategy:
    """One process, no communication: the "off" form every other strategy overrides."""

    name = "single"

    def __init__(self, topology: Topology = Topology()) -> None:
        self.topology = topology
        self.rank, self.world = topology.rank, topology.world

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs and writes files shared by the run."""
        return self.rank == 0

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, param_dtype: torch.dtype | None,
             reduce_dtype: torch.dtype | None = torch.float32) -> nn.Module:
        """The model to train (wrapped for communication); ``optimizer`` is kept pointing at its parameters.
        ``param_dtype`` and ``reduce_dtype`` are the precision's (its ``compute_dtype`` and ``reduce_dtype``):
        what FSDP2 all-gathers parameters in for compute and reduces gradients in."""
        return model

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        """Whether the coming backward reduces gradients across ranks (only at accumulation boundaries)."""

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged over ranks in place, enqueued on the device (no host sync)."""
        return tensor

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A plain tensor from a possibly sharded one (a DTensor's global value)."""
        return tensor

    def any_rank(self, flag: bool, device: torch.device | None = None) -> bool:
        """Whether ``flag`` is True on any rank (a host-device sync point under NCCL: call it
        only every N steps, at the same steps on every rank, e.g. to agree on stopping)."""
        return flag


class DataParallel(Strategy):
    """Shared by DDP and FSDP2: averaging over the process group."""

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        # SUM then divide: gloo's AVG has had a silent-correctness bug in some versions.
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.div_(self.world)

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if is_loaded_instance(tensor, "torch.distributed.tensor", "DTensor") else tensor

    def any_rank(self, flag: bool, device: torch.device | None = None) -> bool:
        t = torch.tensor(int(flag), device=device or collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())  # sync: the agreed answer is needed on the host


class DDP(DataParallel):
    name = "ddp"

    def __init__(self, topology: Topology, cfg: DistributedConfig, device: torch.device) -> None:
        super().__init__(topology)
        self.cfg, self.device = cfg, device

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, param_dtype: torch.dtype | None,
             reduce_dtype: torch.dtype | None = torch.float32) -> nn.Module:
        return DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_cap_mb, static_graph=self.cfg.static_graph,
            gradient_as_bucket_view=self.cfg.gradient_as_bucket_view,
        )

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        model.require_backward_grad_sync = sync  # the flag DDP's no_sync() context sets


class FSDP(DataParallel):
    name = "fsdp"

    def __init__(self, topology: Topology, cfg: DistributedConfig) -> None:
        super().__init__(topology)
        self.cfg = cfg

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, param_dtype: torch.dtype | None,
             reduce_dtype: torch.dtype | None = torch.float32) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # on first use: see the note at the imports

        names = {id(p): name for name, p in model.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in repeated_blocks(model) or ():
            fully_shard(block, mp_policy=policy, reshard_after_forward=self.cfg.reshard_after_forward)
        fully_shard(model, mp_policy=policy, reshard_after_forward=self.cfg.reshard_after_forward)
        if optimizer is not None:
            if optimizer.state:
                raise ConfigError("distributed.strategy = 'fsdp' shards the parameters: call engine.setup(model, optimizer) "
                                  "before the optimizer's first step")
            sharded = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]


def resolve_strategy(cfg: DistributedConfig, topology: Topology) -> str:
    """``distributed.strategy`` for this launch (``auto``: ddp under torchrun with more than one
    process, else single), checked without any communication, so that a mistake is reported
    identically by every rank before any of them joins the process group."""
    strategy = cfg.strategy
    if strategy not in ("auto", *DIST_STRATEGIES):
        raise choice_error("distributed.strategy", strategy, ("auto", *DIST_STRATEGIES))
    if strategy == "auto":
        strategy = "ddp" if topology.world > 1 else "single"
    if strategy == "single" and topology.world > 1:
        raise ConfigError(f"distributed.strategy = 'single' but {topology.world} processes were launched; "
                          f"use {setting('distributed.strategy', 'ddp')} or fsdp, or launch one process")
    if strategy != "single" and not topology.launched:
        raise ConfigError(f"distributed.strategy = {strategy!r} needs processes started by torchrun, e.g. "
                          f"`torchrun --nproc-per-node 2 -m turbotrain train ...`; in one plain process use "
                          f"{setting('distributed.strategy', 'single')}")
    return strategy


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
        where = {"init_method": f"tcp://{host}:{topology.master_port}", "rank": topology.rank, "world_size": topology.world}
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        where = _restart_safe_store(topology, cfg.timeout_s)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s), **where,
                            **({"device_id": device} if device.type == "cuda" else {}))


def _restart_safe_store(topology: Topology, timeout_s: float) -> dict[str, Any]:
    """torchrun's store for this worker group, under a prefix of its own. torchrun's agent keeps
    one store for all the groups it starts (``--max-restarts``, elastic membership changes), so
    without a prefix a restarted rank can read the address a rank of the group before left there
    and connect to a process that is gone (gloo: "Connection refused", or a hang). A new group has
    a new restart count (after a failure) or a new world size (a node joined)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), topology.world, is_master=False,
                          timeout=timeout)
    group = f"turbotrain/group/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{topology.world}/"
    return {"store": dist.PrefixStore(group, store), "rank": topology.rank, "world_size": topology.world}


def build_strategy(cfg: DistributedConfig, device: torch.device, topology: Topology | None = None) -> Strategy:
    """Resolve ``distributed.strategy`` for this process (see :func:`resolve_strategy`) and join
    the process group it needs."""
    topology = topology or Topology.from_env()
    strategy = resolve_strategy(cfg, topology)
    if strategy == "single":
        return Strategy(topology)
    join_process_group(cfg, device, topology)
    return DDP(topology, cfg, device) if strategy == "ddp" else FSDP(topology, cfg)


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
        log.warning("the launcher of this rank (process %d, torchrun) is gone: stopping after this step with a "
                    "checkpoint, as for SIGTERM", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="turbotrain-launcher-watch", daemon=True).start()


def local_device(device: torch.device, topology: Topology) -> torch.device:
    """Under a launcher, CUDA means this process's own GPU (``cuda:LOCAL_RANK``), made current;
    in a plain process a bare ``cuda`` means the current GPU, given its index (torch's
    ``set_device`` and device comparisons need one)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", topology.local_rank if topology.launched else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


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


def shutdown() -> None:
    """Leave the process group (at the end of a run; a no-op without one)."""
    if in_group():
        dist.destroy_process_group()


class ReportedByAnotherRank(TurbotrainError):
    """Another rank found the error and reports it itself (one line); this rank ends quietly, so
    the user reads the failure once, from the rank that found it."""


class ReportedByMainRank(ReportedByAnotherRank):
    """Rank 0 failed at a start-up step every rank shares (a config, the run directory, the data)
    and reports it itself; the other ranks end quietly with this, so the user reads one line."""


# When one rank reports an error in one line and exits, the others learn of it only as a failed
# collective (or torchrun's SIGTERM), which looks like a lost rank. The reporting rank first leaves
# word in the launcher's key-value store (torchrun's agent hosts it: it outlives the rank), and a
# rank whose collective failed reads it there before saying that a rank was lost.


def _failure_key() -> str:
    return f"turbotrain/reported/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store() -> Any:
    """The default process group's store, or None (no group, or a torch without it)."""
    if not in_group():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - the store is a courtesy: without it ranks say a peer was lost
        return None


def announce_reported(message: str) -> None:
    """This rank is about to report ``message`` as the run's error (one line) and exit: leave word
    for the other ranks (see :func:`reported_elsewhere`). Nothing without a process group of more
    than one rank; a store that cannot be reached is ignored."""
    store = _store() if _grouped() else None
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(_failure_key(), f"rank {dist.get_rank()}: {message}"[:500])


def reported_elsewhere() -> str | None:
    """What another rank reported before it exited (``rank R: message``), or None: call it when a
    collective failed, to tell a rank that stopped with its own one-line error from one that was
    lost. Does not wait: the word is left before the reporting rank exits, which is what fails
    the collective."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_failure_key()]):
            return None
        said = store.get(_failure_key()).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the store went with the launcher: nothing to read
        return None
    return None if said.startswith(f"rank {dist.get_rank()}:") else said


def _grouped() -> bool:
    return rank_world()[1] > 1


def decided_by_main(fn: Callable[[], T]) -> T:
    """Rank 0 runs ``fn`` (e.g. creates the run directory) and every rank gets its result; when
    it fails, rank 0 raises its error and the others :class:`ReportedByMainRank`. Without a
    process group: ``fn()``. A pickled broadcast: start-up only, never in the hot loop."""
    return _on_main(fn, share=True)


def main_first(fn: Callable[[], T]) -> T:
    """``fn`` on rank 0 first, then on the others (e.g. tokenizing into a shared cache once);
    when it fails on rank 0 the others raise :class:`ReportedByMainRank` instead of running it."""
    value = _on_main(fn, share=False)
    return fn() if _grouped() and dist.get_rank() != 0 else value


def _on_main(fn: Callable[[], T], share: bool) -> T:
    if not _grouped():
        return fn()
    box: list[Any] = [None]
    value: Any = None
    if dist.get_rank() == 0:
        try:
            value = fn()
        except BaseException as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(box, src=0)
            raise
        box[0] = ("ok", value if share else None)
    dist.broadcast_object_list(box, src=0)
    kind, shared = box[0]
    if kind == "error":
        raise ReportedByMainRank(f"rank 0 failed at start-up ({shared})")
    return value if dist.get_rank() == 0 else shared


def broadcast_from_main(obj: Any) -> Any:
    """``obj`` as rank 0 has it, on every rank (a pickled broadcast: for start-up facts such as
    the run directory's name, never in the hot loop); itself without a process group."""
    if not _grouped():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_main_process() -> bool:
    """Rank 0 of the current group, or the only process: whoever writes shared files."""
    return rank_world()[0] == 0
