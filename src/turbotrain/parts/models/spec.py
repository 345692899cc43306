"""Model specs: what the run assembly needs to know about a model family, in one small interface
(docs/model_specs.md: the interface, its defaults and how to add a family);
:func:`turbotrain.parts.models.registry.spec_for` picks the run's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ...base.config import RunConfig
from ...base.errors import ConfigError
from ..data.loader import LoaderSettings, token_batches
from .blocks import declare_blocks, repeated_blocks

LossFn = Callable[[nn.Module, Any], Any]  # (model, batch) -> the loss (or what holds it)
MetricsFn = Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]  # (model, batch) -> {name: 0-d tensor}


class TextGenerator(Protocol):
    """The model of a spec that ``generates`` (``turbotrain sample`` asks it for text)."""

    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = ..., top_k: int | None = ...
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class SpeedHint:
    """A setting that makes a run slower (``profile``'s advice): what to change, why, the gain, the speed-up."""

    settings: dict[str, dict[str, Any]]
    why: str
    gain: str
    speedup: float


class RunData(ABC):
    """A run's data, opened once; its loaders are made after a resume knows where to start."""

    description: str = ""  # one line for the summary: what the data is
    positions: int = 2**62  # distinct training rows: the batch finder's upper bound for batch.micro
    # step s's rows depend only on (seed, s, the global batch): a resume may change the split
    split_invariant: bool = True
    facts: dict[str, Any] = {}  # more for summary.json's "resolved" (e.g. the token batching)

    @abstractmethod
    def loader(
        self, c: RunConfig, settings: LoaderSettings, start: int, rank: int, world: int
    ) -> Iterable[Any]:
        """This rank's micro-batches from its batch ``start``."""

    @abstractmethod
    def val_batches(self, c: RunConfig, rank: int, world: int) -> list[Any]:
        """The fixed validation batches this rank evaluates."""

    @abstractmethod
    def example(self, c: RunConfig) -> Any:
        """One training micro-batch (FLOPs per sample, the batch search's probe)."""

    def steps_per_epoch(self, c: RunConfig, world: int) -> int:
        """Optimizer steps in one pass over the training rows (``train.epochs``)."""
        return max(1, self.positions // (int(c.batch.micro) * c.batch.accumulation * world))

    def start_after(self, saved_batches: int, step: int, c: RunConfig, saved_world: int, world: int) -> int:
        """This rank's batch position after a resume at optimizer step ``step``."""
        return step * c.batch.accumulation

    def probe_batch(self, c: RunConfig, device: torch.device) -> Callable[[int], Any] | None:
        """``micro -> batch`` on ``device`` for the batch-size search; None: the spec's random batch."""
        return None

    def save(self, run_dir: Path) -> None:  # noqa: B027 (a no-op unless a family has data to save)
        """Files a later command needs; rank 0 only."""

    def close(self) -> None:  # noqa: B027 (a no-op unless a family holds files open)
        """Close the files the data holds open (a later read reopens them)."""


class ModelSpec(ABC):
    """One model family."""

    name: str = "model"
    unit: str = "samples"  # what throughput counts: 'tokens' for language models, 'samples' otherwise
    generates: bool = False  # `turbotrain sample` can ask it for text
    memory_estimate: bool = False  # the analytic memory estimate (tools.memory.stats) describes it

    @abstractmethod
    def open_data(self, c: RunConfig, run_dir: Path, *, show: bool) -> RunData:
        """The run's data (rank 0 opens it first); ``show``: live progress for anything slow."""

    @abstractmethod
    def build(self, c: RunConfig, data: RunData) -> nn.Module:
        """The model, in float32 on the host, in the caller's RNG state (seeded by the run)."""

    def build_model(self, c: RunConfig, vocab_size: int) -> nn.Module:
        """The model from the config alone; ``vocab_size`` where the config leaves it to the data."""
        raise ConfigError(
            f"model.arch = {c.model.arch!r} builds its model with its data, not from the config alone"
        )

    def seq_len(self, c: RunConfig) -> int | None:
        """Tokens per sample; None: the samples are not token rows."""
        return None

    def vocab_size(self, c: RunConfig) -> int:
        """The vocabulary the config fixes; 0: the data decides (or the model has none)."""
        return 0

    def random_batch(
        self, c: RunConfig, vocab_size: int, device: torch.device, seed: int = 0
    ) -> Callable[[int], Any]:
        """``micro -> a batch of micro random samples`` on ``device``, what the measuring tools use."""
        seq_len = self.seq_len(c)
        if seq_len is None:
            raise ConfigError(
                f"model.arch = {c.model.arch!r}: its samples are not token rows; measure it on its data"
            )
        return token_batches(vocab_size, seq_len, device, seed=seed)

    def speed_choices(self, cuda: bool) -> dict[str, tuple[str, ...]]:
        """The settings that change speed and not the math, with the values ``tune`` may try."""
        return {}

    def speed_hints(self, c: RunConfig) -> list[SpeedHint]:
        """The settings in ``c`` that make it slower than it need be."""
        return []

    def blocks(self, model: nn.Module) -> nn.ModuleList | None:
        """The repeated blocks FSDP, activation checkpointing and per-block compile act on."""
        return repeated_blocks(model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """The family's own optimizer; None: AdamW from the run's ``optim`` section."""
        return None

    def loss_fn(self) -> LossFn | None:
        """How a batch's loss is computed; None: the model returns it (``model(*batch)``)."""
        return None

    def metrics_fn(self) -> MetricsFn | None:
        """Validation metrics besides the loss (e.g. accuracy)."""
        return None

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        """What the summary records of this model."""
        return {"params": sum(p.numel() for p in model.parameters())}

    def experts(self, c: RunConfig) -> int | None:
        """The experts per MoE block (0: dense; None: not known before the model is built)."""
        return None

    def weight_count(self, c: RunConfig) -> int:
        """A lower bound on the parameters before anything is built (0: unknown)."""
        return 0

    def parallelize(self, model: nn.Module, plan: Any) -> nn.Module:
        """This family's part in carrying out ``plan`` (a :class:`turbotrain.core.plan.ParallelPlan`)
        on ``model`` before ``engine.setup``'s strategy places the experts and wraps the data
        dimension; as torchtitan's ``parallelize_fn``, the place for a tensor-parallel layout or
        the family's own FSDP units. Default: declare :meth:`blocks`."""
        declare_blocks(model, self.blocks(model))
        return model

    def pipeline(self, model: nn.Module, plan: Any, loss_fn: LossFn | None) -> tuple[Any, list[nn.Module]]:
        """Pipeline parallelism's hook, declared and not built (torchtitan's ``pipelining_fn``): the
        schedule running a window's micro-batches over this rank's stages, in the window body's
        place (:data:`turbotrain.core.window.WindowFn`). No plan has a pipeline dimension yet."""
        raise NotImplementedError(
            f"{self.name}: pipeline parallelism is not built (the parallel plan has no pipeline dimension yet)"
        )
