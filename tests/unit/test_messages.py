"""What a user reads: warnings as one line, no noise from optional packages, no traceback from a
closed pipe, no warning a default causes, and wordings that name the field the user set (issue 32)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HANG_S, tiny_overrides
from torch import nn

from turbotrain import Engine, fit
from turbotrain.app import run_settings
from turbotrain.app.bench import worker
from turbotrain.app.measure import Target
from turbotrain.app.training import train
from turbotrain.app.tune import space
from turbotrain.base.config import audience, load_config, setting, to_toml
from turbotrain.base.errors import (
    ConfigError,
    ImportNoise,
    TurbotrainError,
    TurbotrainWarning,
    logging_unless_configured,
    quiet_imports,
)
from turbotrain.base.rundir import CONFIG_FILE, run_name, workload_label
from turbotrain.base.signals import StopSignals
from turbotrain.cli import format_warning
from turbotrain.cli.sample import newest_generating_run
from turbotrain.core.precision import FP8, DeviceCaps, resolve_precision
from turbotrain.loop.monitor import Monitor
from turbotrain.parts.data import sources


def test_a_turbotrain_warning_is_one_line_without_a_source_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_precision("bf16-mixed", DeviceCaps("cpu"))
    [w] = caught
    text = format_warning(w.message, w.category, w.filename, w.lineno, None)
    assert (
        text
        == "WARNING turbotrain: precision.mode = 'bf16-mixed' on CPU: without bf16 units this is often many "
        "times slower than fp32\n"
    )
    other = format_warning(UserWarning("theirs"), UserWarning, "/x/lib.py", 7, "warn()")
    assert "/x/lib.py:7" in other  # someone else's warning keeps the line that points at it


def test_quiet_imports_hides_torchao_load_noise_only_inside(caplog: pytest.LogCaptureFixture) -> None:
    with quiet_imports():
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torch.utils._pytree").warning("Enum subclass ... deprecated")
        logging.getLogger("torchao").error("a real failure")
    logging.getLogger("torchao").warning("after the import")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["a real failure", "after the import"]


def test_import_noise_filter_drops_torchaos_two_import_lines_only(caplog: pytest.LogCaptureFixture) -> None:
    """What ``import turbotrain`` installs for the process (transformers imports torchao after it)."""
    assert any(isinstance(f, ImportNoise) for f in logging.getLogger("torchao").filters)
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    torchao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library: /x/_C_mxfp8.so")
    pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as ...", "<enum>")
    torchao.warning("Failed to load the checkpoint")  # not an extension: a real message
    pytree.warning("something else")
    logging.getLogger("mine").warning("Failed to load /my/own.so: mine")  # the user's own logger
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Failed to load the checkpoint", "something else", "Failed to load /my/own.so: mine"]


def test_turbotrains_lines_show_as_the_clis_only_where_no_logging_is_set_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``turbotrain.train()`` in a plain script: its INFO lines on stderr, in the CLI's format;
    another library's INFO stays silent, the root logger gets no handler, and a program's own
    logging set-up (here pytest's handler on the root) is left to do its job."""
    root = logging.getLogger()
    with logging_unless_configured():  # pytest's capture handler is on the root: nothing added
        assert logging.getLogger("turbotrain").handlers == []
    monkeypatch.setattr(root, "handlers", [])
    with logging_unless_configured():
        logging.getLogger("turbotrain.loop.monitor.hook").info("training 10 params")
        logging.getLogger("other").info("not turbotrain's")
        assert root.handlers == []
    logging.getLogger("turbotrain.loop.monitor.hook").info("after the call")
    assert capsys.readouterr().err == "INFO turbotrain.loop.monitor.hook: training 10 params\n"
    assert logging.getLogger("turbotrain").handlers == [] and logging.getLogger("turbotrain").level == 0


def test_turbotrains_warnings_are_one_line_where_no_logging_is_set_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the CLI: in ``turbotrain.train()`` a TurbotrainWarning is one line, another warning keeps
    Python's format (its source line), and Python's format is back after the call."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    python_format = warnings.formatwarning
    with logging_unless_configured():
        ours = warnings.formatwarning(TurbotrainWarning("slow here"), TurbotrainWarning, "/x/t.py", 3)
        theirs = warnings.formatwarning(UserWarning("theirs"), UserWarning, "/x/lib.py", 7, "warn()")
    assert ours == "WARNING turbotrain: slow here\n"
    assert "/x/lib.py:7" in theirs
    assert warnings.formatwarning is python_format


