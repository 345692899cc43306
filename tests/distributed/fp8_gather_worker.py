"""Worker for test_fp8_all_gather.py, started by torchrun on 2 processes: precision fp8 (emulated,
every linear but the tied head) under FSDP2 through the Engine, with ``precision.fp8_all_gather``
off, then on (a second engine and model in the same processes: one launch), on the same fixed
batches as dp_worker.py. Writes to ``OUT.rank<R>.json``, for each: the loss of every optimizer
step, the type of each float8 layer's local weight shard, the precision's summary, and with the
all-gather on also

- the sharded checkpoint saved after step STEPS (in ``OUT.ckpt``), and the losses of steps
  STEPS+1.. again after restoring it (a resume through DCP's in-place load);
- after an injected inf, the fallback to bf16-mixed: the layer types, the local shard types and
  the losses of 2 more steps.

Arguments: OUT STEPS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from turbotrain import Engine
from turbotrain.loop.checkpoint import restore_latest, run_state, save_sharded
from turbotrain.parts.models.gpt import GPT, GPTConfig

GLOBAL_BATCH, T, VOCAB = 8, 16, 64
AFTER = 3  # steps trained after the checkpoint, twice (the second time restored from it)


def main(out: str, steps: str) -> None:
    torch.set_num_threads(1)
    records = {all_gather: run(all_gather, out, int(steps)) for all_gather in ("off", "on")}
    with open(f"{out}.rank{torch.distributed.get_rank()}.json", "w") as f:
        json.dump(records, f)


def run(all_gather: str, out: str, steps_n: int) -> dict:
    engine = Engine(
        {
            "run": {"device": "cpu"},
            "distributed": {"strategy": "fsdp"},
            "optim": {"grad_clip": 1.0},
            "precision": {
                "mode": "fp8",
                "fp8_emulate": True,
                "fp8_min_size": 1,
                "max_nonfinite_steps": 1,
                "fp8_all_gather": all_gather == "on",
            },
        }
    )
    rank, world = engine.strategy.rank, engine.strategy.world
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=32, block_size=T))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, _ = engine.setup(model, optimizer)
    starts = torch.randint(
        VOCAB, (steps_n + AFTER + 2, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1)
    )
    data = (starts + torch.arange(T + 1)) % VOCAB  # counting sequences: learnable in a few steps
    share = GLOBAL_BATCH // world

    def train(first: int, last: int, scale: float = 1.0) -> list[float]:
        losses = []
        for window in data[first:last]:
            x = window[rank * share : (rank + 1) * share]  # this rank's part of the global batch
            with engine.autocast():
                loss = model(x[:, :-1], x[:, 1:])
            engine.backward(loss * scale)
            if engine.step(optimizer):
                losses.append(float(engine.last_loss))
        return losses

    def shards() -> dict[str, str]:
        return {
            name: type(m.weight._local_tensor).__name__
            for name, m in model.named_modules()
            if type(m).__name__ in ("Float8Linear", "Linear") and hasattr(m.weight, "_local_tensor")
        }

    record: dict = {"losses": train(0, steps_n), "shards": shards(), "summary": engine.precision.summary()}
    if all_gather == "on":
        folder = Path(f"{out}.ckpt")
        state = run_state(engine, model, optimizer)
        save_sharded(folder, steps_n, state)
        record["after"] = train(steps_n, steps_n + AFTER)
        restore_latest(folder, state)
        record["resumed"] = train(steps_n, steps_n + AFTER)
        train(steps_n + AFTER, steps_n + AFTER + 1, scale=float("inf"))  # the injected inf
        engine.poll(optimizer)
        record["fallback"] = {
            "precision": engine.precision.name,
            "shards": shards(),
            "layers": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}),
            "losses": train(steps_n + AFTER + 1, steps_n + AFTER + 2),
        }
    return record


if __name__ == "__main__":
    main(*sys.argv[1:])
