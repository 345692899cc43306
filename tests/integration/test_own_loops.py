"""Five kinds of public training loops, ported to the Engine as the README says, train exactly as
before: the same loss at every step (fp32, CPU, within 1e-6) and the same validation loss.

Each loop is written once with a ``port`` switch on the lines the README changes, so the two
versions cannot differ anywhere else. Data is made here; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from turbotrain import Engine, fit
from turbotrain.app.report import NO_FLOPS, plots_for
from turbotrain.app.tracking import track
from turbotrain.base.errors import ConfigError
from turbotrain.parts.models.classifier import CifarResNet
from turbotrain.parts.models.gpt import GPT, GPTConfig

TOL = 1e-6


def _same(original: tuple[list[float], float], ported: tuple[list[float], float]) -> None:
    (a, val_a), (b, val_b) = original, ported
    assert len(a) == len(b) and len(a) >= 6
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= TOL, f"per-step losses differ by up to {worst:.3g}: {a} vs {b}"
    assert abs(val_a - val_b) <= TOL, (val_a, val_b)
    assert a[-1] < a[0]  # and it learns


# ----------------------------------------------------------------------------- nanoGPT style


def nanogpt_loop(port: bool) -> tuple[list[float], float]:
    """karpathy/nanoGPT train.py: accumulation, its own warmup + cosine LR set each iteration,
    clipping at 1.0, AdamW, `estimate_loss()` on held-out batches."""
    torch.manual_seed(0)
    data = torch.randint(64, (4000,), generator=torch.Generator().manual_seed(1))
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    accumulation, max_iters, warmup = 4, 10, 3
    if port:
        engine = Engine({"batch": {"accumulation": accumulation}, "optim": {"grad_clip": 1.0}})
        model, optimizer, _ = engine.setup(model, optimizer)
    g = torch.Generator().manual_seed(2)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - 17, (8,), generator=g)
        return torch.stack([data[i : i + 16] for i in ix]), torch.stack([data[i + 1 : i + 17] for i in ix])

    def get_lr(it: int) -> float:
        if it < warmup:
            return 1e-3 * (it + 1) / warmup
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * (it - warmup) / (max_iters - warmup))) * 9e-4

    losses = []
    for it in range(max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        total = 0.0
        for _ in range(accumulation):
            x, y = get_batch()
            if port:
                with engine.autocast():
                    loss = model(x, y)
                engine.backward(loss)
            else:
                loss = model(x, y)
                (loss / accumulation).backward()
            total += loss.item() / accumulation
        if port:
            engine.step(optimizer)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    val = [get_batch() for _ in range(4)]
    if port:
        return losses, engine.evaluate(model, val)
    model.eval()
    with torch.no_grad():
        return losses, sum(model(x, y).item() for x, y in val) / len(val)


# ----------------------------------------------------------------------------- word language model


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.encoder, self.rnn, self.decoder = nn.Embedding(vocab, d), nn.LSTM(d, d, 2), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return self.decoder(out), hidden


def lstm_loop(port: bool) -> tuple[list[float], float]:
    """pytorch/examples word_language_model: truncated BPTT with the hidden state carried over,
    a hand-written SGD update, clipping at 0.25, LR / 4 at epoch end when validation stalls."""
    torch.manual_seed(0)
    corpus = torch.randint(50, (8 * 121,), generator=torch.Generator().manual_seed(3)).view(-1, 8)  # T x B
    train, valid = corpus[:100], corpus[100:]
    model, lr, best = LSTMLM(), 5.0, None
    if port:
        engine = Engine()
        model, _, _ = engine.setup(model)

    def zeros() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, 8, 32), torch.zeros(2, 8, 32)

    def evaluate() -> float:
        model.eval()
        total, hidden = 0.0, zeros()
        with torch.no_grad():
            for i in range(0, len(valid) - 1, 10):
                x, y = valid[i : i + 10], valid[i + 1 : i + 11]
                x = x[: len(y)]
                out, hidden = model(x, hidden)
                total += len(x) * F.cross_entropy(out.view(-1, 50), y.reshape(-1)).item()
        return total / (len(valid) - 1)

    losses = []
    for _epoch in range(3):
        model.train()
        hidden = zeros()
        for i in range(0, len(train) - 1, 10):
            x, y = train[i : i + 10], train[i + 1 : i + 11]
            x = x[: len(y)]
            hidden = tuple(h.detach() for h in hidden)
            model.zero_grad()
            out, hidden = model(x, hidden)
            loss = F.cross_entropy(out.view(-1, 50), y.reshape(-1))
            engine.backward(loss) if port else loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            losses.append(loss.item())
        val = evaluate()
        if best is None or val < best:
            best = val
        else:
            lr /= 4.0
    return losses, evaluate()


# ----------------------------------------------------------------------------- mnist


class MnistNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
        self.dropout, self.fc = nn.Dropout(0.25), nn.Linear(16 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc(self.dropout(torch.flatten(x, 1))), dim=1)


def mnist_loop(port: bool) -> tuple[list[float], float]:
    """pytorch/examples mnist: Adadelta, an epoch-level StepLR, `len(train_loader.dataset)` in
    the log line, dropout, a test pass summing the loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    images, labels = torch.randn(96, 1, 28, 28, generator=g), torch.randint(10, (96,), generator=g)
    train_loader = DataLoader(
        TensorDataset(images[:64], labels[:64]),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
    )
    test_loader = DataLoader(TensorDataset(images[64:], labels[64:]), batch_size=16)
    model = MnistNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    if port:
        engine = Engine()
        model, optimizer, train_loader = engine.setup(
            model, optimizer, train_loader, scheduler=scheduler, scheduler_interval="epoch"
        )
    losses, lrs = [], []
    for _epoch in range(3):
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            if not port:
                optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            if port:
                engine.backward(loss)
                engine.step(optimizer)
            else:
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
            assert batch_idx * len(data) < len(train_loader.dataset)  # the log line's arithmetic
        engine.end_epoch(optimizer) if port else scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.7, 0.49, 0.343])  # stepped per epoch, not per batch
    model.eval()
    test_loss = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            test_loss += F.nll_loss(model(data), target, reduction="sum").item()
    return losses, test_loss / len(test_loader.dataset)


