"""A Hugging Face loop (transformers' run_clm_no_trainer.py style) made fast and monitored.

GPT-2 is built from a config (random weights: nothing is downloaded); batches are dicts with
`input_ids`, `attention_mask` and `labels`; the model returns a `ModelOutput` whose `.loss` the
engine takes. tokens/s come from `input_ids`, MFU from FLOPs counted on one batch.

    pip install transformers && python examples/hf_loop.py [RUN_DIR]
"""

import sys

# turbotrain first: importing it keeps off the screen the lines torchao prints when transformers imports it
from turbotrain import Engine, track

# isort: split
import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

torch.manual_seed(0)
config = GPT2Config(
    vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
model = GPT2LMHeadModel(config)
model.loss_type = "ForCausalLM"  # the name "GPT2LMHeadModel" names no loss: transformers would warn
text = torch.tensor(list(open(__file__, "rb").read()), dtype=torch.long)  # this file, byte-level
starts = torch.randint(len(text) - 65, (40, 8))
batches = [
    {
        "input_ids": text[s[:, None] + torch.arange(64)],
        "attention_mask": torch.ones(8, 64, dtype=torch.long),
        "labels": text[s[:, None] + torch.arange(64)],
    }
    for s in starts
]
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=4, num_training_steps=20)

engine = Engine({"batch": {"accumulation": 2}})  # precision auto: bf16 autocast on modern GPUs
model, optimizer, loader = engine.setup(
    model, optimizer, batches, scheduler=scheduler, scheduler_interval="step"
)
with track(
    engine,
    model,
    optimizer,
    sys.argv[1] if len(sys.argv) > 1 else "runs/hf-loop",
    example_batch=batches[0],
    log_every=2,
    max_steps=20,
):
    model.train()
    for batch in loader:
        with engine.autocast():
            outputs = model(**batch)
        engine.backward(outputs)  # the ModelOutput: its .loss, divided by the accumulation
        if engine.step(optimizer) and engine.state.step % 5 == 0:
            print(f"step {engine.state.step}: loss {engine.last_loss.item():.3f}")  # host-device sync point
