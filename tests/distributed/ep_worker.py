"""Worker for test_expert_parallel.py (under torchrun: a job of its one launch, by
ep_ckpt_worker.py). Plain process ("single"): the reference, one process
training a tiny MoE GPT through the Engine on the global batch, as 2 micro-batches (one per rank
of the parallel run, so the per-micro-batch load-balancing loss is the same). Under torchrun
("ep DEGREE"): DDP with the experts sharded over DEGREE ranks. Writes, per rank, the logits of its
rows before training, every gradient of the first step (expert weights: this rank's slice and
where it starts), the loss and the gradient norm of every optimizer step (both runs clip at CLIP,
below the norm, so the norm has to span every rank's experts), and what a checkpoint would hold of
the first MoE block's experts after training (weights and AdamW's exp_avg), to ``OUT.rank<R>.json``."""

from __future__ import annotations

import json
import sys

import torch

from turbotrain import Engine
from turbotrain.parts.models.moe import MoEConfig, MoEGPT
from turbotrain.parts.models.moe.parallel import place_experts

GLOBAL_BATCH, T, VOCAB, STEPS, N_EXPERTS, CLIP = 8, 16, 64, 30, 4, 0.05


def main(mode: str, degree: int, out: str) -> None:
    torch.set_num_threads(1)
    ep = mode == "ep"
    engine = Engine(
        {
            "run": {"device": "cpu"},
            "batch": {"accumulation": 1 if ep else 2},
            "optim": {"grad_clip": CLIP},
            "distributed": {"strategy": "ddp", "expert_parallel": degree} if ep else {"strategy": "single"},
        }
    )
    rank, world = engine.strategy.rank, engine.strategy.world
    torch.manual_seed(0)
    model = MoEGPT(
        MoEConfig(
            vocab_size=VOCAB,
            n_layer=2,
            n_head=2,
            d_model=32,
            block_size=T,
            n_experts=N_EXPERTS,
            top_k=2,
            aux_loss_coef=0.01,
            moe_impl="batched",
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # the plan's expert dimension: this rank's experts, then DDP
    model, optimizer, _ = engine.setup(model, optimizer)
    plain = model.module if ep else model
    starts = torch.randint(VOCAB, (STEPS, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
    data = (
        starts
        + torch.arange(T + 1)
        * torch.randint(1, 3, (STEPS, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(2))
    ) % VOCAB
    # the parallel run has 2 ranks; the reference runs their rows as 2 micro-batches
    share = GLOBAL_BATCH // 2
    parts = [slice(rank * share, (rank + 1) * share)] if ep else [slice(0, share), slice(share, 2 * share)]
    plain.eval()
    with torch.no_grad():
        logits = torch.cat([plain(data[0][p, :-1]) for p in parts]).tolist()
    plain.train()
    losses, norms, grads = [], [], None
    for window in data:
        for p in parts:
            x = window[p]
            with engine.autocast():
                loss = model(x[:, :-1], x[:, 1:])
            engine.backward(loss)
        if grads is None:
            grads = {n.removeprefix("module."): p.grad.tolist() for n, p in model.named_parameters()}
        if engine.step(optimizer):
            losses.append(float(engine.last_loss))
            norms.append(float(engine.last_grad_norm))
    first = plain.blocks[0].mlp.first_expert
    # what a checkpoint holds: every expert (gathered under expert parallelism), also in the optimizer
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    index = [id(p) for g in optimizer.param_groups for p in g["params"]].index(id(plain.blocks[0].mlp.w1))
    exp_avg = optimizer.state_dict()["state"][index]["exp_avg"]
    saved = {"w1": state["blocks.0.mlp.w1"].tolist(), "exp_avg": exp_avg.tolist()}
    # untouched by saving
    saved["live_exp_avg_shape"] = list(optimizer.state[plain.blocks[0].mlp.w1]["exp_avg"].shape)
    if ep:  # and loading it keeps this rank's slice: a fresh sharded model gets the trained experts back
        torch.manual_seed(5)
        fresh = MoEGPT(plain.cfg)
        # as the run's were placed: this rank's slice
        place_experts(fresh, None, engine.strategy.plan.experts)
        fresh.load_state_dict(state)
        saved["reloaded_equal"] = bool(torch.equal(fresh.blocks[0].mlp.w1, plain.blocks[0].mlp.w1))
        saved["reloaded_shape"] = list(fresh.blocks[0].mlp.w1.shape)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(
            {
                "losses": losses,
                "norms": norms,
                "clip": CLIP,
                "grads": grads,
                "logits": logits,
                "world": world,
                "first_expert": first,
                "saved": saved,
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
