"""turbotrain inside other trainers (issue 36): a Hugging Face ``Trainer`` and a Lightning ``Trainer``
with turbotrain's callback train exactly as without it (the same losses and weights, bit for bit on
CPU) and leave a run directory with metrics, summary (MFU in it) and plots; an Accelerate loop
with ``track_accelerate`` the same; the three examples run.

Tiny models (a 1-layer GPT-2 of width 16, a 2-layer MLP) and a few dozen steps keep each case at
a few seconds.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from turbotrain.integrations.accelerate import accelerator_kwargs_recipe, track_accelerate  # noqa: E402
from turbotrain.integrations.hf import TurbotrainCallback, training_args_recipe  # noqa: E402
from turbotrain.integrations.lightning import TurbotrainLightningCallback, trainer_kwargs_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16  # optimizer steps (x2 micro-batches): 4 records, 3 steady windows
PEAK = 0.01  # TFLOP/s: a stand-in peak so this CPU gets an MFU (no datasheet for CPUs)


class Tokens(Dataset):
    def __init__(self, n: int = 96, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_run(out: Path, callbacks: list) -> tuple[Trainer, GPT2LMHeadModel]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    return trainer, model


def tiny_hf_args(out: Path, **more: Any) -> TrainingArguments:
    """A Trainer's arguments for a few CPU steps logged every 2, nothing saved or reported."""
    return TrainingArguments(
        str(out),
        **{
            "per_device_train_batch_size": 4,
            "logging_steps": 2,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "use_cpu": True,
            **more,
        },
    )


def losses(trainer: Trainer) -> list[tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def check_run_dir(run: Path, steps: int, every: int) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(every, steps + 1, every))
    assert all(r["samples_per_s"] > 0 and r["tflops"] > 0 for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == steps
    steady = summary["steady_state"]
    assert steady["mfu"] == pytest.approx(steady["tflops"] / PEAK)  # MFU in the summary
    assert summary["flops_per_sample"] > 0 and summary["compile"]["frames_compiled"] == 0
    assert "| MFU |" in (run / "summary.md").read_text()
    assert {"loss.png", "throughput.png", "mfu.png"} <= {p.name for p in (run / "plots").iterdir()}
    return summary


def test_hf_callback_trains_the_same_and_writes_the_run_directory(tmp_path):
    plain, plain_model = hf_run(tmp_path / "plain", [])
    callback = TurbotrainCallback(tmp_path / "run", peak_tflops=PEAK)
    watched, watched_model = hf_run(tmp_path / "watched", [callback])
    assert losses(watched) == losses(plain) and len(losses(plain)) == STEPS // 4  # bit for bit
    assert same_weights(watched_model, plain_model)
    summary = check_run_dir(tmp_path / "run", STEPS, 4)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(s, loss) for s, loss, _ in losses(plain)]
    assert summary["samples"] == STEPS * 8 and summary["tokens"] == STEPS * 8 * 16  # counted from shapes
    # GPT-2 counted by torch's FLOP counter: at least 6 x the matmul parameters per token
    matmul_params = sum(p.numel() for n, p in plain_model.named_parameters() if n.endswith("attn.weight"))
    assert summary["flops_per_sample"] > 6 * matmul_params * 16


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.seen: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.seen.append(loss.item())  # host-device sync point: the test's record of every loss
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def lightning_run(callbacks: list, root: Path) -> MLP:
    L.seed_everything(0, verbose=False)
    model = MLP()
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    trainer = L.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=2,
        log_every_n_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=callbacks,
        **trainer_kwargs_recipe("cpu"),
    )
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    return model


def test_lightning_callback_trains_the_same_and_writes_the_run_directory(tmp_path):
    plain = lightning_run([], tmp_path / "plain")
    watched = lightning_run([TurbotrainLightningCallback(tmp_path / "run", peak_tflops=PEAK)], tmp_path / "w")
    assert watched.seen == plain.seen and len(plain.seen) == 2 * STEPS  # every micro-batch, bit for bit
    assert same_weights(watched, plain)
    summary = check_run_dir(tmp_path / "run", STEPS, 4)
    assert summary["samples"] == STEPS * 16
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the loss of each record's step's last micro-batch, as training_step returned it
    assert [r["loss"] for r in records] == pytest.approx(
        [plain.seen[2 * r["step"] - 1] for r in records], rel=1e-6
    )
    # FLOPs of the first step, counted as it ran: 6 x the weights per sample (forward + backward;
    # the first layer's input gradient is not needed: 2 x 16 x 32 fewer)
    assert summary["flops_per_sample"] == 6 * (16 * 32 + 32) - 2 * 16 * 32


