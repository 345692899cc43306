"""Worker for test_expert_parallel.py's checkpoint tests: the optimizer state of a MoE model saved
at one expert-parallel degree and loaded at another, through the checkpoint functions a run uses.

``save DEGREE DIR OUT``: train a tiny MoE GPT 4 AdamW steps (under torchrun: DDP with the experts
sharded over DEGREE ranks, a sharded checkpoint; in one plain process: a ``.pt`` checkpoint), save
it at step 4, and write what every rank holds live: each parameter's optimizer state (this rank's
expert slice) and its expert range. ``load DEGREE DIR OUT``: build the same model fresh (another
seed), load the newest checkpoint of DIR with ``restore_latest`` and write the same. Then take one
more step on fixed data and write the loss, so a load that left a slot wrong shows in the next
step too. Written to ``OUT.rank<R>.pt`` (tensors, torch.save). Several jobs (``ACTION DEGREE DIR
OUT ...``) run one after the other in one process (or one torchrun launch), each building its
engine, model and optimizer anew; ``ep DEGREE - OUT`` is ep_worker.py's expert-parallel run and
``finder 2 - OUT`` finder_ep_worker.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from turbotrain import Engine
from turbotrain.loop.checkpoint import RunState, restore_latest, save_checkpoint, save_sharded
from turbotrain.parts.models.moe import MoEConfig, MoEGPT

GLOBAL_BATCH, T, VOCAB, N_EXPERTS = 8, 16, 64, 4


def _data(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(VOCAB, (GLOBAL_BATCH, T + 1), generator=g)


def main(action: str, degree: int, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    engine = Engine(
        {
            "run": {"device": "cpu"},
            "optim": {"grad_clip": 1.0},
            "distributed": {"strategy": "ddp", "expert_parallel": degree}
            if degree > 1
            else {"strategy": "auto"},
        }
    )
    rank, world = engine.strategy.rank, engine.strategy.world
    torch.manual_seed(0 if action == "save" else 7)  # a load must bring back everything, not rely on the seed
    plain = MoEGPT(
        MoEConfig(
            vocab_size=VOCAB,
            n_layer=2,
            n_head=2,
            d_model=32,
            block_size=T,
            n_experts=N_EXPERTS,
            top_k=2,
            aux_loss_coef=0.01,
            router_bias_update=1e-3,
            moe_impl="batched",
        )
    )
    optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)
    # experts placed by the plan; the optimizer's state follows them
    model, optimizer, _ = engine.setup(plain, optimizer)
    state = RunState(model=model, optimizer=optimizer)
    state.strategy = engine.strategy
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)

    def train_step(step: int) -> float:
        x = _data(step)[rows]
        with engine.autocast():
            loss = model(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        assert engine.step(optimizer)
        return float(engine.last_loss)

    if action == "save":
        for step in range(4):
            train_step(step)
        if world > 1:
            save_sharded(Path(folder), 4, state)
        else:
            save_checkpoint(Path(folder), 4, state.state_dict())
    else:
        restore_latest(Path(folder), state)
    names = {id(p): n for n, p in plain.named_parameters()}
    optim_state = {
        names[id(p)]: {k: v.clone() for k, v in optimizer.state[p].items()}
        for g in optimizer.param_groups
        for p in g["params"]
        if p in optimizer.state
    }
    pending = {
        f"{i}": layer.pending.clone() if layer.pending is not None else None
        for i, layer in enumerate(plain.moe_layers())
    }
    weights = {n: p.detach().clone() for n, p in plain.named_parameters()}
    next_loss = train_step(4)
    torch.save(
        {
            "optim": optim_state,
            "weights": weights,
            "pending": pending,
            "world": world,
            "first_expert": plain.blocks[0].mlp.first_expert,
            "n_local": N_EXPERTS // degree,
            "next_loss": next_loss,
        },
        f"{out}.rank{rank}.pt",
    )


if __name__ == "__main__":
    # beside this script: their expert-parallel runs share test_expert_parallel.py's one launch
    import ep_worker
    import finder_ep_worker

    jobs = sys.argv[1:]
    for i in range(0, len(jobs), 4):
        if jobs[i] == "ep":  # ep_worker.py's run (ep DEGREE - OUT), its results in OUT.rank<R>.json
            ep_worker.main("ep", int(jobs[i + 1]), jobs[i + 3])
        elif jobs[i] == "finder":  # finder_ep_worker.py's search (finder 2 - OUT), the same way
            finder_ep_worker.main("ep", jobs[i + 3])
        else:
            main(jobs[i], int(jobs[i + 1]), jobs[i + 2], jobs[i + 3])
