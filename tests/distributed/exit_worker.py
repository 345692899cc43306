"""Worker for test_exit.py, started by torchrun: a user's own DDP loop through the Engine that ends
right after a gloo collective on a temporary tensor (the moment a rank used to abort at exit), and
says at the very end of the interpreter's exit whether its process group was left by then.

    exit_worker.py
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist


def report() -> None:
    # registered before the Engine joins the group, so it runs after the Engine's exit hook (last in, first out)
    print(f"group left at exit: {not dist.is_initialized()}", flush=True)


atexit.register(report)

from turbotrain import Engine  # noqa: E402 - after the hook above, as the order of exit hooks needs

torch.manual_seed(0)
engine = Engine({"run": {"device": "cpu"}, "distributed": {"strategy": "ddp"}})
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, _ = engine.setup(model, optimizer)
for _ in range(10):
    engine.backward(model(torch.randn(8, 4)).square().mean())
    engine.step(optimizer)
for _ in range(20):
    dist.all_reduce(torch.ones(1000))  # gloo's worker thread may hold the last reference when this returns
