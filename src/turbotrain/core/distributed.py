"""Parallelism on torch.distributed: one plan per process, carried out by one strategy the Engine calls.

``torchrun`` (or SLURM's ``srun``) starts the processes (:mod:`turbotrain.base.launch` reads where each
sits); :class:`ParallelPlan` is resolved once per process from ``distributed.*`` and that launch,
checked before any process group exists, and owns the process groups (the default one: NCCL on
CUDA, one device per ``LOCAL_RANK``; gloo on CPU; and the expert-parallel and replica groups). Its
dimensions: ``data`` (every rank trains on its own share of the global batch) and ``expert`` (the
experts of each MoE block spread over groups of ranks, :mod:`turbotrain.parts.models.moe.parallel`);
tensor, pipeline or context degrees would be further dimensions of the same plan.

The strategy carries the plan out: :meth:`Strategy.wrap` places the experts on their ranks (degree
> 1), leaves them out of data parallelism, and wraps the rest of the model for its data dimension:

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

import atexit
import contextlib
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# torch.distributed.fsdp and .tensor (DTensor) cost ~0.5 s to import: only an fsdp run imports
# them (FSDP.wrap), so ``import turbotrain`` and a one-process run stay light.
from ..base.config import DIST_STRATEGIES, DistributedConfig, choice_error, setting
from ..base.errors import ConfigError, TurbotrainError
from ..base.launch import Topology
from ..parts.models.blocks import repeated_blocks
from ..parts.models.moe.parallel import ExpertLayout, GradNormFn, check_degree, place_experts

T = TypeVar("T")
M = TypeVar("M")  # a micro-batch, as the window hands it over
R = TypeVar("R")  # what one micro-step returns
log = logging.getLogger(__name__)


def is_loaded_instance(obj: Any, module: str, cls: str) -> bool:
    """``isinstance(obj, module.cls)`` without importing ``module`` (a costly one, imported on first
    use): while ``module`` was never imported, no object of its classes can exist."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(obj, getattr(loaded, cls))