# ----------------------------------------------------------------------------- imagenet-style resnet


def resnet_loop(port: bool) -> tuple[list[float], float]:
    """pytorch/examples imagenet `train()`: a ResNet with batch norm, SGD with momentum and
    weight decay, cross-entropy on logits."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    batches = [
        (
            torch.randint(0, 256, (8, 3, 32, 32), generator=g, dtype=torch.uint8),
            torch.randint(10, (8,), generator=g),
        )
        for _ in range(4)
    ]
    model = CifarResNet(width=8, classes=10)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loader = batches[:3] * 3  # three epochs over three batches
    if port:
        engine = Engine()
        model, optimizer, loader = engine.setup(model, optimizer, loader)
    losses = []
    model.train()
    for images, target in loader:
        if port:
            with engine.autocast():
                loss = criterion(model(images), target)
            engine.backward(loss)
            engine.step(optimizer)
        else:
            loss = criterion(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    val = batches[3:]
    if port:
        return losses, engine.evaluate(model, val, loss_fn=lambda m, b: criterion(m(b[0]), b[1]))
    model.eval()
    with torch.no_grad():
        return losses, sum(criterion(model(x), y).item() for x, y in val) / len(val)


# ----------------------------------------------------------------------------- transformers GPT-2


def gpt2_loop(port: bool) -> tuple[list[float], float]:
    """transformers run_clm_no_trainer.py: GPT2LMHeadModel from a config (random weights), dict
    batches with labels, AdamW, a linear warmup schedule stepped per optimizer step,
    accumulation 2, `outputs.loss`."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(7)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(96, (4, 24), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    batches = [batch() for _ in range(16)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=2, num_training_steps=6
    )
    loader, accumulation = batches[:12], 2
    if port:
        engine = Engine({"batch": {"accumulation": accumulation}})
        model, optimizer, loader = engine.setup(
            model, optimizer, loader, scheduler=scheduler, scheduler_interval="step"
        )
    losses, total = [], 0.0
    model.train()
    for step, b in enumerate(loader):
        if port:
            with engine.autocast():
                outputs = model(**b)
            engine.backward(outputs)  # the ModelOutput itself: its .loss is taken
        else:
            outputs = model(**b)
            (outputs.loss / accumulation).backward()
        total += outputs.loss.item() / accumulation
        if port:
            stepped = engine.step(optimizer)
        else:
            stepped = (step + 1) % accumulation == 0
            if stepped:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if stepped:
            losses.append(total)
            total = 0.0
    val = batches[12:]
    if port:
        return losses, engine.evaluate(model, val)  # the default loss: model(**batch).loss
    model.eval()
    with torch.no_grad():
        return losses, sum(model(**b).loss.item() for b in val) / len(val)


