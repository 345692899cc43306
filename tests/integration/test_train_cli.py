"""End-to-end: `turbotrain train` / `sample` as a user runs them, on a tiny config."""

import ast
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CORPUS, tiny_overrides

import turbotrain.core.engine
import turbotrain.loop.fit
from turbotrain import load_config
from turbotrain.app.training import train
from turbotrain.cli import main
from turbotrain.loop.checkpoint import save_checkpoint


def _args(tmp_path: Path, text_file: Path, *extra: str) -> list[str]:
    o = tiny_overrides(tmp_path, data={"path": str(text_file)})
    args = ["train", "--no-progress"]
    for section, values in o.items():
        if section == "monitor":
            values = {k: v for k, v in values.items() if k != "progress"}
        args += [f"--{section}.{k}={v}" for k, v in values.items()]
    return args + list(extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The tiny run of :func:`_args` (6 steps), trained once for the tests that read it or take a
    copy of it (:func:`_trained_in`): ``ROOT/runs/t``, on ``ROOT/corpus.txt``."""
    root = tmp_path_factory.mktemp("trained")
    text = root / "corpus.txt"
    text.write_text(CORPUS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TT_COMMIT", "0123abc")  # as a device machine's command gives it (no .git there)
        assert main(_args(root, text)) == 0
    return root


def _trained_in(trained: Path, tmp_path: Path, text_file: Path) -> Path:
    """A copy of the :func:`trained` run where ``main(_args(tmp_path, text_file))`` would have
    trained it (``tmp_path/runs/t``; the same tokens: ``text_file`` holds the same text)."""
    assert text_file.read_text() == (trained / "corpus.txt").read_text()
    run = tmp_path / "runs" / "t"
    shutil.copytree(trained / "runs" / "t", run)
    return run


def test_train_writes_the_run_directory_and_sample_prints_text(trained, capsys):
    run = trained / "runs" / "t"
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoints"} <= {p.name for p in run.iterdir()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # logging every 2, evaluating every 3: both kept
    assert [r["step"] for r in records if r.get("val_loss") is not None] == [3, 6]
    assert all(r["tokens_per_s"] > 0 for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["git"] == {"commit": "0123abc", "source": "TT_COMMIT"}
    assert summary["resolved"]["precision"] == "fp32" and summary["resolved"]["compile"] == "off"
    assert load_config(str(run / "config.toml")).model.d_model == 32  # the resolved config reloads
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "30", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["sample", str(run), "--tokens", "5", "--top-k", "0"]) == 0  # 0 = no top-k cut
    capsys.readouterr()
    _one_line_error(capsys, main(["sample", str(run), "--top-k", "-3"]), "--top-k")


def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path, text_file):
    straight = load_config(
        overrides=tiny_overrides(tmp_path / "a", data={"path": str(text_file)}, train={"max_steps": 8})
    )
    full = train(straight, progress=False)

    split = tiny_overrides(
        tmp_path / "b", data={"path": str(text_file)}, train={"max_steps": 8, "stop_after_steps": 4}
    )
    first = train(load_config(overrides=split), progress=False)
    assert first["status"] == "stopped" and first["steps"] == 4
    run = tmp_path / "b" / "runs" / "t"
    assert (
        main(
            [
                "train",
                "--resume",
                "--run.out_dir",
                str(tmp_path / "b" / "runs"),
                "--run.name=t",
                "--train.stop_after_steps=0",
                "--no-progress",
            ]
        )
        == 0
    )
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


def test_config_values_that_gave_tracebacks_or_odd_runs_are_refused_at_once(tmp_path, text_file, capsys):
    """Defects 9 and 10: every float is checked for finiteness and range when the config is
    built (an inf learning rate was caught only after 10 steps, a NaN clip turned clipping off),
    the device and seed are checked, the run name is one folder inside out_dir."""
    negative = tmp_path / "neg"
    negative.mkdir()
    np.arange(4000, dtype=np.uint16).tofile(negative / "toks.bin")
    (negative / "meta.json").write_text('{"vocab_size": -3}')
    cases = [
        (["--optim.lr=nan"], ["optim.lr = nan", "finite", "--optim.lr=0.002"]),
        (["--optim.lr=inf"], ["optim.lr = inf", "finite"]),
        (["--optim.min_lr=nan"], ["optim.min_lr", "finite"]),
        (["--optim.beta1=1.5"], ["optim.beta1 = 1.5", "[0, 1)", "--optim.beta1=0.9"]),
        (["--optim.beta2=nan"], ["optim.beta2", "finite"]),
        (["--optim.eps=nan"], ["optim.eps", "finite"]),
        (["--optim.grad_clip=nan"], ["optim.grad_clip", "finite"]),
        (["--optim.weight_decay=-inf"], ["optim.weight_decay", "finite"]),
        (["--batch.headroom=nan"], ["batch.headroom", "finite"]),
        (["--run.device=mps"], ["run.device = 'mps'", "cpu, cuda, cuda:N"]),
        (["--run.device=meta"], ["run.device = 'meta'", "cpu, cuda, cuda:N"]),
        ([f"--run.seed={2**70}"], ["run.seed", "64-bit", "--run.seed=1337"]),
        ([f"--run.seed={2**40}"], ["run.seed", "range [0, 4294967295]"]),
        (["--run.name=grp/a"], ["run.name = 'grp/a'", "one folder name", "--run.out_dir=runs/GROUP"]),
        (["--run.name=../../x"], ["run.name = '../../x'", "one folder name"]),
        (["--run.name=.."], ["run.name = '..'"]),
        (["--data", str(negative / "toks.bin")], ["meta.json", "vocab_size", "from 1 to 65536"]),
    ]
    for extra, words in cases:
        _one_line_error(capsys, main(_args(tmp_path, text_file, *extra)), *words)
    assert not (tmp_path / "runs" / "t").exists() and not (tmp_path / "runs" / "grp").exists()
    assert not (tmp_path.parent / "x").exists()  # ../../x from out_dir: nothing written outside it


def test_a_preset_file_that_is_not_utf8_is_one_line(tmp_path, text_file, capsys):
    preset = tmp_path / "mine.toml"
    preset.write_bytes(b"[optim]\nlr = 0.001 # \xff\xfe\n")
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--preset", str(preset))), "mine.toml", "UTF-8")


def test_a_warmup_longer_than_the_run_is_said(tmp_path, text_file, caplog):
    """Defect 9: --optim.warmup_steps 500 with 20 steps silently never reached the peak LR."""
    assert main(_args(tmp_path, text_file, "--optim.warmup_steps=24", "--train.max_steps=6")) == 0
    err = caplog.text
    assert (
        "optim.warmup_steps = 24 is longer than the run" in err
        and "25%" in err
        and "--optim.warmup_steps=6" in err
    )


def test_a_resume_never_counts_a_step_twice_in_the_metrics(tmp_path, text_file, capsys):
    """Defect 11: each resume logged the steps after its checkpoint again (and a line torn by a
    kill spoiled the next record); the report's medians counted them twice."""
    assert main(_args(tmp_path, text_file, "--train.checkpoint_every=4")) == 0  # checkpoints at 4 and 6
    run = tmp_path / "runs" / "t"
    for f in (run / "checkpoints").glob("step_00000006.pt*"):
        f.unlink()  # as if killed after logging step 6, before its checkpoint
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.2')  # torn by the kill
    assert main(_args(tmp_path, text_file, "--train.checkpoint_every=4", "--resume")) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3, 4, 6]  # logged at 2/4/6 and evaluated at 3/6, each once
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == "step_00000004.pt"


