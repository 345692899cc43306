"""Random-window batches from token ranges, through a DataLoader with tuned defaults.

The data order does not depend on how the global batch is split: the rows of optimizer step ``s``
are ``G = micro x accumulation x world`` windows drawn from (seed, s), cut into ``accumulation x
world`` chunks of ``micro`` rows; rank ``r`` trains on chunk ``j x world + r`` at micro-step ``j``.
Any split of the same global batch trains on the same rows in the same steps, and a resume after
step ``s`` starts at this rank's batch ``s x accumulation``.
"""

from __future__ import annotations

import itertools
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


class PreadRows(Dataset):
    """(inputs, targets) rows of a token file read with ``pread``, a batch at a time (``__getitems__``)."""

    _reader: PreadFile

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def close(self) -> None:
        """Close the token file (reopened by a later read)."""
        self._reader.close()


class TokenWindows(PreadRows):
    """Item ``i`` is (tokens[i : i+T], tokens[i+1 : i+T+1]) as int64, one ``pread`` per row."""

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


@dataclass(frozen=True)
class Position:
    """Where this rank reads a seeded batch stream: from its batch ``start``, as rank ``rank`` of
    ``world``, ``accumulation`` batches per optimizer step (a resume sets ``start``)."""

    start: int = 0
    rank: int = 0
    world: int = 1
    accumulation: int = 1

    @property
    def chunks(self) -> int:
        """Batches of all ranks in one optimizer step."""
        return self.accumulation * self.world

    def slot(self, k: int) -> tuple[int, int]:
        """(optimizer step, chunk of that step's global batch) of this rank's batch ``k``."""
        step, j = divmod(k, self.accumulation)
        return step, j * self.world + self.rank


START = Position()  # one process, from the stream's first batch


class StreamSampler(Sampler[list[int]]):
    """An endless stream of this rank's batches from ``at.start``; ``batch(k)`` depends on (seed, k)."""

    def __init__(self, batch_size: int, seed: int, at: Position) -> None:
        self.batch_size, self.seed, self.at = batch_size, seed, at
        self._drawn: tuple[int, Any] = (-1, None)

    def drawn(self, key: int, draw: Callable[[int], Any]) -> Any:
        """``draw(key)``, kept until another key is asked for (a step's or an epoch's draw)."""
        if self._drawn[0] != key:
            self._drawn = (key, draw(key))
        return self._drawn[1]

    def batch(self, k: int) -> list[int]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        return map(self.batch, itertools.count(self.at.start))


class RandomWindowSampler(StreamSampler):
    """Random window offsets: batch ``k`` is chunk ``(k % accumulation) x world + rank`` of its step's."""

    def __init__(self, positions: int, batch_size: int, seed: int, at: Position = START) -> None:
        super().__init__(batch_size, seed, at)
        self.positions = positions

    def step_offsets(self, step: int) -> torch.Tensor:
        """Every window offset of optimizer step ``step`` (the global batch): a function of (seed, step)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(self.positions, (self.batch_size * self.at.chunks,), generator=g)

    def batch(self, k: int) -> list[int]:
        step, chunk = self.at.slot(k)
        offsets = self.drawn(step, self.step_offsets)
        return offsets[chunk * self.batch_size : (chunk + 1) * self.batch_size].tolist()


def _identity(batch: Any) -> Any:
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
    """The user's ``loader`` with ``settings``' workers (persistent), pinning and prefetch factor
    (``data.tune_user_loader``). An IterableDataset keeps its worker count (each worker would
    iterate the whole dataset unless it shards itself)."""
    iterable = isinstance(loader.dataset, IterableDataset)
    workers = loader.num_workers if iterable else settings.num_workers
    tuned = rebuild_loader(loader, num_workers=workers)
    # Read when an iterator starts; DataLoader lets both be set before the first one.
    tuned.pin_memory = settings.pin_memory
    tuned.prefetch_factor = settings.prefetch_factor if workers > 0 else None
    return tuned


def build_loader(
    dataset: TokenWindows, batch_size: int, seed: int, settings: LoaderSettings, at: Position = START
) -> DataLoader:
    """An endless DataLoader of (x, y) batches of ``batch_size`` rows of the seeded stream at ``at``."""
    if batch_size > dataset.positions:
        raise TurbotrainError(
            f"batch.micro = {batch_size} is larger than the {dataset.positions} distinct windows in the data; "
            "use a smaller --batch.micro or more data"
        )
    return sampled_loader(
        dataset, RandomWindowSampler(dataset.positions, batch_size, seed, at), seed, settings
    )


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
    dataset: TokenWindows, batch_size: int, count: int, seed: int, at: Position = START
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches every time (validation), drawn once on the host: this rank's chunks of
    ``count`` global batches (equal chunks: the mean of the ranks' means is the mean over all rows)."""
    if dataset.positions < 1:
        return []
    sampler = RandomWindowSampler(dataset.positions, min(batch_size, dataset.positions), seed, at)
    return [dataset.__getitems__(sampler.batch(k)) for k in range(count * at.accumulation)]


def token_batches(vocab_size: int, seq_len: int, device: torch.device, seed: int = 0) -> Callable[[int], Any]:
    """``make_batch`` for token models: random (inputs, targets) of shape (micro, seq_len)."""

    def make(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(vocab_size, (micro, seq_len + 1), generator=g)
        return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)

    return make
