"""Exact resume where the run draws random numbers: a run stopped and resumed trains on the same
numbers as the run that was never stopped, bit for bit (README: "the same losses bit for bit").

The workload (resume_workload.py) draws from torch's generator (dropout), Python's ``random`` and
numpy's in the main process (loss noise) and from all three in DataLoader workers (an
augmentation), with gradient accumulation 2, so a resume that forgets a generator's state or
starts the data at the wrong micro-batch shows in the per-step losses a user reads in
``metrics.jsonl``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import turbotrain.loop.checkpoint as checkpoint
from turbotrain import Engine, fit
from turbotrain.cli import main
from turbotrain.loop.checkpoint import Checkpointer, finished_checkpoints, run_state
from turbotrain.loop.hooks import FitContext, Hook

WORKLOAD = f"{Path(__file__).with_name('resume_workload.py')}:make"
RUN = [
    "--train.max_steps=6",
    "--train.eval_every=0",
    "--monitor.log_every=1",
    "--no-progress",
    "--batch.micro=8",
    "--batch.accumulation=2",
    "--data.num_workers=2",
]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_stopped_and_resumed_run_with_dropout_augmentation_and_accumulation_equals_the_unstopped_one(
    tmp_path: Path,
) -> None:
    out = ["--run.out_dir", str(tmp_path)]
    assert main(["train", "--model", WORKLOAD, *RUN, *out, "--run.name=full"]) == 0
    assert (
        main(["train", "--model", WORKLOAD, *RUN, *out, "--run.name=split", "--train.stop_after_steps=3"])
        == 0
    )
    assert main(["train", "--resume", str(tmp_path / "split"), "--no-progress"]) == 0
    full = {r["step"]: r["loss"] for r in _records(tmp_path / "full") if "loss" in r}
    split = {r["step"]: r["loss"] for r in _records(tmp_path / "split") if "loss" in r}
    assert sorted(full) == sorted(split) == [1, 2, 3, 4, 5, 6]
    assert split == full  # floats read back from metrics.jsonl: equal to the bit, steps 4-6 after the resume
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("full", "split")]
    assert (
        summaries[1]["resumed_from"] and summaries[0]["final_train_loss"] == summaries[1]["final_train_loss"]
    )


class _Weights(Hook):
    """Each step's weights as training left them, and whether a checkpoint write was still in
    flight when the step ended (so the next checkpoint was asked for during a write)."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer
        self.at: dict[int, dict[str, torch.Tensor]] = {}
        self.overlapped = 0

    def on_step_end(self, ctx: FitContext) -> None:
        self.at[ctx.engine.state.step] = {k: v.clone() for k, v in ctx.model.state_dict().items()}
        background = self.checkpointer.background
        self.overlapped += bool(background is not None and background.in_flight)


def test_each_background_checkpoint_holds_its_own_steps_weights_while_writes_overlap_training(
    tmp_path: Path, monkeypatch
) -> None:
    # train.async_checkpoint (the default): a write slower than a step, so the next step's checkpoint
    # is asked for while the previous one is still being written; each file must hold its own step
    original = checkpoint.save_checkpoint

    def slow(*args, **kwargs):
        # a slow disk: the writer thread is still here when the next step ends (a step: ~1 ms)
        time.sleep(0.3)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", slow)
    torch.manual_seed(0)
    engine = Engine({"run": {"device": "cpu"}, "optim": {"grad_clip": 0.0}})
    plain = torch.nn.Linear(4, 2)
    model, optimizer, _ = engine.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(5)]
    saver = Checkpointer(tmp_path, 1, 10, run_state(engine, model, optimizer), async_write=True)
    weights = _Weights(saver)
    fit(
        engine,
        model,
        optimizer,
        batches,
        max_steps=5,
        hooks=[weights, saver],
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
    )
    assert weights.overlapped >= 3  # steps 2-4 ended with the previous step's write in flight
    files = finished_checkpoints(tmp_path)
    assert [p.name for p in files] == [f"step_{s:08d}.pt" for s in range(1, 6)]
    for path, step in zip(files, range(1, 6)):
        saved = torch.load(path, weights_only=True)["model"]
        assert saved.keys() == weights.at[step].keys()
        assert all(torch.equal(saved[k], v) for k, v in weights.at[step].items()), (
            f"{path.name} holds another step's weights"
        )
