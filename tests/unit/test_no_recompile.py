"""Evaluation and the batch-size search leave the compiled training graph alone: they run the
model eagerly, so training compiles one graph, for the size found, and never again.

The model is compiled with dynamo's ``eager`` backend (no Inductor: seconds, not minutes);
dynamo's frame counters and guard failures are the same whatever the backend."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_overrides

from turbotrain import Engine, load_config
from turbotrain.core.compile_guard import collect_compile_counts
from turbotrain.parts.models.gpt import GPT, GPTConfig
from turbotrain.tools.memory import resolve_batch_size, token_batches


@pytest.mark.slow
def test_eval_and_the_batch_search_never_recompile_the_training_graph(tmp_path, monkeypatch):
    monkeypatch.setattr(
        torch._dynamo, "reset", lambda: pytest.fail("the search must not drop compiled graphs")
    )
    config = load_config(overrides=tiny_overrides(tmp_path, batch={"micro": "auto"}))
    engine = Engine(config)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=16, block_size=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, _ = engine.setup(model, optimizer)
    model.compile(backend="eager", dynamic=False)  # any other batch size or mode would be a new graph
    start = collect_compile_counts()

    config, search = resolve_batch_size(config, engine, model, optimizer, max_micro=8)
    assert search is not None and [t.micro for t in search.trials][:3] == [1, 2, 4]
    assert collect_compile_counts().minus(start).frames == 0  # the trial sizes ran eagerly

    make = token_batches(64, 32, engine.device)

    def train(steps: int) -> None:
        for _ in range(steps):
            engine.backward(model(*make(config.batch.micro)))
            engine.step(optimizer)

    train(2)
    trained = collect_compile_counts().minus(start)
    assert trained.frames >= 1 and trained.recompiles == 0  # one graph, for the size found
    val_loss = engine.evaluate(model, [make(3), make(5)])  # other sizes, eval mode, no_grad
    assert val_loss > 0 and model.training
    train(2)
    after = collect_compile_counts().minus(start)
    assert (after.frames, after.recompiles) == (trained.frames, 0)
