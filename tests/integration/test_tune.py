"""`turbotrain tune` end to end on a tiny GPT: the batch finder bounds the micro-batch, trials run
in their own processes, and the preset it writes trains with `turbotrain train --preset`. Two
short trials only (the 8-trial gpt-tiny study is a benchmark, not a test)."""

from __future__ import annotations

import json

import pytest

from turbotrain import load_config
from turbotrain.cli import main

pytest.importorskip("optuna")


def test_a_tiny_tune_writes_a_preset_that_train_accepts(tmp_path, text_file, capsys):
    fixed = [
        "--run.device=cpu",
        f"--run.out_dir={tmp_path / 'runs'}",
        "--run.name=study",
        "--model.n_layer=1",
        "--model.n_head=2",
        "--model.d_model=32",
        "--model.block_size=32",
        f"--data.path={text_file}",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--batch.global_size=16",
        "--precision.mode=fp32",
        "--compile.scope=off",
        "--model.attention=sdpa",
        "--model.loss=full",
        "--memory.checkpointing=off",
        "--data.num_workers=0",
        "--train.max_steps=2",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--monitor.progress=false",
        "--monitor.nvml=false",
    ]
    out = tmp_path / "best.toml"
    code = main(
        [
            "tune",
            "--preset",
            "gpt-tiny",
            "--trials",
            "2",
            "--trial-warmup",
            "1",
            "--trial-steps",
            "2",
            "--window",
            "1",
            "--threads",
            "1",
            "--confirm",
            "0",
            "--out",
            str(out),
            *fixed,
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    run_dir = tmp_path / "runs" / "study"
    doc = json.loads((run_dir / "tune.json").read_text())
    assert {d["key"] for d in doc["space"]} == {"batch.micro", "optim.implementation"}  # the rest was fixed
    micro = next(d for d in doc["space"] if d["key"] == "batch.micro")
    assert set(micro["choices"]) <= {1, 2, 4, 8, 16} and 16 in micro["choices"]  # finder-bounded, dividing 16
    ran = [t for t in doc["trials"] if t.get("counted")]
    assert (
        len(ran) == 2
        and ran[0]["baseline"]
        and ran[0]["params"] == {"batch.micro": 16, "optim.implementation": "fused"}
    )
    for t in ran:
        assert t["status"] in ("ok", "pruned") and t["peak_bytes"] > 0
        if t["status"] == "ok":
            assert t["throughput"] > 0 and t["loss_diff"] is not None and abs(t["loss_diff"]) <= t["loss_tol"]
    assert doc["best"] is not None and doc["preset"] == str(out)
    assert (
        (run_dir / "study.db").is_file()
        and (run_dir / "tune.md").is_file()
        and (run_dir / "tune.png").is_file()
    )
    assert f"turbotrain train --preset {out}" in printed
    config = load_config(str(out))  # the preset holds the whole config, with the best settings
    best = doc["best"]["params"]
    assert config.batch.micro == best["batch.micro"] and config.batch.micro * config.batch.accumulation == 16
    assert config.optim.implementation == best["optim.implementation"] and config.run.name == ""
    assert config.memory.on_oom == "halve"  # the trials' "stop" is not carried into training
    assert (
        main(["train", "--preset", str(out), f"--run.out_dir={tmp_path / 'trained'}", "--no-progress"]) == 0
    )


def test_a_model_that_does_not_exist_stops_before_any_trial(tmp_path, capsys):
    assert main(["tune", "--model", "nowhere.py:make", "--run.device=cpu", f"--run.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "there is no file nowhere.py" in err[0]
    assert not any(tmp_path.iterdir())
