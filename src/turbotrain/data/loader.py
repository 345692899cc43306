"""Random-window batches from token ranges, through a DataLoader with tuned defaults.

Batch ``k`` of a stream is drawn from a generator seeded with (seed, k), so the stream can start
at any batch: resuming at batch ``k`` gives exactly the batches an uninterrupted run would see.

Data parallel: global micro-batch ``k`` is ``micro x world`` windows drawn from (seed, k), and rank
``r`` takes rows ``[r*micro, (r+1)*micro)``. The ranks together see exactly what one process with
micro-batch ``micro x world`` sees (2 processes x micro M == 1 process x micro 2M), and a resume at
batch ``k`` is exact on every rank, at any world size that keeps ``micro x world``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import TurbotrainError
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

    def __getitems__(self, offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.split.read_rows(self._reader.fd(), np.asarray(offsets, dtype=np.int64), self.seq_len + 1)
        window = torch.from_numpy(rows.astype(np.int64))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]


class RandomWindowSampler(Sampler[list[int]]):
    """An endless stream of batches of random window offsets, starting at batch ``start``; with
    ``world`` > 1, this ``rank``'s rows of each global batch of ``batch_size x world`` offsets."""

    def __init__(self, positions: int, batch_size: int, seed: int, start: int = 0, rank: int = 0, world: int = 1) -> None:
        self.positions, self.batch_size, self.seed, self.start = positions, batch_size, seed, start
        self.rank, self.world = rank, world

    def batch(self, k: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        offsets = torch.randint(self.positions, (self.batch_size * self.world,), generator=g)
        return offsets[self.rank * self.batch_size:(self.rank + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        k = self.start
        while True:
            yield self.batch(k)
            k += 1


def _identity(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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


def resolve_loader_settings(device: torch.device, num_workers: int, pin_memory: bool, prefetch_factor: int) -> LoaderSettings:
    workers = default_num_workers(device) if num_workers < 0 else num_workers
    return LoaderSettings(workers, pin_memory and device.type == "cuda", prefetch_factor)


def build_loader(dataset: TokenWindows, batch_size: int, seed: int, settings: LoaderSettings, start: int = 0,
                 rank: int = 0, world: int = 1) -> DataLoader:
    """An endless DataLoader of (x, y) batches starting at batch ``start`` of the seeded stream
    (this ``rank``'s share of each global batch when ``world`` > 1)."""
    if batch_size > dataset.positions:
        raise TurbotrainError(
            f"batch.micro = {batch_size} is larger than the {dataset.positions} distinct windows in the data; "
            "use a smaller --batch.micro or more data"
        )
    workers = settings.num_workers
    return DataLoader(
        dataset,
        batch_sampler=RandomWindowSampler(dataset.positions, batch_size, seed, start, rank, world),
        collate_fn=_identity,
        num_workers=workers,
        pin_memory=settings.pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=settings.prefetch_factor if workers > 0 else None,
        # Its own generator: each iter() draws a base seed from it, which from the global RNG
        # would shift dropout draws after a resume (exact resume restores the global RNG).
        generator=torch.Generator().manual_seed(seed),
    )


def fixed_batches(dataset: TokenWindows, batch_size: int, count: int, seed: int, rank: int = 0,
                  world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``count`` batches every time (validation), drawn once on the host; with ``world``
    > 1 this ``rank``'s rows of each (so the ranks' mean is one process's mean over all rows)."""
    if dataset.positions < 1:
        return []
    sampler = RandomWindowSampler(dataset.positions, min(batch_size, dataset.positions), seed, rank=rank, world=world)
    return [dataset.__getitems__(sampler.batch(k)) for k in range(count)]