@pytest.mark.parametrize(
    "loop", [nanogpt_loop, lstm_loop, mnist_loop, resnet_loop, gpt2_loop], ids=lambda f: f.__name__
)
def test_ported_loop_trains_exactly_as_before(loop):
    _same(loop(port=False), loop(port=True))


# ----------------------------------------------------------------------------- the Engine's side of it


def _mlp_engine(**overrides):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = Engine(overrides or None)
    model, optimizer, _ = engine.setup(model, optimizer)
    return engine, model, optimizer


def test_a_rejected_loss_leaves_the_engine_as_it_was():
    engine, model, optimizer = _mlp_engine()
    x = torch.randn(6, 4)
    with pytest.raises(TypeError, match=r"scalar tensor.*shape \(6, 1\).*loss.mean\(\)"):
        engine.backward(model(x))  # per-sample losses: not reduced
    assert engine.pending_micro_steps == 0 and engine.state.micro_step == 0
    assert all(p.grad is None for p in model.parameters())
    engine.backward(model(x).pow(2).mean())
    assert engine.step(optimizer) and engine.last_loss.shape == ()
    with pytest.raises(TypeError, match="got a str"):
        engine.backward("loss")


def test_end_epoch_applies_a_partial_window_as_the_mean_of_its_batches():
    batches = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    engine, model, optimizer = _mlp_engine(batch={"accumulation": 3})
    for x in batches:
        engine.backward(model(x).pow(2).mean())
        engine.step(optimizer)
    assert engine.state.step == 1 and engine.pending_micro_steps == 2
    assert engine.end_epoch(optimizer) and engine.state.step == 2 and engine.pending_micro_steps == 0
    partial = engine.last_loss
    # The same two batches as a window of their own (accumulation 2) give the same step.
    reference, ref_model, ref_opt = _mlp_engine(batch={"accumulation": 3})
    for x in batches[:3]:
        reference.backward(ref_model(x).pow(2).mean())
        reference.step(ref_opt)
    reference.set_accumulation(2)
    for x in batches[3:]:
        reference.backward(ref_model(x).pow(2).mean())
        reference.step(ref_opt)
    torch.testing.assert_close(partial, reference.last_loss)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert not engine.end_epoch(optimizer)  # nothing pending: no step


def test_gradient_norm_is_a_device_tensor_when_asked_for_and_clipping_stays_off():
    engine, model, optimizer = _mlp_engine(monitor={"grad_norm": True})
    loss = model(torch.randn(8, 4)).pow(2).mean()
    engine.backward(loss)
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    engine.step(optimizer)
    assert isinstance(engine.last_grad_norm, torch.Tensor) and engine.last_grad_norm.device == engine.device
    torch.testing.assert_close(engine.last_grad_norm, expected)
    assert expected > 0.01  # not clipped: the update used the raw gradients
    plain, _, _ = _mlp_engine()
    assert plain.last_grad_norm is None and not plain.window.norm_needed  # no reduction per step by default


def test_the_loader_from_setup_behaves_like_the_users():
    dataset = TensorDataset(torch.randn(10, 4))
    loader = DataLoader(dataset, batch_size=4)
    engine = Engine()
    _, _, wrapped = engine.setup(nn.Linear(4, 1), None, loader)
    assert (
        len(wrapped) == 3
        and wrapped.dataset is dataset
        and wrapped.batch_size == 4
        and wrapped.sampler is loader.sampler
    )
    assert [b[0].shape[0] for b in wrapped] == [4, 4, 2] and engine.state.samples == 10
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute
    with pytest.raises(ConfigError, match="scheduler_interval='step' | 'epoch' | 'manual'"):
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        Engine().setup(model, optimizer, scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))


# ----------------------------------------------------------------------------- monitored own loops

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_example(name: str, run_dir: Path) -> dict:
    """``python examples/NAME RUN_DIR``, in this process (a process of its own costs seconds of imports)."""
    argv, threads = sys.argv, torch.get_num_threads()
    sys.argv = [str(EXAMPLES / name), str(run_dir)]
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == records[-1]["step"]
    assert {"loss.png", "throughput.png", "lr.png"} <= {p.name for p in (run_dir / "plots").iterdir()}
    assert (run_dir / "summary.md").is_file()
    return {"records": records, "summary": summary}


