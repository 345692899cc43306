"""A Hugging Face `Trainer` run with turbotrain's monitoring, run directory and recipe.

GPT-2 is built from a config (random weights: nothing is downloaded) and trained on byte-level
windows of a Python standard-library source file. `training_args_recipe` gives the
`TrainingArguments` of turbotrain's recipe for this machine (your own arguments win, one line says
where they differ); `TurbotrainCallback` writes RUN_DIR/metrics.jsonl, summary.json, summary.md and
plots/ (tokens/s, TFLOP/s, MFU on a known GPU, memory, GPU utilisation, compile accounting).

    pip install 'turbotrain[hf]' && python examples/hf_trainer.py [RUN_DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import inspect
import os

# turbotrain first: importing it keeps off the screen the lines torchao prints when transformers imports it
from turbotrain.integrations.hf import TurbotrainCallback, training_args_recipe

# isort: split
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

SEQ = 64


class ByteWindows(Dataset):
    """Windows of SEQ bytes of one text as a causal LM's input ids (the model shifts the labels)."""

    def __init__(self, text: bytes) -> None:
        self.tokens = torch.tensor(list(text), dtype=torch.long)
        self.starts = range(0, len(self.tokens) - SEQ, SEQ)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[self.starts[i] : self.starts[i] + SEQ]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/hf-trainer")
    parser.add_argument("--steps", type=int, default=40)
    a = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    # the name "GPT2LMHeadModel" names no loss: without this transformers warns, and its Trainer
    # counts the labels unshifted (one target too many per row) when it averages the loss
    model.loss_type = "ForCausalLM"
    args = TrainingArguments(
        a.run_dir,
        **training_args_recipe(
            max_steps=a.steps,
            per_device_train_batch_size=16,
            learning_rate=2e-3,
            logging_steps=5,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        ),
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ByteWindows(inspect.getsource(os).encode()),
        callbacks=[TurbotrainCallback(f"{a.run_dir}/turbotrain")],
    )
    trainer.train()
    print(f"run directory: {a.run_dir}/turbotrain (summary.md, metrics.jsonl, plots/)")


if __name__ == "__main__":
    main()