@pytest.mark.slow
def test_help_config_into_head_ends_without_a_traceback() -> None:
    """As ``turbotrain train --help-config | head``, with the reader gone before the first write."""
    child = subprocess.Popen(
        [sys.executable, "-m", "turbotrain", "train", "--help-config"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child.stdout.close()  # the reader leaves: every write meets a closed pipe
    err = child.stderr.read()
    assert child.wait(timeout=HANG_S) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_the_default_warmup_is_not_a_warning_on_a_short_run(caplog: pytest.LogCaptureFixture) -> None:
    run_settings.warn_long_warmup(load_config("gpt-tiny", {"train": {"max_steps": 20}}))
    assert not caplog.records
    run_settings.warn_long_warmup(
        load_config("gpt-tiny", {"train": {"max_steps": 20}, "optim": {"warmup_steps": 40}})
    )
    assert "optim.warmup_steps = 40 is longer than the run" in caplog.text


# ----------------------------------------------------------------------------- item 10: wording


class _HugeData:
    """RunData's steps_per_epoch for a data set of 10 million steps per epoch."""

    def steps_per_epoch(self, c, world: int) -> int:
        return 10_000_000


def test_too_many_epochs_names_train_epochs_and_its_largest_value() -> None:
    c = load_config("gpt-tiny", {"train": {"epochs": 20}})
    with audience("cli"), pytest.raises(ConfigError) as caught:
        run_settings.resolve_epochs(c, _HugeData(), 1)
    text = str(caught.value)
    assert text.startswith("train.epochs = 20 is too many for this data") and "--train.epochs=9 " in text
    assert "max_steps =" not in text


def test_fp8_nothing_converted_advises_by_the_reason_not_min_size(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torchao")

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, 64)

    with warnings.catch_warnings(), audience("cli"):
        warnings.simplefilter("ignore")  # fp8_emulate's "for correctness tests"
        fp8 = FP8(emulate=True, min_size=1, skip=("body",))
        fp8.convert_module(Head())
    [line] = [r.getMessage() for r in caplog.records if "no linear layer passed" in r.getMessage()]
    assert "--precision.fp8_lm_head=True" in line and "fewer precision.fp8_skip prefixes (now 'body')" in line
    assert "fp8_min_size=1" not in line


def test_fp8_fields_without_fp8_mode_are_refused_in_one_line() -> None:
    with audience("cli"), pytest.raises(ConfigError) as caught:
        load_config("gpt-tiny", {"precision": {"fp8_min_size": 1, "fp8_lm_head": True}})
    assert str(caught.value) == (
        "precision.fp8_min_size, precision.fp8_lm_head configure precision.mode = 'fp8' and this "
        "run is precision.mode = 'auto': they would do nothing; drop them, or add "
        "--precision.mode=fp8"
    )
    assert (
        load_config("gpt-tiny", {"precision": {"mode": "fp8", "fp8_min_size": 1}}).precision.fp8_min_size == 1
    )


def test_bench_out_of_memory_advice_is_a_flag(tmp_path, monkeypatch) -> None:
    def out_of_memory(name: str, spec: dict) -> dict:
        raise TurbotrainError(
            f"out of memory at batch.micro 64: use {setting('memory.checkpointing', 'full')}"
        )

    monkeypatch.setattr(worker, "run", out_of_memory)
    (tmp_path / "spec.json").write_text("{}")
    assert (
        worker.main(
            ["turbotrain", "--spec", str(tmp_path / "spec.json"), "--result", str(tmp_path / "r.json")]
        )
        == 1
    )
    reason = json.loads((tmp_path / "r.json").read_text())["reason"]
    assert "use --memory.checkpointing=full" in reason and "{" not in reason


@pytest.mark.slow
def test_resume_of_a_complete_run_says_so(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    overrides = tiny_overrides(tmp_path, train={"max_steps": 2, "eval_every": 2, "checkpoint_every": 2})
    train(load_config("gpt-tiny", overrides), progress=False)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        summary = train(
            load_config("gpt-tiny", overrides), resume_dir=tmp_path / "runs" / "t", progress=False
        )
    assert summary["status"] == "completed"
    assert (
        "is complete (step 2 of 2): nothing to train; to train on, resume with a larger train.max_steps"
        in caplog.text
    )


def _run(out: Path, name: str, overrides: dict) -> None:
    (out / name).mkdir(parents=True)
    (out / name / CONFIG_FILE).write_text(to_toml(load_config("gpt-tiny", overrides)))
    time.sleep(0.01)  # modification times in order


def test_sample_passes_over_a_newer_run_that_does_not_generate(tmp_path) -> None:
    _run(tmp_path, "gpt", {})
    _run(tmp_path, "cnn", {"model": {"workload": "examples/workload_cnn.py:make"}})
    run_dir, config = newest_generating_run(str(tmp_path))
    assert run_dir.name == "gpt" and config.model.arch == "gpt"
    (tmp_path / "gpt" / CONFIG_FILE).unlink()
    with pytest.raises(TurbotrainError, match="no run under .* generates text"):
        newest_generating_run(str(tmp_path))


def test_a_model_run_is_named_after_its_file() -> None:
    name = run_name(load_config(None, {"model": {"workload": "examples/workload_cnn.py:make"}}))
    assert name.startswith("workload_cnn-") and len(name) == len("workload_cnn-20261127-013000")
    assert run_name(load_config(None, {"model": {"workload": "mypkg.models:make"}})).startswith("models-")


# ----------------------------------------------------------------------------- item 8: tune offers nothing train warns against


@pytest.mark.parametrize(
    "caps", [DeviceCaps("cpu"), DeviceCaps("cuda", (8, 0), bf16=True), DeviceCaps("cuda", (7, 0))]
)
def test_tune_offers_no_precision_that_train_warns_against(caps: DeviceCaps, monkeypatch) -> None:
    monkeypatch.setattr(space.DeviceCaps, "of", classmethod(lambda cls, device: caps))
    choices = space.precision_choices(torch.device(caps.type))
    assert "fp32" in choices and (caps.type == "cpu") == (choices == ("fp32",)), choices
    for name in choices:
        with warnings.catch_warnings():
            warnings.simplefilter("error", TurbotrainWarning)  # a warning train would print fails here
            resolve_precision(name, caps)


# ----------------------------------------------------------------------------- item 6: no long silences


def test_the_first_signal_is_acknowledged_at_once(capfd: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    stops: list[str] = []
    controller = StopSignals().install()
    try:
        controller.on_first(stops.append)  # training's action: ask the loop to stop after the step
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops == ["SIGTERM"]
        assert capfd.readouterr().err == (
            "\nturbotrain: SIGTERM received: stopping after this step (it saves a "
            "checkpoint); a second SIGTERM to abort\n"
        )
        # the second: stop now (SIGTERM again: a suite started in the background inherits SIGINT
        # ignored, which turbotrain keeps, so a SIGINT would not reach the handler there)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        controller.restore()


class _WordTokenizer:
    """A subword tokenizer stand-in: one id per byte, under another name (so it is not the byte path)."""

    name, vocab_size = "words-test", 256

    def encode(self, texts):
        return [np.frombuffer(t, dtype=np.uint8).astype(np.uint16) for t in texts]

    def separator(self) -> np.ndarray:
        return np.array([10], dtype=np.uint16)


def test_tokenizing_off_a_terminal_says_how_far_it_is(
    tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    files = []
    for i in range(4):
        files.append(tmp_path / f"f{i}.txt")
        files[-1].write_bytes(b"x" * 1000)
    monkeypatch.setattr(sources, "ENCODE_CHUNK_BYTES", 1000)  # one file per chunk
    with caplog.at_level(logging.INFO):
        # pytest's stderr: no terminal
        sources.tokenize_files(files, tmp_path / "cache", _WordTokenizer(), progress=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizing: ")]
    assert len(lines) == 4 and all(line.startswith("tokenizing: 0.0 of 0.0 MB (") for line in lines)
    assert [line.split("(")[1].split(")")[0] for line in lines] == ["25%", "50%", "75%", "100%"]


@pytest.mark.slow
def test_a_compiled_first_step_is_announced_and_timed(caplog: pytest.LogCaptureFixture) -> None:
    """The one torch.compile test here: the tiniest model (a Linear), two steps."""
    engine = Engine({"run": {"device": "cpu"}, "compile": {"scope": "model"}})
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = engine.setup(model, optimizer)
    batches = [(torch.ones(2, 4), torch.zeros(2, 1))] * 2
    with caplog.at_level(logging.INFO):
        fit(
            engine,
            model,
            optimizer,
            batches,
            max_steps=2,
            hooks=[Monitor(10)],
            loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        )
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("compiling", "compiled"))]
    assert said[0] == "compiling (first step; torch.compile, model)..."
    assert len(said) == 2 and said[1].startswith("compiled: first step ") and said[1].endswith(" s")


def test_a_model_run_says_the_recipe_it_inherits(caplog: pytest.LogCaptureFixture) -> None:
    """#47 item 8: a --model run's opening lists turbotrain's defaults it trains with."""
    caplog.set_level("INFO")
    c = load_config(overrides={"model": {"workload": "w.py:make"}})
    run_settings.say_recipe(c, own_optimizer=False, evaluates=True)
    run_settings.say_recipe(c.replace(train={"max_steps": 20}), own_optimizer=True, evaluates=False)
    assert [r.getMessage() for r in caplog.records] == [
        "--model w.py:make: turbotrain's recipe: 300 steps, AdamW lr 0.002 (weight decay 0.1), warm-up 30 "
        "steps (auto: 10% of the run), cosine decay to 0.0002, evaluation every 100 steps (change any with "
        "--section.key=value)",
        "--model w.py:make: turbotrain's recipe: 20 steps, your optimizer as it is (no schedule), no "
        "evaluation (the workload has no eval_loader) (change any with --section.key=value)",
    ]


def test_profile_bench_and_tune_name_a_workload_after_its_file_as_train_does() -> None:
    """#47 item 8: tune and bench named runs 'make' (the function) where train says the file."""
    ref = "examples/workload_cnn.py:make"
    assert Target(model=ref).label == workload_label(ref) == "workload_cnn"
    assert run_name(load_config(overrides={"model": {"workload": ref}})).startswith("workload_cnn-")
    assert workload_label("mypkg.models:make") == "models"
