"""A small BERT-style encoder classifier, padded batches with attention masks, three ways:
`turbotrain train --model`, a Hugging Face `Trainer` with turbotrain's callback, and an Accelerate
loop with turbotrain's tracker.

BERT is built from a tiny `BertConfig` (random weights: nothing is downloaded). Each sample is one
line of a Python standard-library source file as bytes, padded to SEQ with an attention mask; the
label says whether the line defines something (`def` or `class`). FLOPs are counted on the padded
batch (what the model computes); tokens and tokens/s count the real tokens, from the attention
mask, not the padded shape.

    pip install transformers accelerate
    turbotrain train --model examples/bert_classifier.py:make --train.max_steps 40
    python examples/bert_classifier.py runs/bert-hf --trainer hf --steps 40
    python examples/bert_classifier.py runs/bert-acc --trainer accelerate --steps 40
"""

from __future__ import annotations

import argparse
import inspect
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from turbotrain import Workload
from turbotrain.integrations.accelerate import accelerator_kwargs_recipe, track_accelerate
from turbotrain.integrations.hf import TurbotrainCallback, training_args_recipe
from turbotrain.integrations.recipe import build_recipe

SEQ = 32  # bytes per sample, padding included
PAD = 0  # the byte that pads (no source line holds a NUL)


class Lines(Dataset):
    """Lines of a text as byte ids padded to SEQ, their attention mask, and a label: does the
    line define a function or class."""

    def __init__(self, lines: list[bytes]) -> None:
        rows = [line.strip()[:SEQ] for line in lines if line.strip()]
        self.ids = torch.full((len(rows), SEQ), PAD, dtype=torch.long)
        self.mask = torch.zeros(len(rows), SEQ, dtype=torch.long)
        for i, row in enumerate(rows):
            self.ids[i, : len(row)] = torch.tensor(list(row))
            self.mask[i, : len(row)] = 1
        self.labels = torch.tensor([int(row.startswith((b"def ", b"class "))) for row in rows])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def datasets(rows: int | None = None) -> tuple[Lines, Lines]:
    """Lines of os.py: training (the first 90 %, or its first ``rows``) and held out (the rest)."""
    lines = inspect.getsource(os).encode().splitlines()
    cut = int(len(lines) * 0.9)
    train = Lines(lines[:cut])
    if rows is not None:
        train.ids, train.mask, train.labels = train.ids[:rows], train.mask[:rows], train.labels[:rows]
    return train, Lines(lines[cut:])


def build_model() -> BertForSequenceClassification:
    """A 2-layer BERT (d=32, 2 heads, 256 byte ids) with a 2-way classification head."""
    config = BertConfig(
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        pad_token_id=PAD,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def accuracy(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Share of held-out lines classified right (a device tensor: read with the loss)."""
    return {"accuracy": (model(**batch).logits.argmax(-1) == batch["labels"]).float().mean()}


def make(rows: int | None = None) -> Workload:
    """The encoder as a turbotrain workload (`turbotrain train --model examples/bert_classifier.py:make`);
    ``rows``: train on the first lines only."""
    train, held_out = datasets(rows)
    return Workload(
        model=build_model(),
        train_loader=DataLoader(train, batch_size=16, shuffle=True),
        eval_loader=DataLoader(held_out, batch_size=16),
        metrics_fn=accuracy,
    )


def with_hf_trainer(run_dir: str, steps: int) -> None:
    train, held_out = datasets()
    args = TrainingArguments(
        run_dir,
        **training_args_recipe(
            max_steps=steps,
            per_device_train_batch_size=16,
            learning_rate=1e-3,
            logging_steps=5,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        ),
    )
    callback = TurbotrainCallback(f"{run_dir}/turbotrain")
    Trainer(model=build_model(), args=args, train_dataset=train, callbacks=[callback]).train()


def with_accelerate(run_dir: str, steps: int) -> None:
    recipe = build_recipe()
    accelerator = Accelerator(**accelerator_kwargs_recipe())
    model = build_model()
    loader = DataLoader(datasets()[0], batch_size=16, shuffle=True, **recipe.loader_kwargs())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **recipe.optimizer_kwargs())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with track_accelerate(accelerator, model, f"{run_dir}/turbotrain", log_every=5, max_steps=steps) as run:
        model.train()
        while run.steps < steps:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                run.batch(batch)  # samples; tokens from the attention mask
                if accelerator.sync_gradients:
                    run.step(loss)
                    if run.steps == steps:
                        break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/bert-classifier")
    parser.add_argument("--trainer", choices=("hf", "accelerate"), default="hf")
    parser.add_argument("--steps", type=int, default=40)
    a = parser.parse_args()
    torch.manual_seed(0)
    (with_hf_trainer if a.trainer == "hf" else with_accelerate)(a.run_dir, a.steps)
    print(f"run directory: {a.run_dir}/turbotrain (summary.md, metrics.jsonl, plots/)")


if __name__ == "__main__":
    main()