def test_monitored_cnn_loop_reports_samples_per_second(tmp_path):
    run = _run_example("cnn_loop.py", tmp_path / "cnn")
    assert all(r["samples_per_s"] > 0 for r in run["records"]) and not any(
        r["tokens_per_s"] for r in run["records"]
    )
    assert all(r.get("tflops", 0) > 0 for r in run["records"])  # FLOPs counted for a model with no formula
    assert (
        run["summary"]["flops_source"] == "torch.utils.flop_counter" and run["summary"]["samples"] == 3 * 512
    )
    specs = {s.file: s for s in plots_for(run["records"])}
    assert specs["loss.png"].ylabel == "loss"  # not "nats per token": this is a classifier
    assert [s.key for s in specs["throughput.png"].series] == ["samples_per_s"]
    # engine.log("accuracy", ...) each step: the mean since the last record, in each record, the summary and a plot
    assert all(0 <= r["train_accuracy"] <= 1 for r in run["records"] if "loss" in r)
    assert run["summary"]["final_train_accuracy"] == run["records"][-1]["train_accuracy"]
    assert [s.key for s in specs["metrics.png"].series] == ["train_accuracy"]
    assert "train accuracy" in (tmp_path / "cnn" / "summary.md").read_text()


def test_monitored_hugging_face_loop_reports_tokens_per_second(tmp_path):
    pytest.importorskip("transformers")
    run = _run_example("hf_loop.py", tmp_path / "hf")
    assert all(r["tokens_per_s"] > 0 for r in run["records"])
    # steps x accumulation x batch x sequence, from input_ids
    assert run["records"][-1]["tokens"] == 20 * 2 * 8 * 64
    assert run["records"][-1]["loss"] < run["records"][0]["loss"]
    specs = {s.file: s for s in plots_for(run["records"])}
    assert "nats per token" in specs["loss.png"].ylabel and [
        s.key for s in specs["throughput.png"].series
    ] == ["tokens_per_s"]


def test_a_model_whose_flops_cannot_be_counted_is_reported_as_such(tmp_path):
    """The FLOP probe fails (the default loss does not fit this model): training goes on, and
    the report says FLOPs were not counted instead of blaming a missing datasheet peak."""
    engine, model, optimizer = _mlp_engine()
    x = torch.randn(8, 4)
    with track(engine, model, optimizer, tmp_path / "run", example_batch=(x, x), log_every=2, progress=False):
        for _ in range(6):
            engine.backward(model(x).pow(2).mean())
            engine.step(optimizer)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6] and all("tflops" not in r for r in records)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert any(NO_FLOPS in line for line in summary["report"]["skipped"])
    assert not any("datasheet" in line for line in summary["report"]["skipped"])


def test_fit_takes_dict_batches_and_calls_the_model_with_keywords():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )
    ids = torch.randint(64, (6, 4, 16))
    batches = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    engine = Engine()
    model, optimizer, _ = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fit(engine, model, optimizer, batches, max_steps=6)
    assert engine.state.step == 6 and engine.state.samples == 24 and engine.state.tokens == 24 * 16
    assert isinstance(engine.evaluate(model, batches[:2]), float)  # the default loss: model(**batch).loss


def test_own_loop_resumes_exactly_from_its_checkpoint(tmp_path):
    batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(10)]

    def train(run_dir: Path, stop_at: int | None, resume: bool = False) -> list[torch.Tensor]:
        engine, model, optimizer = _mlp_engine(batch={"accumulation": 2})
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        with track(
            engine,
            model,
            optimizer,
            run_dir,
            scheduler=scheduler,
            checkpoint_every=0,
            resume=resume,
            log_every=1,
            progress=False,
            report=False,
        ):
            for i, x in enumerate(batches):
                if i < engine.state.batches:  # the data position of a resumed run
                    continue
                engine.forward_backward(model, x, loss_fn=lambda m, b: m(b).pow(2).mean())
                if engine.step(optimizer):
                    scheduler.step()
                if stop_at is not None and engine.state.step == stop_at:
                    break
        return [p.detach().clone() for p in model.parameters()]

    whole = train(tmp_path / "whole", None)
    train(tmp_path / "split", stop_at=2)
    resumed = train(tmp_path / "split", None, resume=True)
    for a, b in zip(whole, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["resumed_from"].startswith("step_") and summary["steps"] == 5
