"""A user's workload (``--model FILE.py:FUNC``) as a model spec: its model, its loaders re-batched
in a split-invariant epoch order (:mod:`turbotrain.parts.data.epochs`), its loss, optimizer and
metrics. ``batch.micro`` is the loader's ``batch_size`` unless the run sets it. A loader that is not
a DataLoader over a map-style dataset is used as it is: one process only, and a resume skips the
batches already trained on (exact when the iterable yields the same batches each time)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...base.batch import batch_size, move_to
from ...base.config import RunConfig
from ...base.errors import ConfigError, TurbotrainError
from ..data.epochs import epoch_loader, map_style
from ..data.loader import LoaderSettings, Position
from ..workload import Workload, as_workload, load_workload
from .spec import LossFn, MetricsFn, ModelSpec, RunData


class WorkloadData(RunData):
    """The workload's train and eval loaders."""

    def __init__(self, w: Workload) -> None:
        self.workload = w
        self.dataset = map_style(w.train_loader)
        self.split_invariant = self.dataset is not None
        self.positions = len(self.dataset) if self.dataset is not None else 2**62  # type: ignore[arg-type]
        self.description = w.describe()
        self.facts = {}

    def loader(
        self, c: RunConfig, settings: LoaderSettings, start: int, rank: int, world: int
    ) -> Iterable[Any]:
        if self.dataset is not None:
            at = Position(start, rank, world, c.batch.accumulation)
            return epoch_loader(self.workload.train_loader, int(c.batch.micro), c.run.seed, settings, at)
        if world > 1:
            raise TurbotrainError(
                f"--model {self.workload.source}: its train_loader is not a torch DataLoader over a dataset "
                "with a length, so it cannot be split over processes; give a DataLoader, or train in one process"
            )
        # the loader iterated again and again (epochs), from batch ``start`` of the stream
        stream = itertools.chain.from_iterable(iter(lambda: self.workload.train_loader, None))
        return itertools.islice(stream, start, None)

    def steps_per_epoch(self, c: RunConfig, world: int) -> int:
        if self.dataset is None:  # an iterable of batches: one pass is its length in micro-batches
            try:
                return max(1, len(self.workload.train_loader) // (c.batch.accumulation * world))  # type: ignore[arg-type]
            except TypeError:
                raise TurbotrainError(
                    f"train.epochs needs to know how long an epoch is, and --model {self.workload.source}'s "
                    "train_loader has no length; use train.max_steps"
                ) from None
        return super().steps_per_epoch(c, world)

    def val_batches(self, c: RunConfig, rank: int, world: int) -> list[Any]:
        """The eval loader's first ``train.eval_batches x world`` batches, every ``world``-th for this rank."""
        if self.workload.eval_loader is None:
            return []
        # iterating a DataLoader draws its seed from the global RNG: keep it for the run
        with torch.random.fork_rng(devices=[]):
            first = list(itertools.islice(self.workload.eval_loader, c.train.eval_batches * world))
        return first[rank::world][: len(first) // world]  # the same count on every rank

    def probe_batch(self, c: RunConfig, device: torch.device) -> Callable[[int], Any] | None:
        if self.dataset is None:
            return None
        loader: Any = self.workload.train_loader

        def batch(micro: int) -> Any:  # the dataset's first micro samples, collated as the loader does
            rows = [self.dataset[i] for i in range(min(micro, self.positions))]  # type: ignore[index]
            return move_to(loader.collate_fn(rows), device)

        return batch

    def example(self, c: RunConfig) -> Any:
        if self.dataset is None:
            with torch.random.fork_rng(devices=[]):  # the global RNG stays the run's (exact resume)
                return next(iter(self.workload.train_loader))
        in_process = LoaderSettings(num_workers=0, pin_memory=False, prefetch_factor=2)
        return next(
            iter(epoch_loader(self.workload.train_loader, int(c.batch.micro), c.run.seed, in_process))
        )


class WorkloadSpec(ModelSpec):
    """A workload ``ref`` built once per run; ``make``: FUNC or its Workload, from a Python caller."""

    name = "workload"

    def __init__(self, ref: str, make: Callable[[], Any] | Workload | None = None) -> None:
        self.ref, self._make = ref, make
        self._workload: Workload | None = make if isinstance(make, Workload) else None

    def build_model(self, c: RunConfig, vocab_size: int) -> nn.Module:
        raise ConfigError(f"{self.ref} is your own model: its FUNC builds it with its data, not the config")

    def workload(self, seed: int) -> Workload:
        """The workload, built once (FUNC is called after ``torch.manual_seed(seed)``)."""
        if self._workload is None and self._make is not None:
            torch.manual_seed(seed)
            self._workload = as_workload(self._make(), f"{self.ref}()")  # type: ignore[operator]
            self._workload.source = self._workload.source or self.ref
        if self._workload is None:
            self._workload = load_workload(self.ref, seed=seed)
        return self._workload

    def open_data(self, c: RunConfig, run_dir: Path, *, show: bool) -> WorkloadData:
        return WorkloadData(self.workload(c.run.seed))

    def build(self, c: RunConfig, data: RunData) -> nn.Module:
        return self.workload(c.run.seed).model

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        return self._workload.optimizer if self._workload is not None else None

    def loss_fn(self) -> LossFn | None:
        return self._workload.loss_fn if self._workload is not None else None

    def metrics_fn(self) -> MetricsFn | None:
        return self._workload.metrics_fn if self._workload is not None else None

    def micro_batch(self, seed: int) -> int | None:
        """The train loader's batch size (the run's ``batch.micro`` unless the run sets one)."""
        loader = self.workload(seed).train_loader
        size = getattr(loader, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
        first = next(iter(loader), None)
        return batch_size(first) or None if first is not None else None

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        return {**super().facts(c, model), "model": type(model).__name__, "workload": self.ref}
