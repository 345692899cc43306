"""Your dataset in epochs, in an order that does not depend on how the global batch is split: a
DataLoader over a map-style dataset is re-batched as the token windows are (:mod:`.loader`), from
one order per epoch (drawn from ``(seed, epoch)`` when the loader shuffles); an epoch's last
partial global batch is dropped. A worker seeds torch's, Python's and numpy's generators from
``(seed, step, slot)`` before reading a micro-batch, so an augmentation draws the same numbers
whichever worker reads it and after a resume (a worker's own stream would restart).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from ...base.errors import TurbotrainError
from ...base.seeds import derive_seed, seed_all
from .loader import START, LoaderSettings, Position, StreamSampler, sampled_loader


class EpochSampler(StreamSampler):
    """This rank's micro-batches of dataset indices in epochs of ``steps_per_epoch`` optimizer steps."""

    def __init__(self, size: int, batch_size: int, seed: int, shuffle: bool, at: Position = START) -> None:
        super().__init__(batch_size, seed, at)
        self.size, self.shuffle = size, shuffle
        self.global_batch = batch_size * at.chunks
        if self.global_batch > size:
            raise TurbotrainError(
                f"the global batch (batch.micro x accumulation x world = {batch_size} x {at.accumulation} x {at.world} = "
                f"{self.global_batch}) is larger than the dataset's {size} samples; use a smaller --batch.micro"
            )
        self.steps_per_epoch = size // self.global_batch

    def order(self, epoch: int) -> torch.Tensor:
        """The dataset's indices in epoch ``epoch``'s order: a function of (seed, epoch) alone."""
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(
            self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        )

    def batch(self, k: int) -> list[int]:
        """This rank's micro-batch ``k`` (micro-step ``k % accumulation`` of optimizer step ``k // accumulation``)."""
        step, chunk = self.at.slot(k)
        epoch, i = divmod(step, self.steps_per_epoch)
        first = i * self.global_batch + chunk * self.batch_size
        return self.drawn(epoch, self.order)[first : first + self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        # a worker's generators for this micro-batch: from its global slot in the step (all
        # ranks' micro-batches of a step differ), never from the rank's own count alone
        for k in itertools.count(self.at.start):
            yield Indices(self.batch(k), derive_seed(self.seed, *self.at.slot(k)))


class Indices(list):
    """A micro-batch's dataset indices, with the seed a worker seeds its generators from."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed


class SeededReads(Dataset):
    """``dataset`` read a micro-batch at a time, a worker's generators seeded from the batch's seed."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        if isinstance(batch, Indices) and torch.utils.data.get_worker_info() is not None:
            seed_all(batch.seed)
        own = getattr(self.dataset, "__getitems__", None)
        return own(list(batch)) if own else [self.dataset[i] for i in batch]


def map_style(loader: Any) -> Dataset | None:
    """The map-style dataset behind ``loader`` (a torch DataLoader over a dataset with ``len``), or None."""
    if not isinstance(loader, DataLoader):
        return None
    dataset = loader.dataset
    try:
        len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return None if isinstance(dataset, torch.utils.data.IterableDataset) else dataset


def shuffles(loader: DataLoader) -> bool:
    """Whether ``loader`` draws a new order each epoch (a RandomSampler, ``shuffle=True``)."""
    return isinstance(loader.sampler, RandomSampler)


def epoch_loader(
    loader: Iterable[Any], batch_size: int, seed: int, settings: LoaderSettings, at: Position = START
) -> DataLoader:
    """``loader``'s dataset and collation batched by :class:`EpochSampler` at ``at``."""
    dataset = map_style(loader)
    assert isinstance(loader, DataLoader) and dataset is not None, (
        "epoch_loader needs a DataLoader over a map-style dataset"
    )
    sampler = EpochSampler(len(dataset), batch_size, seed, shuffles(loader), at)  # type: ignore[arg-type]
    return sampled_loader(
        SeededReads(dataset), sampler, seed, settings, loader.collate_fn, loader.worker_init_fn
    )
