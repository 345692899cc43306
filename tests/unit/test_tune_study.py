"""turbotrain tune's logic with a simulated trial runner (no processes): the search space, the
memory cap (penalty + constraints, predicted rejections that cost no trial), failures as
constraint violations, and a study that resumes."""

from __future__ import annotations

import sys

import pytest
import torch

from turbotrain import load_config
from turbotrain.app.measure import Target
from turbotrain.app.tune.space import Dim, ModelFacts, base_params, build_space, micro_choices, to_changes
from turbotrain.app.tune.study import (
    PENALTY,
    Measured,
    Outcome,
    Study,
    TuneOptions,
    predicted_over,
    require_optuna,
)
from turbotrain.base.errors import ConfigError, TurbotrainError
from turbotrain.cli import main

MiB = 2**20
GPT = ModelFacts(gpt=True, blocks=True, own_optimizer=False, dataloader=True)


# ------------------------------------------------------------------------------------ space


def test_the_space_on_cpu_leaves_out_what_cannot_help_and_what_you_fixed():
    base = load_config("gpt-tiny", {"run": {"device": "cpu"}})
    dims = {d.key: d for d in build_space(base, torch.device("cpu"), GPT, set(), micro_choices(32, 16))}
    assert "precision.mode" not in dims  # bf16 on a CPU is what train warns against: fp32 is the one choice
    assert "compile.mode" not in dims and dims["compile.scope"].base == "off"  # CUDA-only modes
    assert dims["batch.micro"].choices == (2, 4, 8, 16, 32) and dims["batch.micro"].base == 32
    assert dims["optim.implementation"].choices == ("fused", "foreach")  # for-loop is never faster
    fixed = {
        d.key for d in build_space(base, torch.device("cpu"), GPT, {"precision.mode", "batch.micro"}, (8, 16))
    }
    assert "precision.mode" not in fixed and "batch.micro" not in fixed
    own = ModelFacts(gpt=False, blocks=False, own_optimizer=True, dataloader=False)
    assert {d.key for d in build_space(base, torch.device("cpu"), own, set(), None)} == {"compile.scope"}
    asked = load_config("gpt-tiny", {"run": {"device": "cpu"}, "precision": {"mode": "bf16-mixed"}})
    dims = {d.key: d for d in build_space(asked, torch.device("cpu"), GPT, set(), None)}
    # the user's own choice stays the baseline
    assert dims["precision.mode"].choices == (
        "fp32",
        "bf16-mixed",
    )


def test_a_micro_batch_brings_the_accumulation_that_keeps_the_global_batch():
    assert micro_choices(32, None) == (1, 2, 4, 8, 16, 32)
    # powers of two dividing the global batch, up to twice the fit
    assert micro_choices(24, 4) == (
        1,
        2,
        4,
        8,
    )
    changes = to_changes({"batch.micro": 8, "precision.mode": "fp32"}, 32)
    assert changes["batch"] == {"micro": 8, "accumulation": 4} and changes["memory"]["on_oom"] == "stop"


def test_a_proposal_at_least_as_large_as_an_over_budget_one_is_predicted_over():
    over = Measured({"batch.micro": 16, "precision.mode": "fp32"}, 20 * MiB, True)
    assert predicted_over({"batch.micro": 32, "precision.mode": "fp32"}, [over], 10 * MiB, 8)
    # leaner: may fit
    assert not predicted_over({"batch.micro": 32, "precision.mode": "bf16-true"}, [over], 10 * MiB, 8)
    assert not predicted_over({"batch.micro": 8, "precision.mode": "fp32"}, [over], 10 * MiB, 8)
    fits = [Measured({"batch.micro": m}, m * MiB, False) for m in (2, 4)]
    assert "extrapolated" in predicted_over({"batch.micro": 16}, fits, 10 * MiB, 8)
    assert not predicted_over({"batch.micro": 8}, fits, 10 * MiB, 8)


# ------------------------------------------------------------------------------------ study


