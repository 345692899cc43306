"""Under torch.distributed every rank must train with the same micro-batch: the finder agrees on
the minimum. Two CPU processes over gloo, each with a different simulated memory limit."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port

from turbotrain.tools.memory import TrialResult, find_batch_size

LIMITS = (100, 40)  # samples that fit on rank 0 and rank 1


def _trial(limit: int):
    def trial(micro: int) -> TrialResult:
        if micro > limit:
            raise torch.OutOfMemoryError(f"simulated: {micro} > {limit}")
        return TrialResult(1_000_000 + 100_000 * micro, micro / 1000.0)

    return trial


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(LIMITS))
    try:
        out[rank] = find_batch_size(_trial(LIMITS[rank]), max_micro=4096, headroom=0.10).micro
    finally:
        dist.destroy_process_group()


def test_all_ranks_agree_on_a_size_that_fits_the_smallest():
    with mp.Manager() as manager:
        out = manager.dict()
        # the ranks forked from this process: spawning started an interpreter each (importing torch)
        mp.start_processes(_rank, args=(free_port(), out), nprocs=len(LIMITS), join=True, start_method="fork")
        sizes = dict(out)
    assert sizes[0] == sizes[1]
    alone = find_batch_size(_trial(min(LIMITS)), max_micro=4096, headroom=0.10).micro
    assert sizes[0] == alone <= min(LIMITS)
