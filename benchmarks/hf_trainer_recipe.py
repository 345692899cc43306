"""A Hugging Face ``Trainer`` on GPT-2 with its default ``TrainingArguments`` or turbotrain's recipe
(``training_args_recipe()``), measured by :class:`~turbotrain.integrations.hf.TurbotrainCallback`:
steady-state tokens/s, MFU, time to first step (compilation included), peak memory, final loss.

One variant per process (the benchmark protocol: precision and compile state never leak between
rows); run both and compare. The model is built from a config (random weights, no download) and
trained on random token ids of the GPT-2 vocabulary; ``--size small`` is W1's GPT-2 small (12
layers, d=768, T=1024), ``--size tiny`` a 2-layer d=64 stand-in that runs on a CPU in seconds.

    python benchmarks/hf_trainer_recipe.py --variant defaults --size small --out RUNS/defaults
    python benchmarks/hf_trainer_recipe.py --variant recipe --size small --out RUNS/recipe
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from turbotrain.integrations.hf import TurbotrainCallback, training_args_recipe

SIZES = {
    "small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50304),
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=256),
}


class RandomTokens(Dataset):
    def __init__(self, rows: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("defaults", "recipe"), required=True)
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    config = SIZES[a.size]
    model = GPT2LMHeadModel(GPT2Config(**config))
    base = dict(
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        learning_rate=6e-4,
    )
    kwargs = training_args_recipe(**base) if a.variant == "recipe" else base
    data = RandomTokens(a.batch * (a.steps + 1), config["n_positions"], config["vocab_size"])
    callback = TurbotrainCallback(a.out / "turbotrain")
    trainer = Trainer(
        model=model, args=TrainingArguments(str(a.out), **kwargs), train_dataset=data, callbacks=[callback]
    )
    trainer.train()
    s = callback.summary
    steady = s.get("steady_state") or {}
    row = {
        "variant": a.variant,
        "size": a.size,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "training_args": {k: str(v) for k, v in kwargs.items()},
        "tokens_per_s": steady.get("tokens_per_s"),
        "mfu": steady.get("mfu"),
        "step_ms": steady.get("step_ms"),
        "first_step_s": s.get("first_step_s"),
        "peak_memory_gib": s.get("peak_memory_gib"),
        "final_train_loss": s.get("final_train_loss"),
        "compile": s.get("compile"),
        "hardware": s.get("hardware"),
    }
    (a.out / "result.json").write_text(json.dumps(row, indent=2, default=str) + "\n")
    print(json.dumps({k: row[k] for k in ("variant", "tokens_per_s", "mfu", "step_ms", "first_step_s")}))


if __name__ == "__main__":
    main()
