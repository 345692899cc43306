"""Evaluation / inference throughput (``turbotrain bench --inference``): ``loss_fn(model, batch)``
under inference_mode, set up by the Engine and timed on the kit's clock (``time_call``), warm-up apart."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import cycle, islice
from typing import Any

import torch
from torch import nn

from ...base.batch import batch_size, move_to, token_count
from ...base.config import load_config
from ...core.engine import Engine, LossFn, default_loss
from ...core.meter.clock import time_call
from ...core.meter.table import DASH, render_table
from ...core.meter.trial import copy_on
from ...parts.hardware import device_name
from ...parts.models.registry import spec_for
from ...parts.workload import load_workload
from ...tools.memory.stats import default_vocab_size

SCHEMA = "turbotrain-bench-inference/1"


def benchmark_inference(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    loss_fn: LossFn = default_loss,
    iterations: int = 20,
    warmup: int = 3,
    config: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Time ``iterations`` evaluation batches (cycled) of a copy of ``model`` under inference_mode
    with ``config``'s precision and compile (default: turbotrain's for this device)."""
    engine = Engine(dict(config or {}))
    net, _ = copy_on(engine, model)
    net.eval()
    data = [move_to(b, engine.device) for b in islice(cycle(batches), warmup + iterations)]
    last: list[Any] = [None]

    def step(batch: Any) -> None:
        last[0] = loss_fn(net, batch)

    with torch.inference_mode(), engine.autocast():
        first = time_call(lambda: step(data[0]), engine.device, 1, warmup=0) if warmup else None
        for batch in data[1:warmup]:
            step(batch)
        rest = iter(data[warmup:])
        timing = time_call(lambda: step(next(rest)), engine.device, iterations, warmup=0)
    ms = timing.median
    timed = data[warmup:]
    samples = sum(batch_size(b) for b in timed) / len(timed)
    tokens = sum(token_count(b) for b in timed) / len(timed)
    out = last[0]
    loss = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, tuple) else None
    return {
        "iterations": iterations,
        "warmup": warmup,
        "ms_per_batch": ms,
        "ms_per_batch_all": list(timing.ms),
        "ms_per_batch_spread": timing.spread,
        "samples_per_batch": samples,
        "samples_per_s": samples / (ms / 1000),
        "tokens_per_s": tokens / (ms / 1000) if tokens else None,
        "first_batch_s": (first or timing).ms[0] / 1000,
        "precision": engine.precision.name,
        "compile": engine.options.compile_scope,
        "device": engine.device.type,
        "device_name": device_name(engine.device),
        "last_loss": float(loss.float()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None,
    }


def inference_target(
    preset: str | None,
    model: str | None,
    overrides: Mapping[str, Mapping[str, Any]],
    batch: int | None = None,
) -> tuple[nn.Module, list[Any], LossFn, str]:
    """(model, batches, loss function, label) for ``--model FILE.py:FUNC`` (its eval_loader, else
    its train_loader) or a preset (its model on random tokens of ``batch`` or the preset's micro-batch)."""
    if model:
        w = load_workload(model, seed=0)
        loader = w.eval_loader if w.eval_loader is not None else w.train_loader
        return w.model, list(islice(loader, 8)), w.loss_fn or default_loss, model
    config = load_config(preset, overrides)
    spec, vocab = spec_for(config), default_vocab_size(config)
    torch.manual_seed(config.run.seed)
    net = spec.build_model(config, vocab)
    micro = batch or (config.batch.micro if isinstance(config.batch.micro, int) else 8)
    make = spec.random_batch(config, vocab, torch.device("cpu"), seed=config.run.seed)
    return net, [make(micro) for _ in range(4)], default_loss, config.preset or str(preset)


def render_inference(doc: dict[str, Any]) -> str:
    """The markdown table of the rows."""
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("model", lambda r: r["label"]),
        ("device", lambda r: r["device_name"]),
        ("precision", lambda r: r["precision"]),
        ("compile", lambda r: r["compile"]),
        ("batch", lambda r: f"{r['samples_per_batch']:.0f}"),
        ("ms/batch (median)", lambda r: f"{r['ms_per_batch']:.2f}"),
        ("samples/s", lambda r: f"{r['samples_per_s']:,.0f}"),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else DASH),
        ("first batch s", lambda r: f"{r['first_batch_s']:.2f}"),
    ]
    title = "## turbotrain bench --inference: evaluation forward (and loss) under inference_mode"
    lines = [title, "", render_table(doc["rows"], columns)]
    if doc.get("load_avg_1m") is not None:
        lines += [
            "",
            f"{doc['threads']} thread(s); load average {doc['load_avg_1m']:.1f} when the rows ended "
            "(a shared CPU: other processes' work slows the figures)",
        ]
    return "\n".join(lines)
