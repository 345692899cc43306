"""The parallel plan: how a run spreads over its processes, resolved once per process from
``distributed.*`` and the launch, checked before any process group exists (every rank finds the
same mistake before joining). Its dimensions, ``data`` and ``expert``, are one torch ``DeviceMesh``
(as torchtitan's ``ParallelDims``); a pipeline or tensor degree would be one more mesh dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.config import DIST_STRATEGIES, DistributedConfig, choice_error, setting
from ..base.errors import ConfigError
from ..base.launch import Topology
from ..parts.models.moe.parallel import ExpertLayout, check_degree
from .process_group import join_process_group


@dataclass(frozen=True)
class ParallelPlan:
    """How a run spreads: :meth:`resolve` once per process, then :meth:`join` makes its groups."""

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
        """The plan for this launch (``auto``: ddp with 2+ processes); ``n_experts`` per MoE block (0:
        dense, None: not known yet) checks ``expert_parallel``."""
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
                # not built yet: FSDP2 would shard dense parameters over replica x expert flattened
                # (DeviceMesh._flatten, private in torch 2.13), as torchtitan's dp_shard_mod_ep
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

    def accumulation_for(self, micro: int, global_size: int, accumulation: int) -> int:
        """The accumulation that makes ``global_size`` (0: ``accumulation`` as is) samples per step:
        global = micro x accumulation x data; one line naming the fields when they do not fit."""
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

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh's dimensions, outermost first: ``data``, or ``replica`` x ``expert``."""
        if self.expert == 1:
            return (("data", self.world),)
        return (("replica", self.world // self.expert), ("expert", self.expert))

    def join(self, device: torch.device) -> None:
        """Join the launcher's process group and build the mesh; every rank calls it, in the same order."""
        join_process_group(self.settings, device, self.topology)
        if not self.topology.launched or "mesh" in self._groups:
            return
        # torch.distributed.device_mesh loads only under a launcher (a plain process never needs it)
        from torch.distributed.device_mesh import init_device_mesh

        names, sizes = zip(*self.mesh_dims)
        mesh = init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(names))
        self._groups["mesh"] = mesh
        if self.expert > 1:
            self._groups["expert"] = ExpertLayout(
                self.expert, self.world, self.rank, mesh.get_group("expert"), mesh.get_group("replica")
            )

    @property
    def mesh(self) -> Any:
        """The run's one ``DeviceMesh`` (made by :meth:`join`); None in a plain process."""
        return self._groups.get("mesh")

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
