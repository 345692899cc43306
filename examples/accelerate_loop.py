"""An Accelerate loop with turbotrain's recipe and monitoring.

GPT-2 is built from a config (random weights: nothing is downloaded) and trained on byte-level
windows of a Python standard-library source file in an ordinary Accelerate loop.
`accelerator_kwargs_recipe` gives the `Accelerator` arguments of turbotrain's recipe for this
machine (mixed precision from the device's capability, compile on CUDA); `build_recipe()` the
DataLoader and AdamW settings; `track_accelerate` writes RUN_DIR/metrics.jsonl, summary.json,
summary.md and plots/.

    pip install accelerate transformers && python examples/accelerate_loop.py [RUN_DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import inspect
import os

# turbotrain first: importing it keeps off the screen the lines torchao prints when transformers imports it
from turbotrain.integrations.accelerate import accelerator_kwargs_recipe, track_accelerate
from turbotrain.integrations.recipe import build_recipe

# isort: split
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

SEQ = 64


def collate(rows: list[tuple[torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([r[0] for r in rows])
    return {"input_ids": ids, "labels": ids}  # the model shifts the labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/accelerate")
    parser.add_argument("--steps", type=int, default=40)
    a = parser.parse_args()
    torch.manual_seed(0)
    recipe = build_recipe()
    recipe.apply_switches()  # TF32 and cuDNN autotuning on CUDA; denormal flushing on CPU
    accelerator = Accelerator(**accelerator_kwargs_recipe(gradient_accumulation_steps=2))
    text = torch.tensor(list(inspect.getsource(os).encode()), dtype=torch.long)
    windows = text[: len(text) // SEQ * SEQ].view(-1, SEQ)
    loader = DataLoader(
        TensorDataset(windows), batch_size=8, shuffle=True, collate_fn=collate, **recipe.loader_kwargs()
    )
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    model.loss_type = "ForCausalLM"  # the name "GPT2LMHeadModel" names no loss: transformers would warn
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, **recipe.optimizer_kwargs())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # FLOPs are counted on the first batch handed to run.batch(): nothing is drawn from the loader
    with track_accelerate(
        accelerator, model, f"{a.run_dir}/turbotrain", log_every=5, max_steps=a.steps
    ) as run:
        model.train()
        while run.steps < a.steps:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                run.batch(batch)  # samples and tokens, from shapes
                if accelerator.sync_gradients:  # an optimizer step is done
                    run.step(loss, lr=optimizer.param_groups[0]["lr"])
                    if run.steps == a.steps:
                        break
    accelerator.print(f"run directory: {a.run_dir}/turbotrain (summary.md, metrics.jsonl, plots/)")


if __name__ == "__main__":
    main()
