"""A Hugging Face causal LM as a turbotrain workload: `turbotrain train --model` trains it like a preset.

GPT-2 is built from a config (random weights: nothing is downloaded) and trained on byte-level
windows of a Python standard-library source file; a batch is a dict with `input_ids` and `labels`
and the model returns a `ModelOutput` whose `.loss` the engine takes. tokens/s come from
`input_ids`, MFU from FLOPs counted once on a batch.

    pip install transformers
    turbotrain train --model examples/hf_causal_lm.py:make --train.max_steps 40
"""

from __future__ import annotations

import inspect
import os

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from turbotrain import Workload

SEQ = 64


class ByteWindows(Dataset):
    """Fixed windows of SEQ bytes of one text, as a causal LM's input ids (the model shifts the labels)."""

    def __init__(self, text: bytes, stride: int = SEQ) -> None:
        self.tokens = torch.tensor(list(text), dtype=torch.long)
        self.starts = range(0, len(self.tokens) - SEQ, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[self.starts[i] : self.starts[i] + SEQ]
        return {"input_ids": ids, "labels": ids}


def make() -> Workload:
    """A 2-layer GPT-2 (d=64, 256 byte tokens) on windows of os.py; the last 10% held out."""
    text = inspect.getsource(os).encode()
    cut = int(len(text) * 0.9)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    model.loss_type = "ForCausalLM"  # the name "GPT2LMHeadModel" names no loss: transformers would warn
    return Workload(
        model=model,
        train_loader=DataLoader(ByteWindows(text[:cut]), batch_size=16, shuffle=True),
        eval_loader=DataLoader(ByteWindows(text[cut:]), batch_size=16),
    )
