"""Early stopping and the best checkpoint as hooks (what ``fit`` users pass; ``turbotrain train``
builds the same ones): which pass improves, when the fit stops, the best checkpoint of either kind
beside keep_last=1, and checkpoints saved before the watch existed still loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from turbotrain import Engine, fit
from turbotrain.app.training import train
from turbotrain.base.config import audience, load_config
from turbotrain.base.errors import ConfigError, TurbotrainError
from turbotrain.cli import main
from turbotrain.loop.best_checkpoint import KeepBest, best_checkpoint, load_best_weights, restore_best
from turbotrain.loop.checkpoint import (
    Checkpointer,
    RunState,
    list_checkpoints,
    restore_latest,
    run_state,
    save_checkpoint,
)
from turbotrain.loop.early_stop import EarlyStopping, MetricWatch
from turbotrain.loop.hooks import FitContext, Hook


class _Scripted(Hook):
    """Stands in for Evaluate: at each of ``values``' steps a validation pass with that value."""

    def __init__(self, values: dict[int, float], name: str = "val_loss") -> None:
        self.values, self.name = values, name

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if step in self.values:
            ctx.metrics["val_step"] = step
            ctx.metrics["val_loss"] = self.values[step] if self.name == "val_loss" else 1.0
            ctx.metrics["val_metrics"] = {} if self.name == "val_loss" else {self.name: self.values[step]}


