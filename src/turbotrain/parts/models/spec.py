"""Model specs: what the run assembly needs to know about a model family, in one small interface.

``turbotrain train`` (and resume, report, memory) knows nothing of GPTs or classifiers: it asks the
run's :class:`ModelSpec` (chosen once from the config) to open the data, build
the model, say what its throughput counts, how its loss and metrics are computed and what the
report should record. :func:`turbotrain.parts.models.registry.spec_for` picks it. Families: the GPT (:mod:`turbotrain.parts.models.gpt.spec`), the mixture-of-experts
GPT (:mod:`turbotrain.parts.models.moe.spec`) and a user's workload ``FILE.py:FUNC``
(:mod:`turbotrain.parts.models.workload_spec`). docs/model_specs.md walks through adding one.

What every spec may leave to these defaults: the repeated blocks that FSDP, activation
checkpointing and ``compile.scope = 'blocks'`` act on are found by size (:func:`repeated_blocks`);
``parallelize`` declares them and leaves the rest of the parallel plan to the strategy (experts
placed, then DDP / FSDP2 over the data dimension); ``pipeline`` is declared, not built;
FLOPs per sample are counted once by torch's FLOP counter on the example batch (the monitor does
it); the model returns its loss; throughput counts samples.
"""

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
    """A setting of the family that makes a run slower than it need be, for ``profile``'s advice:
    the ``settings`` to change (``{section: {key: value}}``), why it is slow, what the change gives
    and the expected speed-up of the compute share."""

    settings: dict[str, dict[str, Any]]
    why: str
    gain: str
    speedup: float


