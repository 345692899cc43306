"""The Hugging Face callback's record around evaluations, saves, crashes and resumes (issue 46 items
2, 3 and 6; issue 44 item 10): the throughput after a step that evaluates and saves matches an
independent clock; ``resume_from_checkpoint`` after a crash leaves each step once in metrics.jsonl
and the uninterrupted run's samples and tokens in summary.json; a crashed run's summary says it
failed; runs are named after the output directory.

Tiny models (a linear layer that sleeps a known time per forward; a 1-layer GPT-2 of width 16)
and 6 to 10 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_S
from torch.utils.data import Dataset

pytest.importorskip("transformers")

from test_integrations import Tokens  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from turbotrain.integrations.hf import TurbotrainCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TRAIN_S, EVAL_S = 0.15, 0.1  # seconds a forward of the sleeping model takes (training, evaluation)


class Sleeper(torch.nn.Module):
    """A linear regression whose forward takes a known time: steps that the clocks can agree on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(TRAIN_S if self.training else EVAL_S)
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class WindowClock(TrainerCallback):
    """An independent clock of each logging window's training time: from the end of the last
    thing that was not training (the previous step's record, an evaluation, a checkpoint) to
    this step's record, by the Trainer's own events (registered after turbotrain's callback)."""

    def __init__(self) -> None:
        self.since, self.took = 0.0, {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.since = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}):
            self.took[state.global_step] = time.perf_counter() - self.since
        self.since = time.perf_counter()

    def on_evaluate(self, args, state, control, **kwargs):
        self.since = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        self.since = time.perf_counter()


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_throughput_after_a_step_that_evaluates_and_saves(tmp_path):
    """(#46 item 2) Evaluation and a checkpoint at steps 3 and 6, a record every step: every
    window's step_ms within 10 % of the independent clock (the evaluation and the save left
    out once, not twice)."""
    clock = WindowClock()
    callback = TurbotrainCallback(report=False, nvml=False)
    args = TrainingArguments(
        str(tmp_path / "evalsave"),
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        per_device_eval_batch_size=4,
        remove_unused_columns=False,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        model=Sleeper(), args=args, train_dataset=Rows(64), eval_dataset=Rows(12), callbacks=[callback, clock]
    )
    trainer.train()
    timed = {r["step"]: r["step_ms"] for r in records(tmp_path / "evalsave" / "turbotrain") if "step_ms" in r}
    assert sorted(timed) == [2, 3, 4, 5, 6]  # step 1's time is the time to first step
    for step, ms in timed.items():  # one step a window; each sleeps TRAIN_S in its forward
        assert ms == pytest.approx(1000 * clock.took[step], rel=0.10) and ms > 1000 * TRAIN_S, (step, ms)
    assert [r["step"] for r in records(tmp_path / "evalsave" / "turbotrain") if "val_loss" in r] == [3, 6]
    assert callback.summary["run"] == "evalsave"  # (#46 item 6) the output directory, not "turbotrain"


class CrashAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"boom at step {self.step}")


def gpt_train(out: Path, callbacks: list, resume: str | None = None) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(
        str(out),
        max_steps=10,
        per_device_train_batch_size=4,
        logging_steps=2,
        save_strategy="steps",
        save_steps=4,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=callbacks).train(
        resume_from_checkpoint=resume
    )


def test_resume_from_checkpoint_after_a_crash_records_each_step_once(tmp_path):
    """(#46 item 3) A crash at step 7 after the checkpoint of step 4, then
    ``resume_from_checkpoint``: metrics.jsonl has each logging step once, with the uninterrupted
    run's losses; summary.json the uninterrupted run's steps, samples and tokens."""
    whole = TurbotrainCallback(report=False, nvml=False)
    gpt_train(tmp_path / "whole", [whole])
    with pytest.raises(RuntimeError, match="boom at step 7"):
        gpt_train(tmp_path / "crashed", [TurbotrainCallback(report=False, nvml=False), CrashAt(7)])
    resumed = TurbotrainCallback(report=False, nvml=False)
    gpt_train(tmp_path / "crashed", [resumed], resume=str(tmp_path / "crashed" / "checkpoint-4"))
    steps = [r for r in records(tmp_path / "crashed" / "turbotrain") if "event" not in r]
    expected = [r for r in records(tmp_path / "whole" / "turbotrain") if "event" not in r]
    assert [r["step"] for r in steps] == [r["step"] for r in expected] == [2, 4, 6, 8, 10]
    assert [r["loss"] for r in steps] == [r["loss"] for r in expected]
    assert [(r["samples"], r["tokens"]) for r in steps] == [(r["samples"], r["tokens"]) for r in expected]
    summary = json.loads((tmp_path / "crashed" / "turbotrain" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert (summary["steps"], summary["samples"], summary["tokens"]) == (10, 10 * 4, 10 * 4 * 16)
    assert (whole.summary["samples"], whole.summary["tokens"]) == (summary["samples"], summary["tokens"])


CRASHING_SCRIPT = """
import sys, torch
sys.path[:0] = [{tests!r}, {shared!r}]  # this folder, and tests/ for the conftest it imports
from test_integrations_hf import CrashAt, gpt_train
from turbotrain.integrations.hf import TurbotrainCallback
gpt_train(__import__("pathlib").Path({out!r}), [TurbotrainCallback(report=False, nvml=False), CrashAt(3)])
"""


@pytest.mark.slow
def test_a_crashed_trainer_run_leaves_a_failed_summary(tmp_path):
    """(#44 item 10) A script whose Trainer raises at step 3: the process ends with the error and
    summary.json says ``failed: RuntimeError: boom at step 3``, as Lightning's and Accelerate's
    do, with the records up to the crash."""
    here = Path(__file__).parent
    script = CRASHING_SCRIPT.format(tests=str(here), shared=str(here.parent), out=str(tmp_path / "out"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 1 and "RuntimeError: boom at step 3" in done.stderr
    summary = json.loads((tmp_path / "out" / "turbotrain" / "summary.json").read_text())
    assert summary["status"] == "failed: RuntimeError: boom at step 3"
    assert summary["steps"] == 3 and summary["samples"] == 3 * 4
    assert [r["step"] for r in records(tmp_path / "out" / "turbotrain")] == [2]
