"""A plain PyTorch loop made fast with five turbotrain calls (runs on CPU or GPU).

python examples/own_loop.py
"""

import torch

from turbotrain import Engine
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

torch.manual_seed(0)
model = TinyMLP()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = synthetic_batches(200, batch_size=64)

# clipping is explicit; precision auto: bf16 on modern GPUs
engine = Engine({"batch": {"accumulation": 2}, "optim": {"grad_clip": 1.0}})
model, optimizer, loader = engine.setup(model, optimizer, loader)  # to device, cast, compile, prefetch

for _i, (x, y) in enumerate(loader):
    with engine.autocast():
        loss = model(x, y)
    engine.backward(loss)  # divided by the accumulation, scaled for fp16
    if engine.step(optimizer) and engine.state.step % 20 == 0:  # unscale, clip, step, zero_grad
        # host-device sync point, every 20 steps
        print(f"step {engine.state.step:3d} loss {engine.last_loss.item():.4f}")
