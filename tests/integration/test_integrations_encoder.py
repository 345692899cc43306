"""A BERT-style encoder classifier (examples/bert_classifier.py: padded batches with attention
masks) through `turbotrain train --model`, the Hugging Face callback and the Accelerate tracker
(issue 46 item 7), with the decoders' parity checks: the same training with and without
turbotrain (bit for bit), an exact resume, FLOPs counted on the padded batch, and tokens counted
from the attention mask, not the padded shape.

96 training lines (one epoch of 6 steps of 16), so the tokens trained are every line's once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from test_integrations import same_weights  # noqa: E402
from test_train_model import QUICK, _losses, _stopped_and_resumed  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from turbotrain.integrations.accelerate import track_accelerate  # noqa: E402
from turbotrain.integrations.hf import TurbotrainCallback  # noqa: E402
from turbotrain.loop.monitor.flops import count_flops_per_sample  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from bert_classifier import SEQ, build_model, datasets  # noqa: E402

ROWS, BATCH = 96, 16
STEPS = ROWS // BATCH  # one epoch
PEAK = 0.01  # TFLOP/s: a stand-in peak so this CPU gets an MFU


def real_tokens() -> int:
    """The tokens of the 96 training lines, padding left out (what every run must count)."""
    return int(datasets(ROWS)[0].mask.sum())


def padded_flops() -> float:
    """Training FLOPs per sample of a padded batch of 16 (what the model computes)."""
    train = datasets(ROWS)[0]
    batch = {
        "input_ids": train.ids[:BATCH],
        "attention_mask": train.mask[:BATCH],
        "labels": train.labels[:BATCH],
    }
    return count_flops_per_sample(build_model(), batch)


def check_counts(run: Path, summary: dict) -> None:
    """Samples and tokens of the epoch, tokens from the masks; TFLOP/s from the padded FLOPs."""
    assert summary["samples"] == ROWS and summary["tokens"] == real_tokens() < ROWS * SEQ
    assert summary["flops_per_sample"] == pytest.approx(padded_flops(), rel=1e-6)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("samples_per_s")]
    assert timed and all(r["tokens_per_s"] < r["samples_per_s"] * SEQ for r in timed)  # real tokens only
    for r in timed:  # the compute rate is the padded samples' (tokens/s would undercount it)
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * summary["flops_per_sample"] / 1e12, rel=1e-6)


WORKLOAD = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
from bert_classifier import make


def small():
    return make(rows={ROWS})
"""


@pytest.mark.slow  # three runs of the CLI, with evaluations and checkpoints
def test_the_encoder_through_turbotrain_train_resumes_exactly_and_counts_real_tokens(tmp_path):
    (tmp_path / "bert_small.py").write_text(WORKLOAD)
    assert "--train.max_steps=6" in QUICK and STEPS == 6
    full, split, run, resumed = _stopped_and_resumed(tmp_path / "runs", f"{tmp_path / 'bert_small.py'}:small")
    assert split["resumed_from"] and _losses(resumed) == _losses(run)  # the decoders' parity, to the bit
    assert split["final_val_loss"] == full["final_val_loss"] and 0 <= full["final_val_accuracy"] <= 1
    check_counts(run, full)
    assert (split["samples"], split["tokens"]) == (full["samples"], full["tokens"])


def hf_train(out: Path, callbacks: list) -> tuple[list, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model()
    args = TrainingArguments(
        str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=datasets(ROWS)[0], callbacks=callbacks)
    trainer.train()
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h], model


def test_the_encoder_with_the_hf_callback_trains_the_same_and_counts_real_tokens(tmp_path):
    plain_losses, plain = hf_train(tmp_path / "plain", [])
    callback = TurbotrainCallback(report=False, nvml=False, peak_tflops=PEAK)
    losses, watched = hf_train(tmp_path / "watched", [callback])
    assert losses == plain_losses and len(losses) == STEPS // 2 and same_weights(watched, plain)
    check_counts(tmp_path / "watched" / "turbotrain", callback.summary)


def accelerate_train(run_dir: Path | None) -> torch.nn.Module:
    """docs/integrations.md's Accelerate loop (dropout on, a shuffling loader)."""
    torch.manual_seed(0)
    model = build_model()
    accelerator = Accelerator(cpu=True)
    loader = DataLoader(datasets(ROWS)[0], batch_size=BATCH, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    run = track_accelerate(accelerator, model, run_dir, log_every=2, peak_tflops=PEAK) if run_dir else None
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if run:
            run.batch(batch)
            if accelerator.sync_gradients:
                run.step(loss)
    if run:
        run.close()
    return accelerator.unwrap_model(model)


def test_the_encoder_in_an_accelerate_loop_trains_the_same_and_counts_real_tokens(tmp_path):
    plain = accelerate_train(None)
    watched = accelerate_train(tmp_path / "run")
    assert same_weights(watched, plain)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == STEPS
    check_counts(tmp_path / "run", summary)