class FakeRunner:
    """Memory grows 1 MiB per sample of micro-batch; bigger micro-batches are faster; fused adds 20%."""

    def __init__(self, budget: int = 10 * MiB, fail_fused: bool = False, fused_speed: float = 1.2) -> None:
        self.budget, self.fail_fused, self.fused_speed, self.calls = budget, fail_fused, fused_speed, []

    def measure(self, name, changes, report, over_budget):
        micro, impl = changes.get("batch", {}).get("micro", 8), changes.get("optim", {}).get("implementation")
        self.calls.append((micro, impl))
        peak = micro * MiB
        if over_budget(peak, self.budget):
            return Outcome("over budget", peak_bytes=peak, budget_bytes=self.budget)
        if self.fail_fused and impl == "fused":
            return Outcome("failed", reason="RuntimeError: boom", peak_bytes=peak, budget_bytes=self.budget)
        rate = 1000.0 * micro * (self.fused_speed if impl == "fused" else 1.0)
        for k in (1, 2):  # two windows, as a trial process reports them
            if report(k, rate):
                return Outcome("pruned", peak_bytes=peak, budget_bytes=self.budget, windows=[rate])
        result = {
            "status": "ok",
            "throughput": rate,
            "throughput_unit": "tokens/s",
            "parity_loss": 2.0,
            "math_precision": "fp32",
            "peak_bytes": peak,
            "budget_bytes": self.budget,
            "first_step_s": 0.1,
        }
        return Outcome("ok", result, peak_bytes=peak, budget_bytes=self.budget)

    def find(self, changes):
        raise AssertionError("not used here")


SPACE = [
    Dim("batch.micro", (1, 2, 4, 8, 16, 32), 8),
    Dim("optim.implementation", ("fused", "foreach"), "foreach"),
]


def _study(tmp_path, runner, trials, space=SPACE, prune=False, fits_micro=None):
    require_optuna_or_skip()
    target = Target(
        preset="gpt-tiny", overrides={"run": {"device": "cpu"}, "batch": {"micro": 8, "accumulation": 4}}
    )
    study = Study(
        target,
        target.config(),
        space,
        TuneOptions(trials=trials, prune=prune),
        tmp_path,
        runner,
        lambda *a, **k: None,
        global_batch=32,
        base_precision="fp32",
        fits_micro=fits_micro,
    )
    study.open()
    return study


def require_optuna_or_skip():
    pytest.importorskip("optuna")


@pytest.mark.slow
def test_a_memory_cap_makes_the_over_budget_region_lose_without_eating_the_trials(tmp_path):
    runner = FakeRunner(budget=10 * MiB)  # limit 10 / 1.1 = 9.1 MiB: micro-batches 16 and 32 do not fit
    study = _study(tmp_path, runner, trials=6)
    study.run()
    rows = study.rows()
    assert study.counted() == 6  # six trials that measured something, however many proposals were over
    over = [r for r in rows if r["params"].get("batch.micro", 0) >= 16]
    for r in over:  # penalised and marked infeasible, so TPE ranks the region last; never counted
        assert r["state"] == "complete" and r["constraints"][0] > 0 and not r["counted"]
        assert r["status"] in ("over budget", "predicted over budget", "duplicate")
        assert study.study.trials[r["number"]].value == PENALTY
    ran_over = [c for c in runner.calls if c[0] >= 16]
    assert len(ran_over) <= 2  # after one, every larger-or-equal micro-batch is rejected without a run
    best = study.best()
    assert best["params"]["batch.micro"] == 8 and best["feasible"] and best["peak_bytes"] <= 10 * MiB / 1.1
    assert rows[0]["baseline"] and rows[0]["params"] == base_params(SPACE)
    if hasattr(study.study.trials[0], "constraints"):  # Optuna >= 5 stores them for the sampler
        assert all(v > 0 for r in over for v in [max(study.study.trials[r["number"]].constraints.values())])


def test_base_settings_over_the_cap_get_a_second_baseline_at_the_micro_batch_that_fits(tmp_path):
    space = [
        Dim("batch.micro", (2, 4, 8, 16, 32), 32),
        Dim("optim.implementation", ("fused", "foreach"), "foreach"),
    ]
    study = _study(tmp_path, FakeRunner(budget=10 * MiB), trials=3, space=space, fits_micro=8)
    study.run()
    first, second = study.rows()[:2]
    assert first["baseline"] and first["status"] == "over budget" and first["params"]["batch.micro"] == 32
    assert (
        second["baseline"]
        and second["feasible"]
        and second["params"] == {"batch.micro": 8, "optim.implementation": "foreach"}
    )
    assert study.reference["parity_loss"] == 2.0  # the fitting baseline is the fp32 reference: no extra run
    assert study.baseline_row()["number"] == second["number"]


