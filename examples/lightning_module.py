"""A Lightning `Trainer` run with turbotrain's monitoring, run directory and recipe.

A small GPT (turbotrain's reference model, 2 layers, d=64) learns the bytes of a Python
standard-library source file inside an ordinary `LightningModule`. `trainer_kwargs_recipe` gives
the `Trainer` arguments of turbotrain's recipe for this machine (precision, cuDNN autotuning);
`build_recipe()` the DataLoader and AdamW settings; `TurbotrainLightningCallback` writes
RUN_DIR/metrics.jsonl, summary.json, summary.md and plots/.

    pip install 'turbotrain[lightning]' && python examples/lightning_module.py [RUN_DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import inspect
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from turbotrain.integrations.lightning import TurbotrainLightningCallback, trainer_kwargs_recipe
from turbotrain.integrations.recipe import build_recipe
from turbotrain.parts.models.gpt.model import GPT, GPTConfig

SEQ = 64


class ByteLM(L.LightningModule):
    def __init__(self, optimizer_kwargs: dict[str, bool]) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=64, block_size=SEQ))
        self.optimizer_kwargs = optimizer_kwargs

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)
        self.log("train_loss", loss)  # Lightning reads it every log_every_n_steps
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=2e-3, **self.optimizer_kwargs)


def byte_windows() -> TensorDataset:
    """Windows of SEQ bytes of os.py: inputs and the next bytes as targets."""
    data = torch.tensor(list(inspect.getsource(os).encode()), dtype=torch.long)
    starts = torch.arange(0, len(data) - SEQ - 1, SEQ)
    x = data[starts[:, None] + torch.arange(SEQ)]
    return TensorDataset(x, data[starts[:, None] + torch.arange(1, SEQ + 1)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", default="runs/lightning")
    parser.add_argument("--steps", type=int, default=40)
    a = parser.parse_args()
    L.seed_everything(0, verbose=False)
    recipe = build_recipe()
    recipe.apply_switches()  # TF32 and cuDNN autotuning on CUDA; denormal flushing on CPU
    loader = DataLoader(byte_windows(), batch_size=16, shuffle=True, **recipe.loader_kwargs())
    trainer = L.Trainer(
        max_steps=a.steps,
        log_every_n_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=a.run_dir,
        callbacks=[TurbotrainLightningCallback(f"{a.run_dir}/turbotrain")],
        **trainer_kwargs_recipe(),
    )
    trainer.fit(ByteLM(recipe.optimizer_kwargs()), loader)
    print(f"run directory: {a.run_dir}/turbotrain (summary.md, metrics.jsonl, plots/)")


if __name__ == "__main__":
    main()
