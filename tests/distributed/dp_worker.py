"""Worker for test_data_parallel.py, started by torchrun (or plainly, for the one-process
reference): trains a tiny GPT through the Engine on fixed batches and writes, per rank, the loss
of every optimizer step, the gradients of the first step, DDP communication-hook calls per
micro-step, the float8 layers (precision fp8) and FSDP2's mixed-precision dtypes to ``OUT.rank<R>.json``.
Arguments: STRATEGY ACCUMULATION OUT [PRECISION (fp32|bf16|fp8) [STEPS]], or ``several`` and one
``STRATEGY,ACCUMULATION,OUT,PRECISION,STEPS`` per case: the cases one after another in the same
processes and process group (one torchrun launch for several cases: each launch costs seconds of
imports and a rendezvous)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from turbotrain import Engine
from turbotrain.parts.models.gpt import GPT, GPTConfig

GLOBAL_BATCH, T, VOCAB, STEPS = 8, 16, 64, 30


# fp8: every linear but the tied head
PRECISIONS = {
    "fp32": {},
    "bf16": {"mode": "bf16-mixed"},
    "fp8": {"mode": "fp8", "fp8_emulate": True, "fp8_min_size": 1},
}


def main(
    strategy: str, accumulation: int, out: str, precision: str = "fp32", steps: str = str(STEPS)
) -> None:
    torch.set_num_threads(1)
    engine = Engine(
        {
            "run": {"device": "cpu"},
            "distributed": {"strategy": strategy},
            "precision": PRECISIONS[precision],
            "batch": {"accumulation": accumulation},
            "optim": {"grad_clip": 1.0},
        }
    )
    rank, world = engine.strategy.rank, engine.strategy.world
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=32, block_size=T))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, _ = engine.setup(model, optimizer)
    hook_calls: list[int] = []
    if strategy == "ddp":

        def count(state, bucket):  # noqa: ANN001
            hook_calls[-1] += 1
            return (
                dist.all_reduce(bucket.buffer(), async_op=True)
                .get_future()
                .then(lambda f: f.value()[0] / world)
            )

        model.register_comm_hook(None, count)
    float8 = sorted(name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    sharded_float8 = [name for name in float8 if isinstance(model.get_submodule(name).weight, DTensor)]
    policy = getattr(model, "_get_fsdp_state", None)
    policy = policy()._mp_policy if policy else None
    dtypes = [str(policy.param_dtype), str(policy.reduce_dtype)] if policy else None
    starts = torch.randint(
        VOCAB, (int(steps) * accumulation, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1)
    )
    data = (starts + torch.arange(T + 1)) % VOCAB  # counting sequences: learnable in a few steps
    share = GLOBAL_BATCH // world
    losses, grads = [], None
    for _i, window in enumerate(data):
        x = window[rank * share : (rank + 1) * share]  # this rank's part of the global batch
        hook_calls.append(0)
        with engine.autocast():
            loss = model(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        if grads is None and engine.pending_micro_steps == accumulation:
            grads = {
                n.removeprefix("module."): engine.strategy.full(p.grad).tolist()
                for n, p in model.named_parameters()
            }
        if engine.step(optimizer):
            losses.append(float(engine.last_loss))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(
            {
                "losses": losses,
                "grads": grads,
                "hook_calls": hook_calls,
                "world": world,
                "float8": float8,
                "sharded_float8": sharded_float8,
                "fsdp_dtypes": dtypes,
            },
            f,
        )


if __name__ == "__main__":
    if sys.argv[1] == "several":
        for case in sys.argv[2:]:
            strategy, accumulation, out, precision, steps = case.split(",")
            main(strategy, int(accumulation), out, precision, steps)
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
