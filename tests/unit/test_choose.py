"""choose.measure: settings left at auto decided by timing candidates, with an injected timer
(figures given by hand: real timings on a shared CPU are noisy and compiling takes tens of seconds).

What a user checks: a short run keeps plain eager and says why (the break-even step), a long one
compiles; a recipe slower than plain eager (compile on a launch-bound MLP, bf16 on a CPU) or one
off loss parity is refused; a setting the user gave is never changed; the second run of the same
model reuses the measurements without timing anything; a foreign cache is ignored in one line.
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

from turbotrain import load_config
from turbotrain.app.choose.rule import Row, judge
from turbotrain.app.choose.session import apply, choose
from turbotrain.app.warmstart import WarmStart
from turbotrain.base.errors import TurbotrainWarning
from turbotrain.core.meter import cache as meter_cache

CPU = torch.device("cpu")


def _config(tmp_path, **sections):
    base = {
        "run": {"device": "cpu"},
        "data": {"cache_dir": str(tmp_path / "cache")},
        "choose": {"measure": "always"},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return load_config("gpt-tiny", base)


class Timer:
    """An injected measurement: ``figures[name] = (step ms, first step s, parity loss)``."""

    def __init__(self, figures=None):
        self.figures = dict(figures or {})
        self.calls: list[str] = []

    def __call__(self, cand):
        self.calls.append(cand.name)
        if cand.name not in self.figures:
            raise RuntimeError(f"no figures for {cand.name}")
        ms, first, loss = self.figures[cand.name]
        mp = "bf16" if "bf16" in cand.name else "fp32"
        return {"step_ms_median": ms, "first_step_s": first, "parity_loss": loss, "math_precision": mp}


# launch-bound tiny step on a CPU: compile costs 30 s and buys 10 %; bf16 is slower
GAINS = {
    "eager": (10.0, 0.5, 3.0),
    "eager bf16-mixed": (14.0, 0.5, 3.01),
    "compile model": (9.0, 30.5, 3.0),
    "compile blocks": (9.5, 12.0, 3.0),
}


def _row(d, name):
    return next(r for r in d.rows if r.name == name)


def test_a_short_run_keeps_eager_and_names_the_break_even(tmp_path):
    timer = Timer(GAINS)
    d = choose(_config(tmp_path, train={"max_steps": 2000}), measure=timer, device=CPU, say=lambda s: None)
    assert d.kept.name == "eager"
    assert d.changes == {"compile": {"scope": "off"}, "precision": {"mode": "fp32"}}
    comp = _row(d, "compile model")
    assert comp.status == "rejected" and comp.break_even_step == pytest.approx(30_000)
    assert "pays back at step 30,000, after the run's 2,000 steps" in comp.reason
    assert "slower than plain eager" in _row(d, "eager bf16-mixed").reason


def test_a_long_run_compiles(tmp_path):
    timer = Timer(GAINS)
    d = choose(_config(tmp_path, train={"max_steps": 200_000}), measure=timer, device=CPU, say=lambda s: None)
    assert d.kept.name == "compile model"
    assert d.changes == {"compile": {"scope": "model"}, "precision": {"mode": "fp32"}}
    assert "at step 30,000 of 200,000" in d.kept.reason
    # blocks compile faster but run slower: over 200k steps the model-wide graph wins
    assert _row(d, "compile blocks").status == "rejected"
    config = apply(_config(tmp_path, train={"max_steps": 200_000}), d)
    assert config.compile.scope == "model" and config.precision.mode == "fp32"


def test_a_recipe_slower_than_plain_eager_is_refused(tmp_path):
    # compile on a launch-bound MLP: guards and graph launch cost more than the fused kernels save
    timer = Timer(
        {
            "eager": (2.0, 0.1, 2.3),
            "eager bf16-mixed": (2.6, 0.1, 2.31),
            "compile model": (2.4, 20.0, 2.3),
            "compile blocks": (2.1, 15.0, 2.3),
        }
    )
    d = choose(_config(tmp_path, train={"max_steps": 10**7}), measure=timer, device=CPU, say=lambda s: None)
    assert d.kept.name == "eager" and d.changes["compile"] == {"scope": "off"}
    assert all("slower than plain eager" in _row(d, n).reason for n in ("compile model", "compile blocks"))


def test_within_noise_and_off_parity_are_refused():
    base = Row(
        "eager", "", {}, baseline=True, step_ms=10.0, first_step_s=0.1, parity_loss=3.0, math_precision="fp32"
    )
    noise = Row("a", "", {}, step_ms=9.9, first_step_s=0.1, parity_loss=3.0, math_precision="fp32")
    drift = Row("b", "", {}, step_ms=5.0, first_step_s=0.1, parity_loss=3.01, math_precision="fp32")
    assert judge([base, noise, drift], 1000, 1.03) is base
    assert (
        "within timing noise" in noise.reason and "loss parity" in drift.reason and drift.parity_ok is False
    )


def test_a_short_run_measures_nothing_in_auto_mode(tmp_path):
    timer = Timer(GAINS)
    config = _config(tmp_path, train={"max_steps": 300}, choose={"measure": "auto"})
    d = choose(config, measure=timer, device=CPU, say=lambda s: None)
    assert timer.calls == [] and d.changes == {} and "too few to pay for measuring" in d.summary


def test_compile_is_not_measured_when_it_cannot_fit_the_budget(tmp_path):
    timer = Timer(GAINS)
    config = _config(tmp_path, train={"max_steps": 5000}, choose={"measure": "auto"})  # 5000 x 10 ms = 50 s
    d = choose(config, measure=timer, device=CPU, say=lambda s: None)
    # measure = auto on a CPU: fp32 is not questioned (a default run's math does not depend on the CPU)
    assert timer.calls == ["eager"]
    assert _row(d, "compile model").status == "skipped"
    assert "save 6.0 ms a step" in _row(d, "compile model").reason  # 30 s over 5000 steps
    assert d.kept.name == "eager"
    # unmeasured, compile is not turned off: it keeps its fixed rule (on a GPU: compiled)
    assert d.changes == {"precision": {"mode": "fp32"}} and "left to its fixed rule" in d.summary


def test_explicit_settings_are_never_overridden(tmp_path):
    timer = Timer(GAINS)
    config = _config(tmp_path, train={"max_steps": 10**6}, compile={"scope": "off"})
    d = choose(config, measure=timer, device=CPU, say=lambda s: None)
    assert timer.calls == ["eager", "eager bf16-mixed"] and "compile" not in d.changes
    config = _config(tmp_path, train={"max_steps": 10**6}, precision={"mode": "fp32"})
    d = choose(config, measure=Timer(GAINS), device=CPU, say=lambda s: None)
    assert "precision" not in d.changes and d.changes["compile"]["scope"] == "model"
    both = _config(tmp_path, compile={"scope": "model"}, precision={"mode": "fp32"})
    assert choose(both, measure=Timer(GAINS), device=CPU) is None


def test_the_next_run_reuses_the_measurements(tmp_path, caplog):
    first = Timer(GAINS)
    d1 = choose(_config(tmp_path, train={"max_steps": 2000}), measure=first, device=CPU, say=lambda s: None)
    assert len(first.calls) == 4 and d1.measured
    again = Timer()  # any measurement now fails the test: it has no figures
    d2 = choose(
        _config(tmp_path, train={"max_steps": 200_000}), measure=again, device=CPU, say=lambda s: None
    )
    assert again.calls == [] and not d2.measured and all(r.cached for r in d2.rows)
    assert d2.kept.name == "compile model"  # the same figures, decided again for the longer run
    # another device name (or torch version, model, settings): another key, measured again
    other = Timer(GAINS)
    choose(
        _config(tmp_path, train={"max_steps": 2000}, model={"n_layer": 2}),
        measure=other,
        device=CPU,
        say=lambda s: None,
    )
    assert len(other.calls) == 4
    # a foreign or damaged file under the key is ignored with one line
    path = tmp_path / "cache" / "choose" / f"{d1.key}.json"
    data = json.loads(path.read_text())
    data["material"]["torch"] = "0.0"
    path.write_text(json.dumps(data))
    caplog.set_level(logging.WARNING)
    third = Timer(GAINS)
    choose(_config(tmp_path, train={"max_steps": 2000}), measure=third, device=CPU, say=lambda s: None)
    assert len(third.calls) == 4
    assert [r.message for r in caplog.records if "ignoring the cached" in r.message][0].count("\n") == 0


def test_a_failing_candidate_is_one_row_and_the_run_goes_on(tmp_path):
    timer = Timer({"eager": (10.0, 0.5, 3.0), "eager bf16-mixed": (14.0, 0.5, 3.0)})  # compile "fails"
    d = choose(_config(tmp_path, train={"max_steps": 10**6}), measure=timer, device=CPU, say=lambda s: None)
    assert _row(d, "compile model").status == "failed" and "RuntimeError" in _row(d, "compile model").reason
    assert d.kept.name == "eager"


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: [],
        lambda data: None,
        lambda data: {**data, "value": {"eager": {"first_step_s": 0.5}}},  # a row missing its step time
        lambda data: {**data, "value": {"eager": "fast"}},  # a row as a string
        lambda data: {**data, "value": []},
    ],
    ids=["list", "null", "row-missing-a-figure", "row-as-string", "rows-as-list"],
)
def test_a_cache_file_of_another_shape_is_one_line_and_measured_again(tmp_path, caplog, damage):
    """Issue 44 item 5: valid JSON of another shape is no traceback: one line naming the file."""
    d1 = choose(
        _config(tmp_path, train={"max_steps": 2000}), measure=Timer(GAINS), device=CPU, say=lambda s: None
    )
    path = tmp_path / "cache" / "choose" / f"{d1.key}.json"
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    caplog.set_level(logging.WARNING)
    again = Timer(GAINS)
    d2 = choose(_config(tmp_path, train={"max_steps": 2000}), measure=again, device=CPU, say=lambda s: None)
    assert len(again.calls) == 4 and d2.kept.name == d1.kept.name
    lines = [r.getMessage() for r in caplog.records if "ignoring the cached" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "\n" not in lines[0]
    assert "eager" in json.loads(path.read_text())["value"]  # written again, whole


def test_of_the_candidates_that_pay_back_the_least_projected_run_time_is_kept_not_the_fastest_step():
    """Projected run time = first step + planned steps x step: over 100,000 steps 'fast' (5 ms a
    step, 200 s to its first) pays back but projects 700 s; 'quick' (6 ms, 2 s) projects 602 s."""
    base = Row("eager", "", {}, baseline=True, step_ms=10.0, first_step_s=1.0, parity_loss=3.0)
    fast = Row("fast", "", {}, step_ms=5.0, first_step_s=200.0, parity_loss=3.0)  # 200 + 500 = 700 s
    quick = Row("quick", "", {}, step_ms=6.0, first_step_s=2.0, parity_loss=3.0)  # 2 + 600 = 602 s
    for r in (base, fast, quick):
        r.math_precision = "fp32"
    kept = judge([base, fast, quick], 100_000, 1.03)
    assert kept is quick and quick.status == "kept"
    assert fast.break_even_step == pytest.approx(39_800)  # it pays back within the run, yet projects longer
    assert (fast.projected_s, quick.projected_s, base.projected_s) == pytest.approx((700.0, 602.0, 1001.0))
    assert fast.status == "rejected" and fast.reason.endswith("quick projects a shorter run")


def test_the_cache_keys_of_choose_and_of_the_compile_warm_start_include_the_device_name(
    tmp_path, monkeypatch
):
    """Figures measured on one GPU model are never reused on another (nor its compile artefacts)."""
    keys = {}
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"):
        monkeypatch.setattr(meter_cache, "device_name", lambda device, name=name: name)
        timer = Timer(GAINS)
        d = choose(
            _config(tmp_path, train={"max_steps": 2000}), measure=timer, device=CPU, say=lambda s: None
        )
        assert len(timer.calls) == 4  # measured on each device: nothing cached for this one
        material = json.loads((tmp_path / "cache" / "choose" / f"{d.key}.json").read_text())["material"]
        assert material["device"] == name
        keys[name] = (d.key, WarmStart(_config(tmp_path, compile={"scope": "model"})).key)
    first, second = keys.values()
    assert first[0] != second[0] and first[1] != second[1]


def test_measure_always_with_nothing_left_at_auto_is_one_warning_and_measures_nothing(tmp_path):
    """#44 item 11: ``choose.measure = always`` with compile.scope and precision.mode both set
    would do nothing: said in one warning naming the setting, nothing timed."""
    timer = Timer(GAINS)
    both = _config(tmp_path, compile={"scope": "off"}, precision={"mode": "fp32"})
    with pytest.warns(TurbotrainWarning, match=r"choose\.measure = always does nothing") as caught:
        assert choose(both, measure=timer, device=CPU, say=lambda s: None) is None
    assert timer.calls == [] and len(caught) == 1 and "\n" not in str(caught[0].message)
    auto = _config(tmp_path, choose={"measure": "auto"}, compile={"scope": "off"}, precision={"mode": "fp32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TurbotrainWarning)  # measure = auto: nothing to say
        assert choose(auto, measure=timer, device=CPU) is None
