"""`turbotrain bench --compare`'s measured-choice row (turbotrain-auto) and CUDA-graph row on CPU:
the auto row decides by timing candidates (its cost reported apart from the step time) and then
trains; the graph row is refused with the graphs' one line, not an error."""

from __future__ import annotations

from turbotrain.app.bench.contenders import DEFAULT_ORDER
from turbotrain.app.bench.suite import BenchOptions, run_compare
from turbotrain.app.bench.tables import render_report
from turbotrain.app.bench.workloads import resolve_workload
from turbotrain.core.graphs import unavailable as graphs_unavailable

TINY_GPT = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 16}


def test_the_auto_row_reports_its_decision_apart_and_the_graph_row_says_why_not_on_cpu(tmp_path):
    w = resolve_workload(
        "gpt-tiny", "cpu", batch_size=4, warmup_steps=2, timed_steps=3, model_overrides=TINY_GPT
    )
    # a run of 200 planned steps: the eager candidates fit choose's 5% budget, a ~30 s compile never
    # does (so the test stays short whatever a loaded machine makes of 3 timed steps)
    opts = BenchOptions(
        device="cpu", work_dir=tmp_path, log=lambda line: None, timeout_s=300, auto_planned_steps=200
    )
    report = run_compare(w, opts, ["turbotrain", "turbotrain-auto", "turbotrain-graphs"])
    rows = {r["contender"]: r for r in report["rows"]}
    graphs = rows["turbotrain-graphs"]
    assert graphs["status"] == "skipped" and graphs["reason"] == graphs_unavailable("cpu")
    auto = rows["turbotrain-auto"]
    assert auto["status"] == "ok", auto.get("reason")
    decision = auto["decision"]
    measured = [r for r in decision["rows"] if r["step_ms"] is not None]
    # plain eager (the baseline) was timed here (on a CPU fp32 is auto's only precision by default)
    assert {r["name"] for r in measured} == {"eager"}
    assert all(r["status"] == "skipped" for r in decision["rows"] if r["compiles"])  # over the budget
    assert all(r["step_ms"] > 0 and r["measure_s"] > 0 for r in measured)
    assert decision["measured"] and decision["planned_steps"] == auto["planned_steps"] == 200
    # the decision's cost is its own figure: the candidates' time, not in the row's steps
    assert auto["decision_s"] >= decision["measure_s"] > 0
    assert len(auto["step_ms"]) == 3 and auto["step_ms_median"] > 0
    kept = next(r for r in decision["rows"] if r["status"] in ("kept", "baseline") and r["reason"])
    assert kept["name"] in auto["recipe"] or "kept" in auto["recipe"]
    # whatever was kept trains within the bench's parity rule of turbotrain's defaults
    assert auto["loss_within_tol"], (auto["loss_diff"], auto["loss_tol"])
    text = render_report(report)
    assert "decision s (not in step time)" in text and f"{auto['decision_s']:.1f}" in text


def test_the_default_list_has_the_graph_row_for_the_cifar_cnn_only(tmp_path, monkeypatch):
    ran = []

    def fake_row(contender, spec, row_name, opts):
        ran.append(contender)
        return {"contender": contender, "status": "failed", "reason": "not run in this test"}

    monkeypatch.setattr("turbotrain.app.bench.suite.run_row", fake_row)
    opts = BenchOptions(device="cpu", work_dir=tmp_path, log=lambda line: None)
    for name, graphs in (("cnn-cifar", True), ("gpt-tiny", False)):
        w = resolve_workload(name, "cpu", batch_size=2, warmup_steps=1, timed_steps=2)
        rows = [r["contender"] for r in run_compare(w, opts, list(DEFAULT_ORDER))["rows"]]
        assert "turbotrain-auto" in rows
        assert ("turbotrain-graphs" in rows) is graphs
    assert "turbotrain-graphs" not in ran  # refused on CPU: no process