def test_accelerate_loop_tracked_trains_the_same(tmp_path):
    from accelerate import Accelerator

    def run(run_dir: Path | None) -> torch.nn.Module:
        torch.manual_seed(0)
        accelerator = Accelerator(**accelerator_kwargs_recipe("cpu", cpu=True))
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(Tokens(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        batches = list(loader)[:STEPS]
        tracker = (
            track_accelerate(
                accelerator, model, run_dir, example_batch=batches[0], log_every=4, peak_tflops=PEAK
            )
            if run_dir
            else None
        )
        for batch in batches:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if tracker:
                tracker.batch(batch)
                tracker.step(loss)
        if tracker:
            tracker.close()
        return model

    assert same_weights(run(tmp_path / "run"), run(None))
    check_run_dir(tmp_path / "run", STEPS, 4)


def test_recipe_arguments_are_accepted_and_yours_win(tmp_path, caplog):
    kwargs = training_args_recipe("cpu", dataloader_num_workers=2, optim="adamw_torch")
    # this CPU: fp32, fused AdamW, no pinning; the workers you gave set the recipe's persistence aside
    assert kwargs["bf16"] is False and kwargs["fp16"] is False and "tf32" not in kwargs
    assert kwargs["optim"] == "adamw_torch" and kwargs["dataloader_num_workers"] == 2
    assert "dataloader_persistent_workers" not in kwargs and kwargs["dataloader_pin_memory"] is False
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "optim = 'adamw_torch_fused'; you set optim = 'adamw_torch': yours is kept" in m for m in lines
    )
    assert any("dataloader_num_workers = 0; you set dataloader_num_workers = 2" in m for m in lines)
    TrainingArguments(str(tmp_path), use_cpu=True, **kwargs)  # transformers accepts every one
    assert trainer_kwargs_recipe("cpu") == {"precision": "32-true", "benchmark": False}
    assert accelerator_kwargs_recipe("cpu") == {"mixed_precision": "no", "dynamo_backend": "no"}


@pytest.mark.parametrize("example", ["hf_trainer.py", "lightning_module.py", "accelerate_loop.py"])
def test_example_runs(example, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [example, str(tmp_path), "--steps", "5"])
    runpy.run_path(str(ROOT / "examples" / example), run_name="__main__")
    summary = json.loads((tmp_path / "turbotrain" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 5 and summary["tokens"] > 0
    assert (tmp_path / "turbotrain" / "summary.md").is_file()


def test_hf_callback_records_the_steps_after_the_trainers_last_logging_step(tmp_path):
    """5 steps logged every 2: records at 2 and 4 (the Trainer's loss), and one at 5 for the step
    after the last logging step (its throughput; no loss, the Trainer logged none)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    args = tiny_hf_args(tmp_path / "out", max_steps=5)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[TurbotrainCallback(tmp_path / "run", report=False)],
    )
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 5]
    assert [r["loss"] for r in records[:2]] == [loss for _, loss, _ in losses(trainer)] and records[2].get(
        "loss"
    ) is None
    assert records[2]["samples_per_s"] > 0


def test_hf_callback_is_invisible_to_torch_compile(tmp_path):
    """With the Trainer's torch_compile (dynamo with its eager backend: no code generation, fast),
    the callback's batch-counting hook adds no recompilation or graph break, counts every sample,
    and the summary reports what dynamo did."""
    import torch._dynamo

    from turbotrain.core.compile_guard import collect_compile_counts

    def run(callbacks: list) -> tuple[list, object]:
        torch._dynamo.reset()
        before = collect_compile_counts()
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        args = tiny_hf_args(tmp_path / "out", max_steps=6, torch_compile=True, torch_compile_backend="eager")
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
        trainer.train()
        return losses(trainer), collect_compile_counts().minus(before)

    plain_losses, plain = run([])
    callback = TurbotrainCallback(tmp_path / "run", report=False)
    watched_losses, watched = run([callback])
    assert watched_losses == plain_losses
    # frames compiled differ by what an earlier run in this process left cached, so compare what
    # the hook could add: recompilations and graph breaks (the Trainer's own logging call's, both)
    assert plain.frames > 0 and watched.frames > 0
    assert (watched.recompiles, watched.break_reasons) == (plain.recompiles, plain.break_reasons)
    summary = callback.summary
    assert summary["samples"] == 6 * 4 and summary["compile"]["frames_compiled"] == watched.frames
    assert summary["compile"]["graph_breaks"] == watched.graph_breaks
