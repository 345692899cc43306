"""The Accelerate loop exactly as docs/integrations.md writes it (issue 46 item 1): with dropout on
and a shuffling loader seeded from the global RNG, or from its own generator, the loop trains the
same batches with the same dropout masks with and without turbotrain (every loss and the final
weights bit for bit), and the run still records FLOPs, TFLOP/s and MFU.

A 1-layer GPT-2 of width 16, 8 optimizer steps of 2 micro-batches: a second or two each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from test_integrations import Tokens  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from turbotrain.integrations.accelerate import accelerator_kwargs_recipe, track_accelerate  # noqa: E402
from turbotrain.integrations.recipe import build_recipe  # noqa: E402

STEPS = 8  # optimizer steps, 2 micro-batches each
PEAK = 0.01  # TFLOP/s: a stand-in peak so this CPU gets an MFU


def docs_loop(run_dir: Path | None, own_generator: bool) -> tuple[list[float], GPT2LMHeadModel]:
    """docs/integrations.md's "An Accelerate loop", line for line (with ``run_dir`` None: the same
    loop without turbotrain's lines). Returns every micro-batch's loss and the model."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    assert config.resid_pdrop > 0 and config.attn_pdrop > 0  # dropout on: the RNG is in play
    model = GPT2LMHeadModel(config)
    recipe = build_recipe("cpu")
    accelerator = Accelerator(**accelerator_kwargs_recipe("cpu", cpu=True, gradient_accumulation_steps=2))
    generator = {"generator": torch.Generator().manual_seed(7)} if own_generator else {}
    loader = DataLoader(Tokens(64), batch_size=4, shuffle=True, **generator, **recipe.loader_kwargs())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, **recipe.optimizer_kwargs())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen: list[float] = []
    run = track_accelerate(accelerator, model, run_dir, log_every=4, peak_tflops=PEAK) if run_dir else None
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        seen.append(loss.item())  # host-device sync point: the test's record of every loss
        if run:
            run.batch(batch)
            if accelerator.sync_gradients:
                run.step(loss)
        if len(seen) == 2 * STEPS:
            break
    if run:
        run.close()
    return seen, accelerator.unwrap_model(model)


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-rng", "own-generator"])
def test_the_documented_accelerate_loop_trains_exactly_as_without_turbotrain(tmp_path, own_generator):
    plain_losses, plain = docs_loop(None, own_generator)
    losses, watched = docs_loop(tmp_path / "run", own_generator)
    assert losses == plain_losses and len(losses) == 2 * STEPS  # same batches, same dropout masks
    assert all(torch.equal(p, q) for p, q in zip(watched.state_dict().values(), plain.state_dict().values()))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["flops_per_sample"] > 0 and summary["samples"] == 2 * STEPS * 4
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8]
    assert all(r["tflops"] > 0 and r["mfu"] == pytest.approx(r["tflops"] / PEAK) for r in records)
