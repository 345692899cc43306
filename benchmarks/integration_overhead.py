"""Cost of turbotrain's callbacks inside other trainers, and what its recipe does to a Trainer run.

Four comparisons, each interleaved in ONE process (round k runs A then B, round k+1 B then A, so
drift hits both; the first round is warm-up and dropped), every run the same model, seed and data:

- ``hf``: a Hugging Face ``Trainer`` (the GPT-2 of examples/hf_trainer.py: 2 layers, d=64, 64
  tokens, batch 16) without and with :class:`~turbotrain.integrations.hf.TurbotrainCallback`;
- ``lightning``: a Lightning ``Trainer`` (the GPT of examples/lightning_module.py) without and with
  :class:`~turbotrain.integrations.lightning.TurbotrainLightningCallback`;
- ``accelerate``: an Accelerate loop (the GPT-2 of examples/accelerate_loop.py: 2 layers, d=64,
  64 tokens, batch 16) without and with :func:`~turbotrain.integrations.accelerate.track_accelerate`
  as docs/integrations.md writes it (``run.batch`` per micro-batch, ``run.step`` per step);
- ``recipe``: the ``Trainer`` with its default ``TrainingArguments`` vs
  ``training_args_recipe()`` (and which arguments the recipe changed on this machine).

Per run: the mean step time over steps 3..N (a timing callback, present in both variants and
called before turbotrain's, reads the clocks at each optimizer step's end; the first two steps, the
callback's one-off FLOP count among them, are reported apart), so logging steps' costs are in the
figure; both the wall clock and this process's CPU time (on a machine other processes load, the
wall clock counts their time slices too; CPU time counts only this process's work). Per round the
ratio B/A; reported: the median of the paired ratios and each variant's median step. For the
callbacks also their own time per step: every callback method and the batch-counting hook timed
in CPU time of the training thread, over the same steps 3..N, against the step's CPU time: the figure the
machine's noise does not blur (end-to-end ratios on the shared 2-core machine scatter by +-10 %).

    python benchmarks/integration_overhead.py --out benchmarks/results/cpu/integration_overhead.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from turbotrain.app.doctor import collect_env
from turbotrain.integrations.accelerate import track_accelerate
from turbotrain.integrations.hf import TurbotrainCallback, training_args_recipe
from turbotrain.integrations.lightning import TurbotrainLightningCallback
from turbotrain.parts.models.gpt.model import GPT, GPTConfig

SEQ = 64
TEXT = torch.tensor(list(inspect.getsource(os).encode()), dtype=torch.long)


class Windows(Dataset):
    def __init__(self) -> None:
        self.starts = range(0, len(TEXT) - SEQ - 1, SEQ)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = TEXT[self.starts[i] : self.starts[i] + SEQ]
        return {"input_ids": ids, "labels": ids}


class Clock:
    """The host clock (wall, and this process's CPU time) at each optimizer step's end."""

    def __init__(self, spent: list[float] | None = None) -> None:
        self.t: list[float] = []
        self.cpu: list[float] = []
        self.spent = spent if spent is not None else [0.0]  # the callback's own seconds so far
        self.own: list[float] = []

    def tick(self) -> None:
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.own.append(self.spent[0])

    def steady_ms(self) -> float:
        """Mean step time over steps 3..N in ms."""
        return 1000 * (self.t[-1] - self.t[1]) / (len(self.t) - 2)

    def steady_cpu_ms(self) -> float:
        """Mean CPU time of this process per step over steps 3..N in ms: on a machine other
        processes load, far steadier than the wall clock (which counts their time slices too)."""
        return 1000 * (self.cpu[-1] - self.cpu[1]) / (len(self.cpu) - 2)

    def first_ms(self) -> float:
        return 1000 * (self.t[1] - self.t[0])

    def figures(self) -> dict[str, float]:
        return {
            "steady_ms": self.steady_ms(),
            "steady_cpu_ms": self.steady_cpu_ms(),
            "first_ms": self.first_ms(),
            # the callback's own time per step over steps 3..N (its one-off FLOP count is in step 1)
            "callback_ms": 1000 * (self.own[-1] - self.own[1]) / (len(self.own) - 2),
            "callback_first_ms": 1000 * self.own[1],
        }


class HfClock(Clock, TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.tick()


class LightningClock(Clock, L.Callback):
    def __init__(self, spent: list[float] | None = None) -> None:
        super().__init__(spent)
        self._step = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.tick()


def timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # this thread's CPU time: the wall clock would count other processes' time slices too
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t0

    return wrapper


def instrument(callback: Any, names: tuple[str, ...]) -> list[float]:
    """Time every call of ``callback``'s methods ``names`` (the instance's own attributes, which
    the trainers call); returns the accumulator [seconds]."""
    spent = [0.0]
    for name in names:
        setattr(callback, name, timed(getattr(callback, name), spent))
    return spent


HF_EVENTS = ("_count", "on_step_end", "on_log", "on_evaluate", "on_save")
ACCELERATE_EVENTS = ("batch", "step")
LIGHTNING_EVENTS = ("on_train_batch_start", "on_train_batch_end", "on_validation_start", "on_validation_end")


def hf_run(steps: int, work: Path, watched: bool, recipe: bool | None = None) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2))
    base = dict(
        max_steps=steps,
        per_device_train_batch_size=16,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    kwargs = training_args_recipe("cpu", **base) if recipe else base
    callbacks: list[Any] = []
    spent = [0.0]
    if watched:
        cb = TurbotrainCallback(work / "turbotrain", report=False)
        spent = instrument(cb, HF_EVENTS)
        callbacks.append(cb)
    clock = HfClock(spent)
    callbacks.insert(0, clock)  # first: a step's tick comes before the callback's work for it
    trainer = Trainer(model=model, args=TrainingArguments(str(work), **kwargs), train_dataset=Windows())
    for c in callbacks:
        trainer.add_callback(c)
    trainer.train()
    return clock.figures()


def lightning_run(steps: int, work: Path, watched: bool) -> dict[str, float]:
    class ByteLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=64, block_size=SEQ))

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.model(*batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=2e-3)

    L.seed_everything(0, verbose=False)
    starts = torch.arange(0, len(TEXT) - SEQ - 1, SEQ)
    data = TensorDataset(
        TEXT[starts[:, None] + torch.arange(SEQ)], TEXT[starts[:, None] + torch.arange(1, SEQ + 1)]
    )
    callbacks: list[Any] = []
    spent = [0.0]
    if watched:
        cb = TurbotrainLightningCallback(work / "turbotrain", report=False, log_every=10)
        spent = instrument(cb, LIGHTNING_EVENTS)
        callbacks.append(cb)
    clock = LightningClock(spent)
    callbacks.insert(0, clock)
    trainer = L.Trainer(
        max_steps=steps,
        log_every_n_steps=10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(work),
        callbacks=callbacks,
        accelerator="cpu",
    )
    trainer.fit(ByteLM(), DataLoader(data, batch_size=16, shuffle=True))
    return clock.figures()


def accelerate_run(steps: int, work: Path, watched: bool) -> dict[str, float]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2))
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(Windows(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    run = (
        track_accelerate(accelerator, model, work / "turbotrain", log_every=10, report=False)
        if watched
        else None
    )
    clock = Clock(instrument(run, ACCELERATE_EVENTS) if run else None)
    model.train()
    while len(clock.t) < steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            clock.tick()  # first: a step's tick comes before the tracker's work for it
            if run:
                run.batch(batch)
                if accelerator.sync_gradients:
                    run.step(loss)
            if len(clock.t) == steps:
                break
    if run:
        run.close()
    return clock.figures()


def compare(name: str, a: Callable[[Path], dict], b: Callable[[Path], dict], rounds: int, steps: int) -> dict:
    """``rounds`` interleaved A/B pairs (the first dropped as warm-up): paired ratios B/A."""
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds + 1):
            order = ("a", "b") if k % 2 == 0 else ("b", "a")
            got = {}
            for which in order:
                got[which] = (a if which == "a" else b)(Path(tmp) / f"{name}-{k}-{which}")
            if k == 0:
                continue  # warm-up
            for which in ("a", "b"):
                runs[which].append(got[which])
            print(
                f"{name} round {k}: wall A {got['a']['steady_ms']:.2f} ms, B {got['b']['steady_ms']:.2f} ms, "
                f"B/A {got['b']['steady_ms'] / got['a']['steady_ms']:.4f}; CPU A {got['a']['steady_cpu_ms']:.2f} ms, "
                f"B {got['b']['steady_cpu_ms']:.2f} ms, B/A {got['b']['steady_cpu_ms'] / got['a']['steady_cpu_ms']:.4f}",
                flush=True,
            )
    ratios = [rb["steady_ms"] / ra["steady_ms"] for ra, rb in zip(runs["a"], runs["b"])]
    cpu_ratios = [rb["steady_cpu_ms"] / ra["steady_cpu_ms"] for ra, rb in zip(runs["a"], runs["b"])]
    med = lambda key, w: statistics.median(r[key] for r in runs[w])  # noqa: E731
    out = {
        "rounds": rounds,
        "steps_per_run": steps,
        "a_steady_ms_median": med("steady_ms", "a"),
        "b_steady_ms_median": med("steady_ms", "b"),
        "ratio_b_over_a_median": statistics.median(ratios),
        "ratios": ratios,
        "a_steady_cpu_ms_median": med("steady_cpu_ms", "a"),
        "b_steady_cpu_ms_median": med("steady_cpu_ms", "b"),
        "cpu_ratio_b_over_a_median": statistics.median(cpu_ratios),
        "cpu_ratios": cpu_ratios,
        "a_first_two_steps_ms_median": med("first_ms", "a"),
        "b_first_two_steps_ms_median": med("first_ms", "b"),
    }
    if any(r["callback_ms"] for r in runs["b"]):
        out["callback_own_us_per_step_median"] = 1000 * med("callback_ms", "b")
        out["callback_own_fraction_of_cpu_step_median"] = statistics.median(
            r["callback_ms"] / r["steady_cpu_ms"] for r in runs["b"]
        )
        out["callback_own_first_step_ms_median"] = med("callback_first_ms", "b")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", choices=("hf", "lightning", "accelerate", "recipe"), action="append")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: less noise on a shared machine)"
    )
    parser.add_argument("--out", type=Path)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    logging.getLogger("turbotrain").setLevel(logging.ERROR)
    only = a.only or ["hf", "lightning", "accelerate", "recipe"]
    results: dict[str, Any] = {}
    if "hf" in only:
        results["hf"] = compare(
            "hf",
            lambda w: hf_run(a.steps, w, False),
            lambda w: hf_run(a.steps, w, True),
            a.rounds,
            a.steps,
        )
    if "lightning" in only:
        results["lightning"] = compare(
            "lightning",
            lambda w: lightning_run(a.steps, w, False),
            lambda w: lightning_run(a.steps, w, True),
            a.rounds,
            a.steps,
        )
    if "accelerate" in only:
        results["accelerate"] = compare(
            "accelerate",
            lambda w: accelerate_run(a.steps, w, False),
            lambda w: accelerate_run(a.steps, w, True),
            a.rounds,
            a.steps,
        )
    if "recipe" in only:
        defaults = TrainingArguments("unused")
        changed = {
            k: {"default": getattr(defaults, k), "recipe": v}
            for k, v in training_args_recipe("cpu").items()
            if getattr(defaults, k) != v and str(getattr(getattr(defaults, k), "value", "")) != str(v)
        }
        results["recipe"] = {
            "changed": changed,
            **compare(
                "recipe",
                lambda w: hf_run(a.steps, w, False, recipe=False),
                lambda w: hf_run(a.steps, w, False, recipe=True),
                a.rounds,
                a.steps,
            ),
        }
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {
        "what": "A = without (recipe: the Trainer's defaults), B = with the callback (recipe: training_args_recipe); "
        "B/A per round, median",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "results": results,
        "env": collect_env(),
    }
    print(json.dumps(results, indent=2, default=str))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        a.out.with_suffix(".md").write_text(markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    """The figures of ``doc`` as a table (every number from the JSON beside it)."""
    names = {
        "hf": "HF Trainer: without / with TurbotrainCallback",
        "lightning": "Lightning: without / with TurbotrainLightningCallback",
        "accelerate": "Accelerate loop: without / with track_accelerate",
        "recipe": "HF Trainer: default TrainingArguments / training_args_recipe()",
    }
    lines = [
        "# Integration overhead (CPU)",
        "",
        f"`{doc['command']}` at commit `{doc['commit']}`; {doc['env'].get('cpu', {}).get('model', '')}",
        "",
        "| comparison (A / B) | rounds x steps | wall ms/step A, B | CPU ms/step A, B | B/A wall (median) "
        "| B/A CPU (median) | callback's own us/step | own / CPU step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in doc["results"].items():
        own = r.get("callback_own_us_per_step_median")
        frac = r.get("callback_own_fraction_of_cpu_step_median")
        lines.append(
            f"| {names[key]} | {r['rounds']} x {r['steps_per_run']} | {r['a_steady_ms_median']:.1f}, "
            f"{r['b_steady_ms_median']:.1f} | {r['a_steady_cpu_ms_median']:.2f}, {r['b_steady_cpu_ms_median']:.2f} | "
            f"{r['ratio_b_over_a_median']:.3f} | {r['cpu_ratio_b_over_a_median']:.3f} | "
            + (f"{own:.0f} | {100 * frac:.2f} % |" if own is not None else "- | - |")
        )
    recipe = doc["results"].get("recipe")
    if recipe is not None:
        changed = ", ".join(f"{k}: {v['default']} -> {v['recipe']}" for k, v in recipe["changed"].items())
        lines += ["", f"What the recipe changed against the Trainer's defaults here: {changed or 'nothing'}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
