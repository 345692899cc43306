"""Worker for test_finder_restores.py: the batch finder's trials (StepTrial: forward, backward and
an optimizer step at each size) on a tiny MoE GPT whose router bias moves, in one process or
under torchrun with the experts sharded over 2 ranks (expert parallelism). Writes, per rank, which
parameters and buffers differ after the search from before it, and whether router-bias loads
are left pending, to ``OUT.rank<R>.json``. Arguments: MODE (single|ep) OUT. (Under torchrun:
run as a job of test_expert_parallel.py's one launch, by ep_ckpt_worker.py.)"""

from __future__ import annotations

import json
import sys

import torch

from turbotrain import Engine
from turbotrain.parts.models.moe import MoEConfig, MoEGPT
from turbotrain.tools.memory import StepTrial, token_batches

T, VOCAB, N_EXPERTS = 16, 64, 4


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    ep = mode == "ep"
    engine = Engine(
        {
            "run": {"device": "cpu"},
            "distributed": {"strategy": "ddp", "expert_parallel": 2} if ep else {"strategy": "single"},
        }
    )
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
            router_bias_update=0.01,
            moe_impl="batched",
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, _ = engine.setup(model, optimizer)
    plain = model.module if ep else model
    before = {n: t.detach().clone() for n, t in [*plain.named_parameters(), *plain.named_buffers()]}
    with StepTrial(engine, model, optimizer, token_batches(VOCAB, T, engine.device)) as trial:
        for micro in (1, 2, 4):
            trial(micro)
    changed = sorted(
        n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if not torch.equal(t, before[n])
    )
    pending = [
        i
        for i, layer in enumerate(plain.moe_layers())  # loads left for a bias update (zeros: none)
        if (layer.pending is not None and bool(layer.pending.any())) or layer.step_load is not None
    ]
    tallied = [
        i for i, layer in enumerate(plain.moe_layers()) if layer.load is not None and bool(layer.load.any())
    ]
    with open(f"{out}.rank{engine.strategy.rank}.json", "w") as f:
        json.dump(
            {
                "changed": changed,
                "pending": pending,
                "tallied": tallied,
                "optimizer_state": len(optimizer.state),
                "w1_shape": list(plain.blocks[0].mlp.w1.shape),
            },
            f,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
