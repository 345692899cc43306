"""End-to-end: `turbotrain train` / `sample` as a user runs them, on a tiny config."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest

import turbotrain.loop
from turbotrain.cli import main
from turbotrain.config import load_config
from turbotrain.training import train

from conftest import tiny_overrides


def _args(tmp_path: Path, text_file: Path, *extra: str) -> list[str]:
    o = tiny_overrides(tmp_path, data={"path": str(text_file)})
    args = ["train", "--no-progress"]
    for section, values in o.items():
        if section == "monitor":
            values = {k: v for k, v in values.items() if k != "progress"}
        args += [f"--{section}.{k}={v}" for k, v in values.items()]
    return args + list(extra)


def test_train_writes_the_run_directory_and_sample_prints_text(tmp_path, text_file, capsys):
    assert main(_args(tmp_path, text_file)) == 0
    run = tmp_path / "runs" / "t"
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoints"} <= {p.name for p in run.iterdir()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(r["tokens_per_s"] > 0 for r in records) and records[-1]["val_loss"] is not None
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["resolved"]["precision"] == "fp32" and summary["resolved"]["compile"] == "off"
    assert load_config(str(run / "config.toml")).model.d_model == 32  # the resolved config reloads
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "30", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["sample", str(run), "--tokens", "5", "--top-k", "0"]) == 0  # 0 = no top-k cut
    capsys.readouterr()
    _one_line_error(capsys, main(["sample", str(run), "--top-k", "-3"]), "--top-k")


def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path, text_file):
    straight = load_config(overrides=tiny_overrides(tmp_path / "a", data={"path": str(text_file)}, train={"max_steps": 8}))
    full = train(straight, progress=False)

    split = tiny_overrides(tmp_path / "b", data={"path": str(text_file)}, train={"max_steps": 8, "stop_after_steps": 4})
    first = train(load_config(overrides=split), progress=False)
    assert first["status"] == "stopped" and first["steps"] == 4
    run = tmp_path / "b" / "runs" / "t"
    assert main(["train", "--resume", "--run.out_dir", str(tmp_path / "b" / "runs"), "--run.name=t",
                 "--train.stop_after_steps=0", "--no-progress"]) == 0
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 8 and resumed["resumed_from"] == "step_00000004.pt"
    assert abs(resumed["final_val_loss"] - full["final_val_loss"]) < 1e-4
    assert abs(resumed["final_train_loss"] - full["final_train_loss"]) < 1e-4


def _one_line_error(capsys, code: int, *words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err


def test_bad_inputs_give_one_line_errors(tmp_path, text_file, capsys):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    empty = tmp_path / "empty"
    empty.mkdir()
    big = tmp_path / "big.bin"  # token ids up to 999, but its meta.json says 500
    (np.arange(4000) % 1000).astype(np.uint16).tofile(big)
    (tmp_path / "big.json").write_text('{"vocab_size": 500}')
    cases = [
        (["--data", str(tmp_path / "nope")], ["does not exist"]),
        (["--data", str(empty)], ["holds no text"]),
        (["--data", str(odd)], ["whole number of uint16 tokens"]),
        (["--preset", "gpt-huge"], ["unknown preset", "gpt-tiny"]),
        (["--precision.mode=fp16-mixed"], ["fp16-mixed", "fp32"]),
        (["--batch.micro=100000"], ["batch.micro"]),
        (["--optim.schedule=exp"], ["optim.schedule", "cosine"]),
        (["--data", str(big), "--model.vocab_size=0"], ["token id 999", "--model.vocab_size=1000"]),
        (["--model.vocab_size=100"], ["vocabulary is 100", "--model.vocab_size="]),
    ]
    for extra, words in cases:
        _one_line_error(capsys, main(_args(tmp_path, text_file, *extra)), *words)
    assert not (tmp_path / "runs" / "t").exists()  # not even an empty run directory


def test_existing_run_is_never_overwritten_and_corrupt_checkpoints_are_reported(tmp_path, text_file, capsys):
    assert main(_args(tmp_path, text_file)) == 0
    run = tmp_path / "runs" / "t"
    before = (run / "metrics.jsonl").read_text()
    _one_line_error(capsys, main(_args(tmp_path, text_file)), "already exists", "--resume")
    assert (run / "metrics.jsonl").read_text() == before
    for ckpt in (run / "checkpoints").glob("*.pt"):
        ckpt.write_bytes(b"broken")
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--resume")), "no usable checkpoint")
    assert (run / "metrics.jsonl").read_text() == before  # nothing already written is lost


def test_loop_reads_no_config():
    tree = ast.parse(Path(turbotrain.loop.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "config" not in names | attrs and "options" not in attrs
    assert not any("config" in (m or "") for m in modules) and "RunConfig" not in imports


def test_own_loop_example_runs(capsys):
    import runpy

    runpy.run_path(str(Path(__file__).parents[2] / "examples" / "own_loop.py"), run_name="__main__")
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0]


def test_resume_mistakes_give_one_line_errors_and_lose_nothing(tmp_path, text_file, capsys):
    assert main(_args(tmp_path, text_file)) == 0
    run = tmp_path / "runs" / "t"
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--resume", "--model.n_layer=3")), "does not fit", "--model")
    assert (run / "metrics.jsonl").read_text() == before
    # a max_steps the run has already passed: nothing to train, the summary still prints
    assert main(_args(tmp_path, text_file, "--resume", "--train.max_steps=2")) == 0
    assert "val loss" in capsys.readouterr().out
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_error(capsys, main(_args(tmp_path, text_file, f"--run.out_dir={blocker}")), "cannot create run directory")


def test_resume_takes_a_run_directory(tmp_path, text_file, capsys):
    assert main(_args(tmp_path, text_file)) == 0
    run = tmp_path / "runs" / "t"
    capsys.readouterr()
    _one_line_error(capsys, main(["train", "--resume", str(tmp_path / "nope"), "--no-progress"]), "no run named", "--resume")
    _one_line_error(capsys, main(["train", "--resume", str(run), "--run.name=other"]), "not both")
    assert main(["train", "--resume", str(run), "--no-progress", "--train.max_steps=8"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from"] == "step_00000006.pt"