def test_a_run_without_a_checkpoint_resumes_from_step_zero(trained, tmp_path, text_file, capsys):
    """Defect 3: a run killed before its first checkpoint could neither resume ("no checkpoint;
    start without --resume") nor restart ("already exists; pass --resume"). Also: `sample`
    refuses a checkpoint that holds no GPT in one line."""
    run = _trained_in(trained, tmp_path, text_file)
    straight = json.loads((run / "summary.json").read_text())
    shutil.rmtree(run / "checkpoints")  # what a run killed before its first checkpoint has
    (run / "summary.json").unlink()
    _one_line_error(capsys, main(_args(tmp_path, text_file)), "already exists", "--resume")
    assert main(_args(tmp_path, text_file, "--resume")) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == "" and summary["steps"] == 6
    assert summary["final_train_loss"] == straight["final_train_loss"]
    save_checkpoint(run / "checkpoints", 7, {"model": {"w": torch.zeros(2)}})
    capsys.readouterr()
    _one_line_error(
        capsys, main(["sample", str(run), "--tokens", "3"]), "step_00000007.pt", "no GPT token embedding"
    )


def test_existing_run_is_never_overwritten_and_corrupt_checkpoints_are_reported(
    trained, tmp_path, text_file, capsys
):
    run = _trained_in(trained, tmp_path, text_file)
    before = (run / "metrics.jsonl").read_text()
    _one_line_error(capsys, main(_args(tmp_path, text_file)), "already exists", "--resume")
    assert (run / "metrics.jsonl").read_text() == before
    for ckpt in (run / "checkpoints").glob("*.pt"):
        ckpt.write_bytes(b"broken")
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--resume")), "no usable checkpoint")
    assert (run / "metrics.jsonl").read_text() == before  # nothing already written is lost