class _Run:
    """A tiny regression set up for ``fit`` (seeded: two runs of the same seed train alike)."""

    def __init__(self, steps: int = 12, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.engine = Engine({"run": {"device": "cpu"}})
        plain = torch.nn.Linear(4, 2)
        self.model, self.optimizer, _ = self.engine.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        self.batches = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(steps)]
        self.steps = steps

    def state(self, watch: MetricWatch) -> RunState:
        return run_state(self.engine, self.model, self.optimizer, optional={"best": watch})

    def fit(self, hooks: list[Hook]) -> FitContext:
        def loss(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

        return fit(
            self.engine,
            self.model,
            self.optimizer,
            self.batches,
            max_steps=self.steps,
            hooks=hooks,
            loss_fn=loss,
        )


def test_min_delta_mode_and_nan_decide_what_improves():
    low = MetricWatch("val_loss", "min", min_delta=0.1)
    assert low.improves(5.0)  # the first value always does
    low.best = 1.0
    assert low.improves(0.85) and not low.improves(0.95) and not low.improves(float("nan"))
    high = MetricWatch("val_accuracy", "max", min_delta=0.01)
    high.best = 0.5
    assert high.improves(0.52) and not high.improves(0.505)


def test_the_fit_stops_after_patience_passes_without_improvement_and_says_why():
    watch = MetricWatch("val_loss", "min")
    values = {2: 1.0, 4: 0.8, 6: 0.9, 8: 0.8, 10: 0.5}  # 6 and 8 do not beat 0.8: patience 2 ends at 8
    run = _Run()
    ctx = run.fit([_Scripted(values), EarlyStopping(watch, patience=2)])
    assert run.engine.state.step == 8 and ctx.should_stop
    assert ctx.stop_reason == (
        "early stopping: val_loss did not improve on 0.8 (step 4) by more than 0 in 2 validation passes"
    )
    assert (watch.best, watch.best_step, watch.stale) == (0.8, 4, 2)
    # patience 0 only watches; a stop due at the last step is the run completing, not early stopping
    run = _Run()
    assert not run.fit([_Scripted(values), EarlyStopping(MetricWatch(), patience=0)]).should_stop
    assert run.engine.state.step == 12
    run = _Run(steps=4)
    assert not run.fit([_Scripted({2: 1.0, 4: 2.0}), EarlyStopping(MetricWatch(), patience=1)]).should_stop


def test_a_metric_nan_since_the_first_pass_stops_with_one_line_saying_so():
    """#44 item 3: NaN at every pass: nothing was ever the best; the stop says the metric is NaN."""
    nan = float("nan")
    watch = MetricWatch("val_loss", "min")
    run = _Run()
    ctx = run.fit([_Scripted({2: nan, 4: nan, 6: 0.5}), EarlyStopping(watch, patience=2)])
    assert run.engine.state.step == 4 and ctx.should_stop
    assert (
        ctx.stop_reason == "early stopping: val_loss was NaN in all 2 validation passes, the last at step 4"
    )
    assert (watch.best, watch.best_step, watch.stale) == (None, -1, 2)


def test_a_metric_the_validation_does_not_compute_is_one_line():
    watch = MetricWatch("val_f1", "max")
    with pytest.raises(
        TurbotrainError, match=r"best.metric = 'val_f1' is not a metric .*computes val_loss, val_accuracy"
    ):
        _Run().fit([_Scripted({2: 0.5}, name="val_accuracy"), EarlyStopping(watch, patience=1)])


@pytest.mark.parametrize("kind", ["single", "ddp"])  # ddp: a sharded folder, written here by one process
def test_the_best_checkpoint_survives_keep_last_1_and_loads(tmp_path: Path, kind: str):
    values = {3: 1.0, 6: 0.5, 9: 0.7, 12: 0.6}  # the best pass: step 6
    watch = MetricWatch()
    run = _Run()
    saver = Checkpointer(
        tmp_path / "checkpoints",
        3,
        1,
        run.state(watch),
        strategy=type("S", (), {"name": kind})(),
        async_write=True,
    )
    at_6: dict[str, torch.Tensor] = {}

    class Snapshot(Hook):
        def on_step_end(self, ctx: FitContext) -> None:
            if ctx.engine.state.step == 6:
                at_6.update({k: v.clone() for k, v in ctx.model.state_dict().items()})

    run.fit([_Scripted(values), EarlyStopping(watch, 0), Snapshot(), saver, KeepBest(watch, saver)])
    suffix = ".pt" if kind == "single" else ""
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [f"step_00000012{suffix}"]
    best = best_checkpoint(tmp_path)
    assert best is not None and best.name == f"step_00000006{suffix}"
    path, weights = load_best_weights(tmp_path)
    assert path == best and all(torch.equal(weights[k], at_6[k]) for k in at_6)
    # the whole run state, as a resume loads the latest: the engine at step 6, the watch as it was then
    again, later = _Run(seed=1), MetricWatch()
    assert restore_best(tmp_path, again.state(later)) == best
    assert again.engine.state.step == 6 and (later.best, later.best_step) == (0.5, 6)
    assert all(torch.equal(again.model.state_dict()[k], at_6[k]) for k in at_6)


def test_a_checkpoint_saved_without_the_watch_still_resumes_and_the_watch_starts_fresh(tmp_path: Path):
    run = _Run(steps=4)
    run.fit([])
    save_checkpoint(tmp_path, 4, run_state(run.engine, run.model, run.optimizer).state_dict())
    watch = MetricWatch()
    fresh = _Run(seed=1)
    restore_latest(tmp_path, fresh.state(watch))
    assert fresh.engine.state.step == 4 and torch.equal(fresh.model.weight, run.model.weight)
    assert (watch.best, watch.best_step) == (None, -1)


def test_a_run_without_a_best_checkpoint_says_so_in_one_line(tmp_path: Path):
    with pytest.raises(
        TurbotrainError, match=r'has no best checkpoint .*\{"best": \{"checkpoint": "true"\}\}.*KeepBest'
    ):
        load_best_weights(tmp_path)


@pytest.mark.slow
def test_sample_best_reads_the_best_checkpoint_of_a_gpt_run(tmp_path: Path, text_file: Path, capsys):
    """``--best.checkpoint=true`` through ``train()``; with the latest checkpoints gone, ``sample``
    (latest) has none to read and ``sample --best`` generates from the best one."""
    overrides = tiny_overrides(
        tmp_path, data={"path": str(text_file)}, best={"checkpoint": True, "mode": "max"}
    )
    config = load_config(overrides=overrides)  # mode max on val_loss: the first pass (step 3) stays the best
    summary = train(config, progress=False)
    run = tmp_path / "runs" / "t"
    assert (
        summary["best"]["step"] == 3 and summary["best"]["checkpoint"] == "checkpoints/best/step_00000003.pt"
    )
    for p in list_checkpoints(run / "checkpoints"):
        p.unlink()
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "8"]) == 2
    assert main(["sample", str(run), "--best", "--tokens", "8"]) == 0
    assert len(capsys.readouterr().out) > 8