class RunData(ABC):
    """A run's data, opened once (a token cache filled, a workload's loaders made); the loaders
    themselves are made after a resume knows where to start."""

    description: str = ""  # one line for the summary: what the data is
    positions: int = 2**62  # distinct training rows: the batch finder's upper bound for batch.micro
    # step s's rows depend only on (seed, s, the global batch): a resume may change the split
    split_invariant: bool = True
    facts: dict[str, Any] = {}  # more for summary.json's "resolved" (e.g. the token batching)

    @abstractmethod
    def loader(
        self, c: RunConfig, settings: LoaderSettings, start: int, rank: int, world: int
    ) -> Iterable[Any]:
        """This rank's micro-batches from its batch ``start``: ``c.batch.accumulation`` per
        optimizer step, the ranks' together that step's global batch."""

    @abstractmethod
    def val_batches(self, c: RunConfig, rank: int, world: int) -> list[Any]:
        """The fixed validation batches this rank evaluates (the same at every evaluation)."""

    @abstractmethod
    def example(self, c: RunConfig) -> Any:
        """One training micro-batch (FLOPs per sample, the batch search's probe)."""

    def steps_per_epoch(self, c: RunConfig, world: int) -> int:
        """Optimizer steps in one pass over the training rows at the run's global batch (``train.epochs``)."""
        return max(1, self.positions // (int(c.batch.micro) * c.batch.accumulation * world))

    def start_after(self, saved_batches: int, step: int, c: RunConfig, saved_world: int, world: int) -> int:
        """This rank's batch position after a resume at optimizer step ``step`` of a checkpoint
        whose ``saved_world`` ranks had each read ``saved_batches``."""
        return step * c.batch.accumulation

    def probe_batch(self, c: RunConfig, device: torch.device) -> Callable[[int], Any] | None:
        """``micro -> a batch of micro samples on device`` for the batch-size search; None: the
        search's own (random tokens of ``model.block_size``, for language models)."""
        return None

    def save(self, run_dir: Path) -> None:  # noqa: B027 (a no-op unless a family has data to save)
        """Files a later command needs (a tokenizer for ``sample``); rank 0 only."""

    def close(self) -> None:  # noqa: B027 (a no-op unless a family holds files open)
        """Close the files the data holds open (the run is over; a later read reopens them)."""


class ModelSpec(ABC):
    """One model family (see the module docstring)."""

    name: str = "model"
    unit: str = "samples"  # what throughput counts: 'tokens' for language models, 'samples' otherwise
    generates: bool = False  # `turbotrain sample` can ask it for text
    # the analytic memory estimate (turbotrain.tools.memory.estimate) describes it
    memory_estimate: bool = False

    @abstractmethod
    def open_data(self, c: RunConfig, run_dir: Path, *, show: bool) -> RunData:
        """The run's data (under torchrun rank 0 opens it first: it fills caches, the others
        read them); ``show``: live progress for anything slow."""

    @abstractmethod
    def build(self, c: RunConfig, data: RunData) -> nn.Module:
        """The model, in float32 on the host, in the caller's RNG state (seeded by the run)."""

    def build_model(self, c: RunConfig, vocab_size: int) -> nn.Module:
        """The model from the config alone, without its data (``sample``, ``memory``, the precision
        check and ``bench --inference`` build it so), with ``vocab_size`` where the config leaves
        the vocabulary to the data. Default: refused in one line (the family needs its data)."""
        raise ConfigError(
            f"model.arch = {c.model.arch!r} builds its model with its data, not from the config alone"
        )

    def seq_len(self, c: RunConfig) -> int | None:
        """Tokens per sample (a language model's sequence length); None: the samples are not token rows."""
        return None

    def vocab_size(self, c: RunConfig) -> int:
        """The vocabulary the config fixes; 0: the data decides (or the model has none)."""
        return 0

    def random_batch(
        self, c: RunConfig, vocab_size: int, device: torch.device, seed: int = 0
    ) -> Callable[[int], Any]:
        """``micro -> a batch of micro random samples`` of what the model trains on, on ``device``: what
        the memory tools, the batch search, the precision check and ``bench --inference`` measure
        with. Default: random (inputs, targets) tokens of :meth:`seq_len` (a family without one refuses)."""
        seq_len = self.seq_len(c)
        if seq_len is None:
            raise ConfigError(
                f"model.arch = {c.model.arch!r}: its samples are not token rows; measure it on its data"
            )
        return token_batches(vocab_size, seq_len, device, seed=seed)

    def speed_choices(self, cuda: bool) -> dict[str, tuple[str, ...]]:
        """The family's settings that change speed and not the math, with the values ``tune`` may
        try (``{"section.key": values}``); default none."""
        return {}

    def speed_hints(self, c: RunConfig) -> list[SpeedHint]:
        """The family's settings in ``c`` that make it slower than it need be (``profile``'s advice)."""
        return []

    def blocks(self, model: nn.Module) -> nn.ModuleList | None:
        """The repeated blocks FSDP, activation checkpointing and per-block compile act on (the run
        declares them: :func:`turbotrain.parts.models.blocks.declare_blocks`); default: found by size."""
        return repeated_blocks(model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """The family's own optimizer over ``model``; None: AdamW from the run's ``optim`` section
        (with its warmup and decay schedule)."""
        return None

    def loss_fn(self) -> LossFn | None:
        """How a batch's loss is computed; None: the model returns it (``model(*batch)``)."""
        return None

    def metrics_fn(self) -> MetricsFn | None:
        """Validation metrics besides the loss (e.g. accuracy), averaged over the validation batches."""
        return None

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        """What the summary records of this model: parameters, and family facts (attention, vocabulary)."""
        return {"params": sum(p.numel() for p in model.parameters())}

    def experts(self, c: RunConfig) -> int | None:
        """The experts of each mixture-of-experts block the config describes (what
        ``distributed.expert_parallel`` must divide): 0 for a dense model; None when not known
        before the model is built (its MoE layers are checked when their experts are placed)."""
        return None

    def weight_count(self, c: RunConfig) -> int:
        """A lower bound on the parameters the config describes, known before anything is built
        (0: unknown); a model whose weights alone exceed the host's memory is refused in one line."""
        return 0

    def parallelize(self, model: nn.Module, plan: Any) -> nn.Module:
        """This family's part in carrying out ``plan`` (a :class:`turbotrain.core.plan.ParallelPlan`:
        its degrees and, under a launcher, its ``mesh``) on ``model``, before ``engine.setup``'s
        strategy places the experts and wraps the data dimension (DDP, or FSDP2 with these blocks as
        its units). As torchtitan's ``parallelize_fn``, the place for what only the family knows:
        a tensor-parallel layout (``parallelize_module`` over a ``tensor`` mesh dimension, when the
        plan has one), its own FSDP units. Default: declare :meth:`blocks` (the units FSDP,
        activation checkpointing and per-block compile act on) and return ``model``."""
        declare_blocks(model, self.blocks(model))
        return model

    def pipeline(self, model: nn.Module, plan: Any, loss_fn: LossFn | None) -> tuple[Any, list[nn.Module]]:
        """Pipeline parallelism's hook, declared and not built (as torchtitan's ``pipelining_fn``):
        cut ``model`` into the stages of the plan's pipeline dimension and return the schedule that
        runs a window's micro-batches over them (``torch.distributed.pipelining``) with this
        rank's stage modules; that schedule would take the window body's place
        (:data:`turbotrain.core.window.WindowFn`). No plan has a pipeline dimension yet, so
        nothing calls it."""
        raise NotImplementedError(
            f"{self.name}: pipeline parallelism is not built (the parallel plan has no pipeline dimension yet)"
        )