def test_loop_reads_no_config():
    tree = ast.parse(Path(turbotrain.loop.fit.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "config" not in names | attrs and "options" not in attrs
    assert not any("config" in (m or "") for m in modules) and "RunConfig" not in imports


def test_own_loop_example_runs(capsys):
    import runpy

    runpy.run_path(str(Path(__file__).parents[2] / "examples" / "own_loop.py"), run_name="__main__")
    losses = [
        float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step")
    ]
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0]


def test_resume_mistakes_give_one_line_errors_and_lose_nothing(trained, tmp_path, text_file, capsys):
    run = _trained_in(trained, tmp_path, text_file)
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    _one_line_error(
        capsys, main(_args(tmp_path, text_file, "--resume", "--model.n_layer=3")), "does not fit", "--model"
    )
    assert (run / "metrics.jsonl").read_text() == before
    # a max_steps the run has already passed: nothing to train, the summary still prints
    assert main(_args(tmp_path, text_file, "--resume", "--train.max_steps=2")) == 0
    assert "val loss" in capsys.readouterr().out
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_line_error(
        capsys, main(_args(tmp_path, text_file, f"--run.out_dir={blocker}")), "cannot create run directory"
    )


def test_resume_takes_a_run_directory(trained, tmp_path, text_file, capsys):
    run = _trained_in(trained, tmp_path, text_file)
    capsys.readouterr()
    _one_line_error(
        capsys,
        main(["train", "--resume", str(tmp_path / "nope"), "--no-progress"]),
        "no run named",
        "--resume",
    )
    _one_line_error(capsys, main(["train", "--resume", str(run), "--run.name=other"]), "not both")
    assert main(["train", "--resume", str(run), "--no-progress", "--train.max_steps=8"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["resumed_from"] == "step_00000006.pt"


def test_resume_overrides_are_checked_against_the_run_and_a_failed_resume_keeps_its_config(
    tmp_path, text_file, capsys, monkeypatch
):
    """Issue 23, items 8 and 9: resume overrides were validated against the default preset (a
    d_model 48 run could not take --model.n_head=3: "d_model = 128 must be divisible by 3"), and a
    resume that failed rewrote the run's config.toml with its overrides."""
    assert main(_args(tmp_path, text_file, "--model.d_model=48")) == 0
    run = tmp_path / "runs" / "t"
    saved = (run / "config.toml").read_text()
    resume = ["train", "--resume", str(run), "--no-progress", "--train.max_steps=8"]
    # its first step fails: the config stays the one the run trained with
    with monkeypatch.context() as patch:
        patch.setattr(
            turbotrain.Engine, "train_window", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
        )
        with pytest.raises(RuntimeError, match="boom"):
            main([*resume, "--optim.lr=1e-3"])
    assert (run / "config.toml").read_text() == saved
    capsys.readouterr()
    assert main([*resume, "--model.n_head=3"]) == 0  # 48 divides by 3; gpt-tiny's 128 would not
    trained = load_config(str(run / "config.toml"))
    assert (trained.model.d_model, trained.model.n_head, trained.train.max_steps) == (48, 3, 8)
    assert json.loads((run / "summary.json").read_text())["steps"] == 8
