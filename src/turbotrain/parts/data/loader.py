"""Random-window batches from token ranges, through a DataLoader with tuned defaults.

The data order does not depend on how the global batch is split. The rows of optimizer step ``s``
are ``G = micro x accumulation x world`` windows drawn from a generator seeded with (seed, s), cut
into ``accumulation x world`` chunks of ``micro`` rows: rank ``r`` trains on chunk ``j x world + r``
at micro-step ``j`` of the step. So any split with the same global batch (one process with micro 8,
one with micro 4 and accumulation 2, two processes with micro 4, ...) trains on the same rows,
grouped into the same optimizer steps, and with equal-sized rows the loss per step is the same to
fp32 rounding. A loader starts at any of this rank's batches ``k`` (micro-step ``k % accumulation``
of step ``k // accumulation``): resuming after step ``s`` starts at ``s x accumulation`` under any
split of the same global batch. With accumulation 1 this is the order of earlier versions (step
``s`` = global micro-batch ``s``, rank ``r`` its rows ``[r*micro, (r+1)*micro)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ...base.errors import TurbotrainError
from ..workload import rebuild_loader
from .sources import PreadFile, TokenSplit


class TokenWindows(Dataset):
    """Item ``i`` is (tokens[i : i+T], tokens[i+1 : i+T+1]) as int64; fetched a batch at a time,
    one ``pread`` per row (:meth:`TokenSplit.read_rows`): a file that shrinks mid-run is an error
    naming it, not a bus error."""

    def __init__(self, split: TokenSplit, seq_len: int) -> None:
        if len(split) < seq_len + 1:
            raise TurbotrainError(
                f"{split.path.name} holds {len(split)} tokens in this split, fewer than one sequence of "
                f"model.block_size + 1 = {seq_len + 1}; use more data or a smaller --model.block_size"
            )
        self.split, self.seq_len = split, seq_len
        self._reader = PreadFile(split.path)

    @property
    def positions(self) -> int:
        return len(self.split) - self.seq_len

    def __len__(self) -> int:
        return self.positions

    def close(self) -> None:
        """Close the token file (reopened by a later read)."""
        self._reader.close()

    def __getitems__(self, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.split.read_rows(self._reader.fd(), np.asarray(offsets, dtype=np.int64), self.seq_len + 1)
        window = torch.from_numpy(rows.astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]


class RandomWindowSampler(Sampler[list[int]]):
    """An endless stream of this rank's batches of random window offsets, from its batch ``start``:
    batch ``k`` is chunk ``(k % accumulation) x world + rank`` (of ``batch_size`` rows) of the
    ``batch_size x accumulation x world`` offsets of optimizer step ``k // accumulation``."""

    def __init__(
        self,
        positions: int,
        batch_size: int,
        seed: int,
        start: int = 0,
        rank: int = 0,
        world: int = 1,
        accumulation: int = 1,
    ) -> None:
        self.positions, self.batch_size, self.seed, self.start = positions, batch_size, seed, start
        self.rank, self.world, self.accumulation = rank, world, max(1, accumulation)
        # the last step's offsets: drawn once per step
        self._drawn: tuple[int, torch.Tensor | None] = (
            -1,
            None,
        )

    def step_offsets(self, step: int) -> torch.Tensor:
        """Every window offset of optimizer step ``step`` (the global batch): a function of (seed, step)."""
        drawn_step, offsets = self._drawn
        if drawn_step != step or offsets is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            offsets = torch.randint(
                self.positions, (self.batch_size * self.accumulation * self.world,), generator=g
            )
            self._drawn = (step, offsets)
        return offsets

    def batch(self, k: int) -> list[int]:
        step, j = divmod(k, self.accumulation)
        chunk = j * self.world + self.rank
        return self.step_offsets(step)[chunk * self.batch_size : (chunk + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        k = self.start
        while True:
            yield self.batch(k)
            k += 1


def _identity(batch: Any) -> Any:  # what __getitems__ returned (torch types it a list)
    return batch  # __getitems__ already returns a stacked batch


def default_num_workers(device: torch.device, cores: int | None = None) -> int:
    """Workers from the core count: on CUDA half the cores (max 8) keep the GPU fed; on CPU the
    training threads already use every core, so on small machines batches load in-process."""
    cores = cores or os.cpu_count() or 1
    if device.type == "cuda":
        return max(1, min(8, cores // 2))
    return 0 if cores <= 4 else 2


@dataclass(frozen=True)
class LoaderSettings:
    """Resolved DataLoader knobs (``num_workers`` already concrete)."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int


def resolve_loader_settings(
    device: torch.device, num_workers: int, pin_memory: bool, prefetch_factor: int
) -> LoaderSettings:
    workers = default_num_workers(device) if num_workers < 0 else num_workers
    return LoaderSettings(workers, pin_memory and device.type == "cuda", prefetch_factor)


def tune_loader(loader: DataLoader, settings: LoaderSettings) -> DataLoader:
    """A DataLoader like the user's ``loader`` (dataset, sampler or batch_sampler, collate_fn,
    drop_last) with ``settings``' workers (persistent), pinning and prefetch factor: what
    ``data.tune_user_loader`` does to a loader given to ``engine.setup``. An IterableDataset keeps
    its worker count (each worker would iterate the whole dataset unless it shards itself)."""
    iterable = isinstance(loader.dataset, IterableDataset)
    workers = loader.num_workers if iterable else settings.num_workers
    tuned = rebuild_loader(loader, num_workers=workers)
    # Read when an iterator starts; DataLoader lets both be set before the first one.
    tuned.pin_memory = settings.pin_memory
    tuned.prefetch_factor = settings.prefetch_factor if workers > 0 else None
    return tuned


def build_loader(
    dataset: TokenWindows,
    batch_size: int,
    seed: int,
    settings: LoaderSettings,
    start: int = 0,
    rank: int = 0,
    world: int = 1,
    accumulation: int = 1,
) -> DataLoader:
    """An endless DataLoader of (x, y) batches of ``batch_size`` rows, from this ``rank``'s batch
    ``start`` of the seeded stream: ``accumulation`` batches per optimizer step, the ranks' together
    that step's global batch (:class:`RandomWindowSampler`)."""
    if batch_size > dataset.positions:
        raise TurbotrainError(
            f"batch.micro = {batch_size} is larger than the {dataset.positions} distinct windows in the data; "
            "use a smaller --batch.micro or more data"
        )
    sampler = RandomWindowSampler(dataset.positions, batch_size, seed, start, rank, world, accumulation)
    return sampled_loader(dataset, sampler, seed, settings)


def sampled_loader(
    dataset: Dataset,
    sampler: Sampler[list[int]],
    seed: int,
    settings: LoaderSettings,
    collate_fn: Callable[[Any], Any] = _identity,
    worker_init_fn: Callable[[int], None] | None = None,
) -> DataLoader:
    """A DataLoader of ``sampler``'s batches of ``dataset`` with the run's worker and pinning settings."""
    workers = settings.num_workers
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        worker_init_fn=worker_init_fn,
        num_workers=workers,
        pin_memory=settings.pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=settings.prefetch_factor if workers > 0 else None,
        # Its own generator: each iter() draws a base seed from it, which from the global RNG
        # would shift dropout draws after a resume (exact resume restores the global RNG).
        generator=torch.Generator().manual_seed(seed),
    )


def fixed_batches(
    dataset: TokenWindows,
    batch_size: int,
    count: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    accumulation: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches every time (validation), drawn once on the host: ``count`` global batches
    of ``batch_size x accumulation x world`` windows, split as the training batches are, this
    ``rank``'s ``accumulation`` chunks of each. Equal-sized chunks: the mean over the ranks of each
    rank's mean is the mean over every row, the same for any split of the same global batch."""
    if dataset.positions < 1:
        return []
    sampler = RandomWindowSampler(
        dataset.positions,
        min(batch_size, dataset.positions),
        seed,
        rank=rank,
        world=world,
        accumulation=accumulation,
    )
    return [dataset.__getitems__(sampler.batch(k)) for k in range(count * sampler.accumulation)]


def token_batches(vocab_size: int, seq_len: int, device: torch.device, seed: int = 0) -> Callable[[int], Any]:
    """``make_batch`` for token models: random (inputs, targets) of shape (micro, seq_len)."""

    def make(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(vocab_size, (micro, seq_len + 1), generator=g)
        return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)

    return make