@pytest.mark.slow
def test_a_failed_trial_is_a_penalised_constraint_violation_not_a_failure_optuna_ignores(tmp_path):
    study = _study(tmp_path, FakeRunner(budget=1024 * MiB, fail_fused=True), trials=4)
    study.run()
    failed = [r for r in study.rows() if r.get("status") == "failed"]
    for r in failed:
        assert r["state"] == "complete" and r["constraints"][2] == 1.0 and r["counted"]
        assert study.study.trials[r["number"]].value == PENALTY and r["reason"] == "RuntimeError: boom"
    assert study.best()["params"]["optim.implementation"] == "foreach"


@pytest.mark.slow
def test_a_trial_far_slower_than_the_best_is_pruned_at_its_first_window(tmp_path):
    runner = FakeRunner(budget=1024 * MiB, fused_speed=0.1)  # fused: a tenth of the speed
    study = _study(
        tmp_path,
        runner,
        trials=4,
        space=[Dim("optim.implementation", ("fused", "foreach"), "foreach")],
        prune=True,
    )
    study.run()
    fused = [
        r
        for r in study.rows()
        if r["params"]["optim.implementation"] == "fused" and r["status"] != "duplicate"
    ]
    assert fused and all(r["state"] == "pruned" and "under 50% of the best" in r["reason"] for r in fused)
    assert study.best()["params"] == {"optim.implementation": "foreach"}


@pytest.mark.slow
def test_a_study_resumes_from_its_sqlite_file_and_refuses_other_settings(tmp_path):
    first = FakeRunner(budget=1024 * MiB)
    _study(tmp_path, first, trials=2).run()
    again = FakeRunner(budget=1024 * MiB)
    resumed = _study(tmp_path, again, trials=3)
    resumed.run()
    assert resumed.counted() == 3 and len(again.calls) <= 1 + sum(
        1 for r in resumed.rows() if r.get("status") == "duplicate"
    )
    assert resumed.reference["parity_loss"] == 2.0  # the baseline trial's, kept in the study
    with pytest.raises(ConfigError, match="holds a tune study of other settings"):
        _study(tmp_path, FakeRunner(), trials=3, space=SPACE[:1])