def test_a_resumed_run_stops_at_the_evaluation_the_uninterrupted_one_stops_at(tmp_path: Path):
    """The watch's whole state (best, its step, the passes since it) travels in the checkpoint: a
    run stopped after a pass that did not improve and resumed stops where the uninterrupted one does."""
    values = {2: 1.0, 4: 0.8, 6: 0.9, 8: 0.85, 10: 0.5}  # 6 and 8 do not beat 0.8: patience 2 ends at 8
    whole = MetricWatch()
    run = _Run()
    assert run.fit([_Scripted(values), EarlyStopping(whole, patience=2)]).should_stop
    assert run.engine.state.step == 8

    class StopAt6(Hook):
        def on_step_end(self, ctx: FitContext) -> None:
            if ctx.engine.state.step == 6:
                ctx.request_stop("signal")

    first, watch = _Run(), MetricWatch()
    first.fit([_Scripted(values), EarlyStopping(watch, patience=2), StopAt6()])
    assert first.engine.state.step == 6 and watch.stale == 1
    save_checkpoint(tmp_path, 6, first.state(watch).state_dict())
    again, resumed = _Run(), MetricWatch()
    restore_latest(tmp_path, again.state(resumed))
    assert resumed.state_dict() == watch.state_dict()
    ctx = again.fit([_Scripted(values), EarlyStopping(resumed, patience=2)])
    assert again.engine.state.step == 8 and ctx.should_stop
    assert resumed.state_dict() == whole.state_dict()


def test_nan_is_never_an_improvement_not_even_on_the_first_pass():
    for mode in ("min", "max"):
        watch = MetricWatch("val_loss", mode)
        assert not watch.improves(float("nan"))  # no best yet: still not the best
        watch.best = 1.0
        assert not watch.improves(float("nan"))


def test_a_final_validation_pass_at_a_stop_between_evaluations_that_is_the_best_is_kept(tmp_path: Path):
    """Stopped at step 5 (a signal), between the passes at 3 and 6: the final pass Evaluate runs at
    the stop is the best so far, so the best checkpoint is step 5's."""
    watch = MetricWatch()
    run = _Run()
    saver = Checkpointer(
        tmp_path / "checkpoints", 3, 2, run.state(watch), strategy=type("S", (), {"name": "single"})()
    )

    class StopAt5WithAFinalPass(Hook):
        def on_step_end(self, ctx: FitContext) -> None:
            if ctx.engine.state.step == 5:
                ctx.request_stop("signal")

        def on_fit_end(self, ctx: FitContext) -> None:  # Evaluate's final pass at a stop
            ctx.metrics.update(val_step=ctx.engine.state.step, val_loss=0.2)

    run.fit(
        [_Scripted({3: 1.0}), StopAt5WithAFinalPass(), EarlyStopping(watch, 0), saver, KeepBest(watch, saver)]
    )
    assert run.engine.state.step == 5 and (watch.best, watch.best_step) == (0.2, 5)
    best = best_checkpoint(tmp_path)
    assert best is not None and best.name == "step_00000005.pt"
    _, weights = load_best_weights(tmp_path)
    assert all(torch.equal(weights[k], v) for k, v in run.model.state_dict().items())


def test_best_metric_wording_a_close_name_the_cli_line_and_a_metric_known_at_start(
    tmp_path: Path, text_file: Path
):
    """#44 item 12: val_acc for val_accuracy is named; one setting "chooses"; `sample --best`'s line
    (the CLI's) advises no Python; the built-in GPT's validation computes val_loss alone, so another
    best.metric is one line at the start, before any step (was: at the first validation pass)."""
    with pytest.raises(
        TurbotrainError, match=r"computes val_loss, val_accuracy\); did you mean val_accuracy\?"
    ):
        MetricWatch("val_acc", "max").require_known(["val_loss", "val_accuracy"])
    with pytest.raises(ConfigError, match=r"^best.metric chooses what early stopping"):
        load_config(overrides={"best": {"metric": "val_accuracy"}})
    with audience("cli"), pytest.raises(TurbotrainError) as caught:
        load_best_weights(tmp_path)
    assert "--best.checkpoint=true (and a validation set)" in str(caught.value) and "KeepBest" not in str(
        caught.value
    )
    overrides = tiny_overrides(
        tmp_path, data={"path": str(text_file)}, best={"metric": "val_accuracy", "patience": 2}
    )
    with pytest.raises(
        TurbotrainError, match=r"best.metric = 'val_accuracy' is not a metric .*computes val_loss\)"
    ):
        train(load_config(overrides=overrides), progress=False)
    assert not list(tmp_path.rglob("metrics.jsonl"))  # nothing trained
