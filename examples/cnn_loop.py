"""An MNIST-style CNN loop (pytorch/examples mnist) made fast and monitored with turbotrain.

The loop is the original: Adadelta, an epoch-level StepLR, `len(train_loader.dataset)` in the log
line. Five lines change (marked); `track(...)` adds metrics.jsonl, a progress line, samples/s,
MFU where the device has a datasheet peak, and plots + summary at the end. Data is made here.

    python examples/cnn_loop.py [RUN_DIR]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from turbotrain import Engine, track


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3, 1), nn.Conv2d(16, 32, 3, 1)
        self.dropout, self.fc = nn.Dropout(0.25), nn.Linear(32 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc(self.dropout(torch.flatten(x, 1))), dim=1)


torch.manual_seed(0)
labels = torch.randint(10, (512,))
# learnable: the mean encodes the label
images = torch.randn(512, 1, 28, 28) * 0.5 + labels.view(-1, 1, 1, 1) / 5
train_loader = DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True)
model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)

# for counting FLOPs once: a batch cut from the data, not drawn from the loader (drawing one would
# advance the shuffling sampler's RNG and change what the loop trains on)
example_batch = (images[:64], labels[:64])
engine = Engine()  # 1: defaults change speed, never the math
model, optimizer, train_loader = engine.setup(
    model,
    optimizer,
    train_loader,  # 2
    scheduler=scheduler,
    scheduler_interval="epoch",
)
with track(
    engine,
    model,
    optimizer,
    sys.argv[1] if len(sys.argv) > 1 else "runs/cnn-loop",  # 3
    example_batch=example_batch,
    loss_fn=lambda m, b: F.nll_loss(m(b[0]), b[1]),  # for FLOPs
    log_every=4,
    max_steps=3 * len(train_loader),
):
    for epoch in range(1, 4):
        model.train()
        for _batch_idx, (data, target) in enumerate(train_loader):
            output = model(data)
            loss = F.nll_loss(output, target)
            # optional: no sync, logged as train_accuracy
            engine.log("accuracy", (output.argmax(1) == target).float().mean())
            engine.backward(loss)  # 4
            engine.step(optimizer)  # 5: step, zero_grad
        print(
            f"epoch {epoch}: {len(train_loader.dataset)} images, last loss {loss.item():.4f}, "
            f"lr {optimizer.param_groups[0]['lr']:.3f}"
        )
        engine.end_epoch(optimizer)  # steps the epoch-level StepLR