@dataclass(frozen=True)
class ParallelPlan:
    """How a run spreads over its processes: resolved once per process (:meth:`resolve`) from
    ``distributed.*`` and the launch, without any communication, so every rank finds the same
    mistake before joining; then :meth:`join` makes the process groups, which the plan owns.

    - ``data`` degree: every rank trains on its own share of the global batch (the world size);
      the dense parameters are replicated (``strategy = ddp``) or sharded (``fsdp``) over it.
    - ``expert`` degree: each MoE block's experts spread over groups of ``expert`` consecutive
      ranks; the ``world / expert`` ranks holding the same experts form a replica group.

    A tensor, pipeline or context degree would be one more field here, with its groups made in
    :meth:`join` and used by the strategy's ``wrap``.
    """

    topology: Topology
    strategy: str = "single"  # single | ddp | fsdp: how the dense parameters are kept over the data dimension
    expert: int = 1
    settings: DistributedConfig = DistributedConfig()
    # made by join(), owned here
    _groups: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(
        cls, cfg: DistributedConfig, topology: Topology | None = None, n_experts: int | None = None
    ) -> ParallelPlan:
        """The plan for this launch: ``distributed.strategy`` (``auto``: ddp under a launcher with
        more than one process, else single) and ``distributed.expert_parallel`` checked against the
        world size and ``n_experts`` (the model's experts per MoE block, its spec says: 0 for a
        dense model; None when not known yet, then the MoE layers are checked when their experts
        are placed)."""
        topology = topology or Topology.from_env()
        strategy = cfg.strategy
        if strategy not in ("auto", *DIST_STRATEGIES):
            raise choice_error("distributed.strategy", strategy, ("auto", *DIST_STRATEGIES))
        if strategy == "auto":
            strategy = "ddp" if topology.world > 1 else "single"
        if strategy == "single" and topology.world > 1:
            raise ConfigError(
                f"distributed.strategy = 'single' but {topology.world} processes were launched; "
                f"use {setting('distributed.strategy', 'ddp')} or fsdp, or launch one process"
            )
        if strategy != "single" and not topology.launched:
            raise ConfigError(
                f"distributed.strategy = {strategy!r} needs processes started by torchrun, e.g. "
                f"`torchrun --nproc-per-node 2 -m turbotrain train ...`; in one plain process use "
                f"{setting('distributed.strategy', 'single')}"
            )
        degree = cfg.expert_parallel
        if degree > 1:  # (one plain process: the degree cannot divide its world of 1)
            if n_experts == 0:
                raise ConfigError(
                    f"distributed.expert_parallel = {degree} needs a mixture-of-experts model: "
                    f"{setting('model.arch', 'moe')} (or --preset moe-tiny), or a --model with turbotrain.MoE layers"
                )
            check_degree(degree, topology.world, n_experts)
            if strategy == "fsdp":
                raise ConfigError(
                    f"distributed.expert_parallel = {degree} runs with DDP for the non-expert parameters; "
                    f"use {setting('distributed.strategy', 'ddp')}"
                )
        return cls(topology, strategy, degree, cfg)

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world(self) -> int:
        return self.topology.world

    @property
    def data(self) -> int:
        """The data-parallel degree: ranks that each train on their own share of the global batch."""
        return self.topology.world

    @property
    def sharded(self) -> bool:
        """Whether the dense parameters are sharded over the data dimension (FSDP2)."""
        return self.strategy == "fsdp"

    def split_batch(self, micro: int, global_size: int, accumulation: int) -> int:
        """The accumulation that makes ``global_size`` samples per optimizer step out of ``micro``
        per rank and backward pass over the data dimension (global = micro x accumulation x data);
        ``accumulation`` itself when no global size is asked for (0). One line naming the fields
        when they do not fit together."""
        if global_size <= 0:
            return accumulation
        per_step = micro * self.data
        if global_size % per_step:
            lower = max(per_step, global_size // per_step * per_step)
            raise ConfigError(
                f"batch.global_size = {global_size} does not divide by batch.micro x world = {micro} x {self.data}"
                f" = {per_step}; use {setting('batch.global_size', lower)} (a multiple of {per_step}) or another batch.micro"
            )
        split = global_size // per_step
        if accumulation not in (1, split):
            raise ConfigError(
                f"batch.accumulation = {accumulation} contradicts batch.global_size = {global_size} = batch.micro x "
                f"accumulation x world = {micro} x {split} x {self.data}; set one of them"
            )
        return split

    def join(self, device: torch.device) -> None:
        """Join the launcher's process group (a no-op in a plain process, or when joined already;
        one torchrun process joins a group of one) and make this plan's groups: the
        expert-parallel and replica groups when ``expert`` > 1. Every rank calls it, in the same
        order (group creation is a collective)."""
        join_process_group(self.settings, device, self.topology)
        if self.expert > 1 and "expert" not in self._groups:
            degree, world, rank = self.expert, self.world, self.rank
            ep_groups = [
                dist.new_group(list(range(g * degree, (g + 1) * degree))) for g in range(world // degree)
            ]
            replica_groups = [dist.new_group(list(range(i, world, degree))) for i in range(degree)]
            self._groups["expert"] = ExpertLayout(
                degree, world, rank, ep_groups[rank // degree], replica_groups[rank % degree]
            )

    @property
    def experts(self) -> ExpertLayout | None:
        """This rank's expert-parallel and replica groups (made by :meth:`join`); None for degree 1."""
        if self.expert == 1:
            return None
        if "expert" not in self._groups:
            raise RuntimeError(
                "ParallelPlan.join(device) makes the expert groups: call it before placing experts"
            )
        return self._groups["expert"]


class Strategy:
    """Carries a :class:`ParallelPlan` out: places the experts (its expert dimension), then wraps
    the model for its data dimension and does every reduction across ranks. This base class is
    one process with no communication (the "off" form every other strategy overrides)."""

    name = "single"

    def __init__(self, plan: ParallelPlan | None = None) -> None:
        self.plan = plan or ParallelPlan(Topology())
        self.topology = self.plan.topology
        self.rank, self.world = self.topology.rank, self.topology.world
        # the global gradient norm when experts are spread (set by wrap)
        self.grad_norm: GradNormFn | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs and writes files shared by the run."""
        return self.rank == 0

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None = torch.float32,
    ) -> nn.Module:
        """The model to train: each MoE block's experts placed on their ranks (the plan's expert
        dimension; the optimizer is pointed at this rank's slices and its checkpoints hold every
        expert), then the rest wrapped for the data dimension. ``param_dtype`` and
        ``reduce_dtype`` are the precision's (its ``compute_dtype`` and ``reduce_dtype``): what
        FSDP2 all-gathers parameters in for compute and reduces gradients in."""
        placed = place_experts(model, optimizer, self.plan.experts)
        self.grad_norm = placed.grad_norm
        return self.wrap_data(model, optimizer, param_dtype, reduce_dtype, placed.params)

    def wrap_data(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        experts: list[nn.Parameter],
    ) -> nn.Module:
        """The data dimension: ``model`` wrapped so that its parameters other than ``experts``
        (this rank's expert slices, reduced over their replica group) are averaged over ranks."""
        return model

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        """Whether the coming backward reduces gradients across ranks (only at accumulation boundaries)."""

    def run_window(
        self, models: Sequence[nn.Module], micro_batches: Sequence[M], micro_step: Callable[[M], R]
    ) -> list[R]:
        """The micro-batches of one optimizer step (:mod:`turbotrain.core.window`): single, DDP
        and FSDP2 run them in order, gradients reduced across ranks only in the last one's
        backward (the flag is set before each forward, where DDP reads it). A pipeline strategy
        would run its schedule over the stages here instead. Returns ``micro_step``'s results."""
        last = len(micro_batches) - 1
        results = []
        for i, micro_batch in enumerate(micro_batches):
            for model in models:
                self.set_grad_sync(model, i == last)
            results.append(micro_step(micro_batch))
        return results

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
        return (
            tensor.full_tensor()
            if is_loaded_instance(tensor, "torch.distributed.tensor", "DTensor")
            else tensor
        )

    def any_rank(self, flag: bool, device: torch.device | None = None) -> bool:
        t = torch.tensor(int(flag), device=device or collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())  # sync: the agreed answer is needed on the host


class DDP(DataParallel):
    name = "ddp"

    def __init__(self, plan: ParallelPlan, device: torch.device) -> None:
        super().__init__(plan)
        self.device = device

    def wrap_data(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        experts: list[nn.Parameter],
    ) -> nn.Module:
        if experts:
            # DDP has no public way to leave parameters out; this static method is the one its own
            # tests and torchrec use. (FSDP2's fully_shard takes ``ignored_params`` publicly.)
            names = [name for name, p in model.named_parameters() if any(p is e for e in experts)]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
        cfg = self.plan.settings
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=cfg.bucket_cap_mb,
            static_graph=cfg.static_graph,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        )

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        model.require_backward_grad_sync = sync  # the flag DDP's no_sync() context sets


class FSDP(DataParallel):
    name = "fsdp"

    def wrap_data(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        experts: list[nn.Parameter],
    ) -> nn.Module:
        # on first use: see the note at the imports
        from torch.distributed.fsdp import (
            MixedPrecisionPolicy,
            fully_shard,
        )

        names = {id(p): name for name, p in model.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        reshard = self.plan.settings.reshard_after_forward
        for block in repeated_blocks(model) or ():
            fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
        if optimizer is not None:
            if optimizer.state:
                raise ConfigError(
                    "distributed.strategy = 'fsdp' shards the parameters: call engine.setup(model, optimizer) "
                    "before the optimizer's first step"
                )
            sharded = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        return model

    def set_grad_sync(self, model: nn.Module, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]


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
    dist.init_process_group(
        backend,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        **where,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
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


def build_strategy(plan: ParallelPlan, device: torch.device) -> Strategy:
    """The strategy that carries ``plan`` out on ``device``, after joining its process groups."""
    plan.join(device)
    if plan.strategy == "single":
        return Strategy(plan)
    return DDP(plan, device) if plan.strategy == "ddp" else FSDP(plan)


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


def local_device(device: torch.device, topology: Topology) -> torch.device:
    """Under a launcher, CUDA means this process's own GPU (``cuda:LOCAL_RANK``), made current;
    in a plain process a bare ``cuda`` means the current GPU, given its index (torch's
    ``set_device`` and device comparisons need one)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device(
            "cuda", topology.local_rank if topology.launched else torch.cuda.current_device()
        )
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