def test_without_optuna_tune_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna -> ImportError
    with pytest.raises(TurbotrainError, match=r"pip install 'turbotrain\[tune\]'"):
        require_optuna()
    assert main(["tune", "--preset", "gpt-tiny", "--trials", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "turbotrain tune needs Optuna: pip install 'turbotrain[tune]'" in err[0]


@pytest.mark.slow
@pytest.mark.parametrize("fused_speed, confirmed", [(1.5, True), (1.01, False)])
def test_the_best_is_re_measured_against_the_baseline_before_it_is_written(tmp_path, fused_speed, confirmed):
    from turbotrain.app.tune.session import write_outputs

    space = [Dim("optim.implementation", ("fused", "foreach"), "foreach")]
    study = _study(tmp_path, FakeRunner(budget=1024 * MiB, fused_speed=fused_speed), trials=3, space=space)
    study.run()
    best = study.best()
    assert best["params"] == {"optim.implementation": "fused"}
    check = study.confirm(best, 2)
    assert len(check["throughputs"]["best"]) == len(check["throughputs"]["baseline"]) == 2
    assert check["speedup"] == pytest.approx(fused_speed) and check["confirmed"] is confirmed
    doc = write_outputs(study, tmp_path, tmp_path / "best.toml", "cpu", check)
    written = load_config(str(tmp_path / "best.toml"))
    # within noise: the baseline's
    assert written.optim.implementation == ("fused" if confirmed else "foreach")
    assert ("BASELINE's settings" in (tmp_path / "best.toml").read_text()) is not confirmed
    assert doc["preset_trial"] == (best["number"] if confirmed else 0)


# ------------------------------------------------------------------------------------ issue 23: NaN, fatal, causes


class NanRunner(FakeRunner):
    """Fused trials train to a NaN loss; ``fatal`` makes every trial fail as a non-scalar loss does."""

    def __init__(self, fatal: bool = False) -> None:
        super().__init__(budget=1024 * MiB)
        self.fatal = fatal

    def measure(self, name, changes, report, over_budget):
        if self.fatal:
            self.calls.append(name)
            return Outcome(
                "invalid",
                {"status": "invalid", "reason": "the loss must be a scalar", "fatal": True},
                reason="the loss must be a scalar",
            )
        out = super().measure(name, changes, report, over_budget)
        if changes.get("optim", {}).get("implementation") == "fused" and out.status == "ok":
            out.result = {**out.result, "parity_loss": float("nan")}
        return out


@pytest.mark.slow
def test_a_trial_whose_loss_is_nan_is_a_penalised_trial_and_the_results_are_written(tmp_path):
    """Issue 23 item 6: a NaN loss raised `Attempted to set a constraint ... NaN` and nothing was written."""
    from turbotrain.app.tune.session import write_outputs

    study = _study(
        tmp_path, NanRunner(), trials=4, space=[Dim("optim.implementation", ("fused", "foreach"), "foreach")]
    )
    study.run()
    nan = [
        r
        for r in study.rows()
        if r["params"]["optim.implementation"] == "fused" and r["status"] != "duplicate"
    ]
    assert nan and all(
        r["status"] == "failed" and "not finite" in r["reason"] and not r["feasible"] for r in nan
    )
    assert all(study.study.trials[r["number"]].value == PENALTY for r in nan)
    assert study.best()["params"] == {"optim.implementation": "foreach"}
    write_outputs(study, tmp_path, None, "cpu")
    assert (tmp_path / "tune.json").is_file() and (tmp_path / "best.toml").is_file()


def test_a_baseline_failing_for_a_reason_no_setting_changes_stops_the_study_at_once(tmp_path):
    """Issue 23 item 15: a non-scalar loss or an empty loader kept the study proposing (16 proposals)."""
    from turbotrain.app.tune.study import StudyStopped

    runner = NanRunner(fatal=True)
    study = _study(tmp_path, runner, trials=5)
    with pytest.raises(
        StudyStopped, match="the baseline.*no setting tune searches changes: the loss must be a scalar"
    ):
        study.run()
    assert runner.calls == ["trial-000"]


def test_a_dead_trial_s_reason_is_its_cause_not_the_last_log_line():
    from turbotrain.base.failure import cause_in_log

    log = (
        'Traceback (most recent call last):\n  File "wl.py", line 3, in f\n    g()\nValueError: the real cause\n'
        "/x/torch/utils/data.py:12: UserWarning: something\n  warnings.warn(\n"
    )
    assert cause_in_log(log, 1) == "ValueError: the real cause"
    assert cause_in_log("some output\n", -9).startswith("killed by SIGKILL")
    assert cause_in_log("x\nRuntimeError: boom\n  warnings.warn(x)\n", 1) == "RuntimeError: boom"


def test_a_trial_s_advice_reads_as_flags_not_as_a_python_dict(tmp_path, monkeypatch):
    """Issue 23 item 15: OOM advice (``setting(...)``) came back from a trial as {"memory": {...}}."""
    import json

    from turbotrain.app.tune import trial
    from turbotrain.base.config import setting

    def oom(spec, progress):
        raise TurbotrainError(f"out of memory; use {setting('memory.on_oom', 'halve')}")

    monkeypatch.setattr(trial, "measure_trial", oom)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"mode": "measure"}))
    trial.main(
        ["--spec", str(spec), "--result", str(tmp_path / "r.json"), "--progress", str(tmp_path / "p.jsonl")]
    )
    reason = json.loads((tmp_path / "r.json").read_text())["reason"]
    assert "--memory.on_oom=halve" in reason and "{" not in reason


def test_tune_of_an_emulated_fp8_run_on_cpu_is_not_refused(tmp_path, monkeypatch):
    """The base precision is checked with the whole [precision] section (fp8_emulate runs on a CPU)."""
    pytest.importorskip("torchao")
    import turbotrain.app.tune.session as session

    class Opened(Exception):
        pass

    def study(*args, **kwargs):
        seen.append(kwargs["base_precision"])
        raise Opened

    seen: list[str] = []
    monkeypatch.setattr(session, "Study", study)
    flags = [
        "tune",
        "--preset",
        "gpt-tiny",
        "--trials",
        "2",
        "--run.device=cpu",
        f"--run.out_dir={tmp_path}",
        "--batch.micro=4",
        "--precision.mode=fp8",
    ]
    with pytest.raises(Opened):
        main([*flags, "--precision.fp8_emulate=true"])
    assert seen == ["fp8"]
    assert main(flags) == 2  # without emulation: refused (one line) before any trial
