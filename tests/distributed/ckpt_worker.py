"""Worker for test_sharded_checkpoint.py, started by torchrun (or plainly, for one process):
trains a tiny GPT with AdamW and a warmup schedule through ``fit()`` and the Checkpointer,
resuming from the newest checkpoint in FOLDER when there is one, and writes the loss of every
optimizer step it ran (by step number) to ``OUT.rank<R>.json``.

    ckpt_worker.py STRATEGY FOLDER MAX_STEPS CHECKPOINT_EVERY KEEP_LAST OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from turbotrain import Engine, fit
from turbotrain.core.optim import build_scheduler
from turbotrain.loop.checkpoint import Checkpointer, finished_checkpoints, restore_latest, run_state
from turbotrain.loop.hooks import FitContext, Hook
from turbotrain.parts.models.gpt import GPT, GPTConfig

GLOBAL_BATCH, T, VOCAB, TOTAL_STEPS = 8, 16, 64, 12


class RecordLoss(Hook):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_step_end(self, ctx: FitContext) -> None:
        self.losses[ctx.engine.state.step] = float(ctx.engine.last_loss)  # sync: a test records every step


def main(strategy: str, folder: str, max_steps: int, every: int, keep_last: int, out: str) -> None:
    torch.set_num_threads(1)
    engine = Engine(
        {"run": {"device": "cpu"}, "distributed": {"strategy": strategy}, "optim": {"grad_clip": 1.0}}
    )
    rank, world = engine.strategy.rank, engine.strategy.world
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=32, block_size=T))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = build_scheduler(
        optimizer, schedule="cosine", warmup_steps=4, max_steps=TOTAL_STEPS, lr=3e-3, min_lr=3e-4
    )
    model, optimizer, _ = engine.setup(model, optimizer, scheduler=scheduler, scheduler_interval="step")
    state = run_state(engine, model, optimizer, scheduler)
    resumed = ""
    if finished_checkpoints(Path(folder)):
        resumed = restore_latest(Path(folder), state).name
    starts = torch.randint(VOCAB, (TOTAL_STEPS, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
    data = (starts + torch.arange(T + 1)) % VOCAB  # counting sequences: learnable in a few steps
    share = GLOBAL_BATCH // world

    def batches():  # batch index i is the same global batch at every world size; this rank's part of it
        for window in data[engine.state.batches :]:
            x = window[rank * share : (rank + 1) * share]
            yield x[:, :-1], x[:, 1:]

    record = RecordLoss()
    fit(
        engine,
        model,
        optimizer,
        batches(),
        max_steps=max_steps,
        hooks=[record, Checkpointer(Path(folder), every, keep_last, state)],
    )
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"losses": record.losses, "world": world, "resumed": resumed, "step": engine.state.step}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
