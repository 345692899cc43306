"""turbotrain bench: workloads, protocol, derived figures and tables (no subprocesses here)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from turbotrain.app.bench import contenders as contenders_mod
from turbotrain.app.bench.contenders import CONTENDERS, DEFAULT_ORDER
from turbotrain.app.bench.protocol import StepClock, init_digest, recipe_param_groups, warmup_factor
from turbotrain.app.bench.results import build_document, write_document
from turbotrain.app.bench.suite import (
    MIXED_PRECISION_TOL,
    SAME_PRECISION_TOL,
    BenchOptions,
    RowJob,
    ablation_variants,
    compare_to,
    derive,
    loss_tolerance,
    merge_runs,
    precision_variants,
    recommend,
    run_rows,
)
from turbotrain.app.bench.tables import render_report
from turbotrain.app.bench.workloads import (
    WORKLOADS,
    expand,
    flops_per_step,
    make_data,
    resolve_workload,
    seeded_model,
)
from turbotrain.base.errors import TurbotrainError
from turbotrain.core.graphs import unavailable as graphs_unavailable
from turbotrain.core.optim import lr_lambda, param_groups

# ------------------------------------------------------------------------------------ workloads


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_workload_resolves_with_a_positive_flop_count(name, device):
    w = resolve_workload(name, device)
    assert w.total_steps == w.warmup_steps + w.timed_steps
    flops, method = flops_per_step(w)
    assert flops > 0 and method


def test_gpu_workloads_scale_down_on_cpu():
    for name in ("gpt2-small", "cnn-224", "cnn-cifar"):
        cpu, gpu = resolve_workload(name, "cpu"), resolve_workload(name, "cuda")
        assert cpu.scaled_for == "cpu" and not gpu.scaled_for
        assert flops_per_step(cpu)[0] < flops_per_step(gpu)[0] / 10
    gpu = resolve_workload("gpt2-small", "cuda")
    assert (gpu.model_kwargs["n_layer"], gpu.model_kwargs["d_model"], gpu.seq_len) == (12, 768, 1024)


def test_gpt_flops_follow_the_palm_convention():
    w = resolve_workload("gpt-tiny", "cpu")
    model = seeded_model("gpt", w.model_kwargs, 0)
    flops, method = flops_per_step(w)
    assert "PaLM" in method
    assert flops == model.flops_per_token(w.seq_len) * w.batch_size * w.seq_len


def test_moe_workload_counts_active_parameters_and_groups_expand():
    assert expand("moe") == ["moe"]
    w = resolve_workload("moe", "cpu")
    model = seeded_model("moe", w.model_kwargs, 0)
    flops, method = flops_per_step(w)
    assert "active" in method and flops == model.flops_per_token(w.seq_len) * w.batch_size * w.seq_len
    dense_equivalent = 6 * model.num_params() * w.batch_size * w.seq_len  # every expert counted
    assert flops < dense_equivalent
    with pytest.raises(TurbotrainError, match="unknown workload"):
        expand("nope")
    assert expand("cnn") == ["cnn-224", "cnn-cifar"]


def test_overrides_and_bounds():
    w = resolve_workload(
        "gpt-tiny",
        "cpu",
        batch_size=2,
        warmup_steps=1,
        timed_steps=3,
        model_overrides={"block_size": 16, "n_layer": 1},
    )
    assert (w.batch_size, w.warmup_steps, w.timed_steps, w.seq_len, w.model_kwargs["n_layer"]) == (
        2,
        1,
        3,
        16,
        1,
    )
    with pytest.raises(TurbotrainError, match="warm-up"):
        resolve_workload("gpt-tiny", "cpu", warmup_steps=0)
    with pytest.raises(TurbotrainError, match="timed steps"):
        resolve_workload("gpt-tiny", "cpu", timed_steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny", "cnn-cifar"])
def test_data_is_deterministic(name):
    w = resolve_workload(name, "cpu", warmup_steps=1, timed_steps=2)
    (x1, y1), (x2, y2) = make_data(w, seed=3), make_data(w, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape[:2] == (w.pool_size, w.batch_size) and y1.shape[:2] == (w.pool_size, w.batch_size)


# ------------------------------------------------------------------------------------ protocol


def test_step_clock_times_only_the_steps_after_warmup():
    clock = StepClock(torch.device("cpu"), warmup_steps=2, timed_steps=3)
    clock.start()
    for i in range(5):
        clock.mark(torch.tensor(float(i)))
    figures = clock.finish()
    assert len(figures["step_ms"]) == 3  # steps 3, 4, 5, each measured from the previous step's end
    assert figures["losses"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert figures["first_loss"] == 0.0 and figures["final_loss"] == 4.0
    assert (
        figures["time_to_first_step_s"] >= 0 and "peak_rss_gib" in figures and "peak_mem_gib" not in figures
    )


def test_step_clock_refuses_a_wrong_step_count():
    clock = StepClock(torch.device("cpu"), warmup_steps=1, timed_steps=2)
    clock.start()
    clock.mark(torch.tensor(1.0))
    with pytest.raises(TurbotrainError, match="expected 3"):
        clock.finish()


def test_init_digest_is_equal_for_the_same_seed_only():
    kw = dict(vocab_size=64, n_layer=1, n_head=2, d_model=16, block_size=8)
    assert init_digest(seeded_model("gpt", kw, 0)) == init_digest(seeded_model("gpt", kw, 0))
    assert init_digest(seeded_model("gpt", kw, 0)) != init_digest(seeded_model("gpt", kw, 1))


@pytest.mark.parametrize("name", ["gpt-tiny", "cnn-224", "mlp-tiny"])
def test_plain_recipe_groups_match_turbotrains(name):
    w = resolve_workload(name, "cpu")
    model = seeded_model(w.model, w.model_kwargs, 0)
    ours = [{id(p) for p in g["params"]} for g in recipe_param_groups(model, 0.1)]
    theirs = [{id(p) for p in g["params"]} for g in param_groups(model, 0.1)]
    assert ours == theirs


def test_plain_warmup_matches_turbotrains_constant_schedule():
    ours, theirs = warmup_factor(5), lr_lambda("constant", 5, 100, 1.0)
    assert [ours(s) for s in range(12)] == pytest.approx([theirs(s) for s in range(12)])


# ------------------------------------------------------------------------------------ contenders


def test_five_contenders_on_cpu_and_a_missing_package_is_a_reason(monkeypatch):
    on_cpu = [n for n in DEFAULT_ORDER if not CONTENDERS[n].cuda_only]
    assert on_cpu == [
        "eager",
        "handtuned",
        "accelerate",
        "lightning",
        "turbotrain",
        "turbotrain-auto",
        "turbotrain-graphs",
    ]
    assert CONTENDERS["eager-bf16"].unavailable("cpu") == "CUDA only"
    # the CUDA-graph row is kept on CPU, refused with the graphs' own one line
    assert CONTENDERS["turbotrain-graphs"].unavailable("cpu") == graphs_unavailable("cpu") != ""
    assert CONTENDERS["turbotrain-graphs"].unavailable("cuda") is None
    monkeypatch.setattr(contenders_mod.importlib.util, "find_spec", lambda name: None)
    assert "lightning is not installed" in CONTENDERS["lightning"].unavailable("cpu")


def test_skipped_rows_launch_no_process(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a skipped row must not run")

    monkeypatch.setattr("turbotrain.app.bench.suite.run_row", boom)
    opts = BenchOptions(device="cpu", work_dir=tmp_path, log=lambda line: None, repeat=2)
    rows = run_rows([RowJob("lightning", "lightning", {}, skip="lightning is not installed")], opts, "x")
    assert rows == [
        {
            "contender": "lightning",
            "row": "lightning",
            "status": "skipped",
            "reason": "lightning is not installed",
        }
    ]


def test_merge_runs_reports_the_median_run_and_keeps_every_run():
    runs = [
        {"status": "ok", "step_ms_median": v, "time_to_first_step_s": t, "final_loss": 1.0}
        for v, t in ((30.0, 3.0), (10.0, 1.0), (20.0, 2.0))
    ]
    row = merge_runs(runs)
    assert row["step_ms_median"] == 20.0 and row["time_to_first_step_s"] == 2.0
    assert [r["step_ms_median"] for r in row["runs"]] == [30.0, 10.0, 20.0]
    assert merge_runs([runs[0], {"status": "failed", "reason": "x"}])["status"] == "failed"


def test_precision_and_ablation_rows_say_why_they_do_not_apply_on_cpu():
    prec = {v.name: v for v in precision_variants("cpu")}
    assert prec["tf32"].skip and not prec["fp32"].skip and not prec["bf16-mixed"].skip
    # fp8: see test_precision_fp8
    assert not any(v.skip for v in precision_variants("cuda") if v.name != "fp8")
    w = resolve_workload("gpt-tiny", "cpu")
    cpu = {v.name: v for v in ablation_variants(w, "cpu")}
    assert cpu["+cuda-graphs"].skip == "CUDA only" and cpu["+prefetch"].skip == "CUDA only"
    assert not cpu["+sdpa-flash"].skip and cpu["baseline"].model == {"attention": "masked"}
    mlp = {v.name: v for v in ablation_variants(resolve_workload("mlp-tiny", "cuda"), "cuda")}
    assert mlp["+sdpa-flash"].skip == "no attention in this model"
    cifar = {v.name: v for v in ablation_variants(resolve_workload("cnn-cifar", "cuda"), "cuda")}
    assert "resident" in cifar["+prefetch"].skip and not cifar["+cudnn-benchmark"].skip


def test_the_step_changes_are_ablation_rows_that_say_when_they_cannot_run(monkeypatch):
    w = resolve_workload("gpt-tiny", "cpu")
    cpu = {v.name: v for v in ablation_variants(w, "cpu")}
    assert (
        cpu["+chunked-loss"].model == {"attention": "masked", "loss": "chunked"}
        and not cpu["+chunked-loss"].skip
    )
    assert cpu["+cudnn-attention"].skip == "cuDNN attention is a CUDA kernel"
    assert cpu["all"].model == {"loss": "chunked"}  # no cuDNN preference where it cannot run
    gpu = resolve_workload("gpt2-small", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    assert (
        "compute capability >= 8.0 (here cuDNN 91000, 7.5)"
        in {v.name: v for v in ablation_variants(gpu, "cuda")}["+cudnn-attention"].skip
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    h100 = {v.name: v for v in ablation_variants(gpu, "cuda")}
    assert not h100["+cudnn-attention"].skip and h100["+cudnn-attention"].model == {"sdpa_backend": "cudnn"}
    assert h100["all"].model == {"loss": "chunked", "sdpa_backend": "cudnn"}
    mlp = {v.name: v for v in ablation_variants(resolve_workload("mlp-tiny", "cuda"), "cuda")}
    assert mlp["+chunked-loss"].skip and mlp["+cudnn-attention"].skip == "no attention in this model"


# ------------------------------------------------------------------------------------ derived figures


def _row(name: str, step_ms: float, loss: float, **extra) -> dict:
    return {
        "contender": name,
        "row": name,
        "status": "ok",
        "step_ms_median": step_ms,
        "final_loss": loss,
        "first_loss": 5.0,
        "time_to_first_step_s": 1.0,
        "init_digest": "abc",
        "math_precision": "bf16",
        "recipe": "r",
        **extra,
    }


def test_no_mfu_on_cpu_or_an_unknown_gpu_and_mfu_on_a_known_one():
    w = resolve_workload("gpt2-small", "cuda")
    flops, _ = flops_per_step(w)
    cpu = _row("a", 100.0, 1.0, device="cpu", device_name="AMD EPYC")
    unknown = _row("b", 100.0, 1.0, device="cuda", device_name="Mystery Accelerator 9000")
    h100 = _row("c", 100.0, 1.0, device="cuda", device_name="NVIDIA H100 80GB HBM3")
    for r in (cpu, unknown, h100):
        derive(r, w, flops)
    assert "mfu" not in cpu and "mfu" not in unknown
    assert h100["mfu"] == pytest.approx(flops / 0.1 / 989e12)
    assert h100["tokens_per_s"] == pytest.approx(16 * 1024 / 0.1)


def _report(rows: list[dict], kind: str = "compare", device: str = "cuda") -> dict:
    w = resolve_workload("gpt2-small", device)
    from dataclasses import asdict

    return {
        "kind": kind,
        "workload": {**asdict(w), "describe": w.describe()},
        "device": device,
        "device_name": rows[0].get("device_name"),
        "rows": rows,
        "flops_method": "m",
        "mfu_basis": "b",
        "timing": "t",
        "tolerance": {"rule": "r"},
        "summary": {},
    }


def test_table_has_no_mfu_column_for_an_unknown_gpu_and_shows_skip_reasons():
    w = resolve_workload("gpt2-small", "cuda")
    flops, _ = flops_per_step(w)
    rows = [
        _row("turbotrain", 50.0, 3.0, device="cuda", device_name="Mystery GPU", peak_mem_gib=1.0),
        {
            "contender": "lightning",
            "row": "lightning",
            "status": "skipped",
            "reason": "lightning is not installed",
        },
    ]
    for r in rows:
        derive(r, w, flops)
    text = render_report(_report(rows))
    header = next(line for line in text.splitlines() if line.startswith("| contender"))
    assert "MFU" not in header
    assert "MFU omitted: no datasheet peak known for 'Mystery GPU'" in text
    assert "skipped (lightning is not installed)" in text
    skipped_line = next(line for line in text.splitlines() if line.startswith("| lightning"))
    assert "—" in skipped_line and "tokens/s" not in skipped_line

    known = [_row("turbotrain", 50.0, 3.0, device="cuda", device_name="NVIDIA H200", peak_mem_gib=1.0)]
    derive(known[0], w, flops)
    assert "| MFU |" in render_report(_report(known))


def test_loss_parity_and_speedup_against_the_reference():
    ref = _row("turbotrain", 50.0, 3.0, math_precision="fp32")
    same = _row("eager", 100.0, 3.0005, math_precision="fp32")
    off = _row("accelerate", 100.0, 3.01, math_precision="fp32")
    mixed = _row("lightning", 25.0, 3.04, math_precision="bf16")
    compare_to([ref, same, off, mixed], ref, speed_key="turbotrain_speedup")
    assert (
        loss_tolerance(same, ref) == SAME_PRECISION_TOL and loss_tolerance(mixed, ref) == MIXED_PRECISION_TOL
    )
    assert same["loss_within_tol"] and not off["loss_within_tol"] and mixed["loss_within_tol"]
    assert same["turbotrain_speedup"] == pytest.approx(2.0) and mixed["turbotrain_speedup"] == pytest.approx(
        0.5
    )


def test_recommendation_is_the_fastest_within_tolerance():
    fp32 = _row("fp32", 100.0, 3.0, math_precision="fp32")
    bf16 = _row("bf16-mixed", 40.0, 3.02)
    true = _row("bf16-true", 30.0, 3.5)
    rows = [fp32, bf16, true]
    compare_to(rows, fp32, speed_key="speedup")
    rec = recommend(rows)
    assert rec["row"] == "bf16-mixed" and rec["speedup"] == pytest.approx(2.5)
    assert rec["outside_tolerance"] == ["bf16-true"]
    assert recommend([{"row": "fp32", "status": "failed"}]) is None


def test_document_records_command_git_and_environment(tmp_path):
    rows = [_row("turbotrain", 50.0, 3.0, device="cpu", device_name="cpu", losses=[3.0], peak_rss_gib=0.3)]
    doc = build_document(
        _report(rows, device="cpu"), "turbotrain bench --workload gpt-tiny", ["turbotrain", "bench"]
    )
    for key in ("schema", "command", "argv", "git", "runtime", "env", "rows", "created_utc"):
        assert key in doc
    assert doc["runtime"]["torch"] == torch.__version__
    json_path, md_path = write_document(doc, tmp_path)
    again = json.loads(json_path.read_text())
    assert again["rows"][0]["final_loss"] == 3.0 and math.isfinite(again["rows"][0]["step_ms_median"])
    assert "| turbotrain |" in md_path.read_text()


def test_a_speedup_within_noise_does_not_displace_fp32():
    fp32 = _row("fp32", 100.0, 3.0, math_precision="fp32")
    bf16 = _row("bf16-mixed", 97.0, 3.01)
    rows = [fp32, bf16]
    compare_to(rows, fp32, speed_key="speedup")
    assert recommend(rows)["row"] == "fp32"


def test_a_diverged_loss_is_written_not_lost(tmp_path):
    rows = [
        _row("turbotrain", 50.0, float("nan"), device="cpu", device_name="cpu", losses=[3.0, float("inf")])
    ]
    doc = build_document(_report(rows, device="cpu"), "c", [])
    json_path, md_path = write_document(doc, tmp_path)
    row = json.loads(json_path.read_text())["rows"][0]
    assert row["final_loss"] == "nan" and row["losses"] == [3.0, "inf"]
    assert "nan" in md_path.read_text()


# ------------------------------------------------------------------------------------ issue 21


def test_step_clock_keeps_losses_that_the_step_overwrites_in_place():
    """Under CUDA graphs the loss is a graph output the next replay overwrites: the clock keeps a copy."""
    clock = StepClock(torch.device("cpu"), warmup_steps=1, timed_steps=2)
    clock.start()
    out = torch.empty(())
    for value in (3.0, 2.0, 1.0):
        out.fill_(value)  # the "replay" writes this step's loss into the same buffer
        clock.mark(out)
    out.fill_(123.0)
    assert clock.finish()["losses"] == [3.0, 2.0, 1.0]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_precision_row_runs_with_compile_off(device):
    for v in precision_variants(device):
        assert v.overrides["compile"] == {"scope": "off"}, v.name  # compile's auto is on for CUDA


def _h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)


def test_the_ablation_has_a_bf16_compile_ladder_first(monkeypatch):
    _h100(monkeypatch)
    rows = ablation_variants(resolve_workload("gpt2-small", "cuda"), "cuda")
    bf16 = [v for v in rows if v.ladder == "bf16-compile"]
    assert (
        [v.name for v in rows[:5]]
        == [v.name for v in bf16]
        == [
            "bf16-compile",
            "bf16-compile+cudnn-attention",
            "bf16-compile+chunked-loss",
            "bf16-compile+cuda-graphs",
            "bf16-compile+fp8",
        ]
    )
    base = bf16[0].overrides
    assert base["precision"]["mode"] == "bf16-mixed" and base["compile"]["scope"] == "model"
    for v in bf16[:4]:  # one change each on the same base, and each runs on an H100 (fp8: test_precision_fp8)
        assert not v.skip and v.overrides["precision"] == base["precision"], v.name
    by = {v.name: v for v in bf16}
    assert by["bf16-compile+cudnn-attention"].model == {"sdpa_backend": "cudnn"}
    assert by["bf16-compile+chunked-loss"].model == {"loss": "chunked"}
    assert by["bf16-compile+cuda-graphs"].overrides["compile"] == {
        "scope": "model",
        "mode": "reduce-overhead",
    }
    fp32 = [v for v in rows if v.ladder == "fp32-eager"]
    assert fp32[0].name == "baseline" and len(fp32) + len(bf16) == len(rows)  # the fp32 ladder stays
    cpu = [
        v for v in ablation_variants(resolve_workload("gpt-tiny", "cpu"), "cpu") if v.ladder == "bf16-compile"
    ]
    assert len(cpu) == 5 and all("GPU question" in v.skip for v in cpu)
    cnn = {v.name: v for v in ablation_variants(resolve_workload("cnn-224", "cuda"), "cuda")}
    assert cnn["bf16-compile+chunked-loss"].skip and not cnn["bf16-compile+cuda-graphs"].skip


def test_ablation_rows_compare_with_their_own_ladders_base(tmp_path, monkeypatch):
    from turbotrain.app.bench import suite

    speeds = {"bf16-compile": 10.0, "bf16-compile+cuda-graphs": 5.0, "baseline": 40.0, "+compile": 20.0}
    monkeypatch.setattr(
        suite,
        "run_row",
        lambda contender, spec, name, opts: _row(
            "turbotrain", speeds[name.split("ablation-")[1]], 3.0, device="cpu", math_precision="fp32"
        ),
    )
    _h100(monkeypatch)
    opts = BenchOptions(device="cuda", work_dir=tmp_path, log=lambda line: None)
    w = resolve_workload("mlp-tiny", "cpu", warmup_steps=1, timed_steps=2)
    report = suite.run_ablation(w, opts, only=["bf16-compile+cuda-graphs", "+compile"])
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["bf16-compile", "bf16-compile+cuda-graphs", "baseline", "+compile"]
    assert rows["bf16-compile+cuda-graphs"]["speedup"] == rows["+compile"]["speedup"] == 2.0
    text = render_report(report)
    assert (
        "reference: bf16-compile" in text
        and "| speedup vs bf16-compile |" in text
        and "| speedup vs baseline |" in text
    )


def test_rows_report_progress_and_name_the_runs_still_missing(tmp_path, monkeypatch):
    from turbotrain.app.bench import suite

    monkeypatch.setattr(
        suite, "run_row", lambda contender, spec, name, opts: _row(contender, 10.0, 3.0, device="cpu")
    )
    seen = []
    opts = BenchOptions(
        device="cpu", work_dir=tmp_path, log=lambda line: None, repeat=2, progress=seen.append
    )
    jobs = [
        RowJob("a", "eager", {}),
        RowJob("b", "lightning", {}, skip="not installed"),
        RowJob("c", "turbotrain", {}),
    ]
    final = suite.run_report(jobs, opts, "x", lambda rows: {"rows": rows})
    assert [r["missing"] for r in seen] == [
        ["a (run 1)", "c (run 1)", "a (run 2)", "c (run 2)"],
        ["c (run 1)", "a (run 2)", "c (run 2)"],
        ["a (run 2)", "c (run 2)"],
        ["c (run 2)"],
        [],
    ]
    assert [r["complete"] for r in seen] == [False] * 4 + [True] and seen[-1] is final
    first = {r["row"]: r for r in seen[0]["rows"]}
    assert first["a"] == {
        "contender": "eager",
        "row": "a",
        "status": "not run",
        "reason": "bench stopped before this row",
    }
    assert first["b"]["status"] == "skipped"
    assert [r["status"] for r in seen[1]["rows"]] == ["ok", "skipped", "not run"]
    assert [r["status"] for r in final["rows"]] == ["ok", "skipped", "ok"] and len(
        final["rows"][0]["runs"]
    ) == 2


def test_report_writer_rewrites_the_document_after_each_row(tmp_path):
    from turbotrain.app.bench.results import ReportWriter

    write = ReportWriter(tmp_path, "turbotrain bench", ["turbotrain", "bench"])
    partial = _report(
        [
            _row("eager", 10.0, 3.0, device="cpu"),
            {
                "contender": "turbotrain",
                "row": "turbotrain",
                "status": "not run",
                "reason": "bench stopped before this row",
            },
        ],
        device="cpu",
    )
    json_path, md_path = write({**partial, "complete": False, "missing": ["turbotrain"]})
    doc = json.loads(json_path.read_text())
    assert (
        doc["complete"] is False and doc["missing"] == ["turbotrain"] and doc["command"] == "turbotrain bench"
    )
    assert (
        "INCOMPLETE" in md_path.read_text()
        and "not run (bench stopped before this row)" in md_path.read_text()
    )
    write(
        {**_report([_row("eager", 10.0, 3.0, device="cpu")], device="cpu"), "complete": True, "missing": []}
    )
    assert json.loads(json_path.read_text())["complete"] is True and "INCOMPLETE" not in md_path.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_the_commit_comes_from_tt_commit_where_there_is_no_git(tmp_path, monkeypatch):
    from turbotrain.app.doctor import collect_env
    from turbotrain.base import version

    monkeypatch.setattr(version, "PACKAGE_ROOT", tmp_path)  # a tree shipped without its .git
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("TT_COMMIT", raising=False)
    assert version.collect_git()["commit"] is None
    monkeypatch.setenv("TT_COMMIT", "0123abc")
    doc = build_document(_report([_row("turbotrain", 50.0, 3.0, device="cpu")], device="cpu"), "c", [])
    assert doc["git"] == {"commit": "0123abc", "source": "TT_COMMIT"}
    assert collect_env()["git"] == doc["git"]  # doctor's report, and every result file that embeds it
    # installed inside another project's git checkout: that project's commit is not turbotrain's
    monkeypatch.delenv("TT_COMMIT")
    project = tmp_path / "project"
    (project / "lib" / "turbotrain").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(
        [
            "git",
            "-C",
            str(project),
            "-c",
            "user.name=a",
            "-c",
            "user.email=a@b",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "theirs",
        ],
        check=True,
    )
    monkeypatch.setattr(version, "PACKAGE_ROOT", project / "lib" / "turbotrain")
    monkeypatch.delenv("GIT_CEILING_DIRECTORIES")
    other = version.collect_git()
    assert other["commit"] is None and "installed" in other["detail"], other
