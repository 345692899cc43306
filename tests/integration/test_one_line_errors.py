"""Issue 23 (items 5, 6, 7, 10, 13, 14, 15, 16): failures a user meets end in one line (or fall
back, for checkpoints), never a traceback; what is on disk afterwards is asserted too."""

from __future__ import annotations

import os

import inprocess
import numpy as np
import pytest
from conftest import HANG_S
from faults.limits import file_size_limit, tmpfs
from test_train_cli import _args, _one_line_error

from turbotrain.base.atomic import DiskFullError, UnwritableError, atomic_write, make_dirs
from turbotrain.cli import main
from turbotrain.parts.data.sources import open_tokens

# ----------------------------------------------------------------------------- 5: the data cache


def test_an_array_over_the_file_size_limit_is_disk_full_with_no_temp_file(tmp_path):
    """numpy's tofile reported a short write as an OSError without an errno: the writer now
    writes arrays itself, so the limit is seen as what it is."""
    with file_size_limit(50_000), pytest.raises(DiskFullError, match="File too large"):
        atomic_write(tmp_path / "a.bin", np.zeros(100_000, np.uint16))
    assert os.listdir(tmp_path) == []
    atomic_write(tmp_path / "b.bin", np.arange(5, dtype=np.uint16))
    assert np.fromfile(tmp_path / "b.bin", np.uint16).tolist() == [0, 1, 2, 3, 4]


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    for folder in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(UnwritableError, match="a file is in the way.*--data.cache_dir"):
            make_dirs(folder, hint="choose another --data.cache_dir")


def test_the_data_cache_over_its_limit_or_a_file_is_one_line(tmp_path, text_file, capsys):
    (tmp_path / "a-file").write_text("x")
    _one_line_error(
        capsys,
        main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'a-file'}")),
        "a-file",
        "a file is in the way",
        "--data.cache_dir",
    )
    _one_line_error(
        capsys,
        main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'a-file' / 'sub'}")),
        "a-file",
        "--data.cache_dir",
    )
    with file_size_limit(20_000):  # the corpus is ~40 KB: its cache entry ~80 KB
        code = main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'limited'}"))
    _one_line_error(capsys, code, "File too large", str(tmp_path / "limited"))
    assert os.listdir(tmp_path / "limited") == []  # no temp file, no half entry
    assert not (tmp_path / "runs" / "t" / "checkpoints").exists()


NO_MOUNT = "needs root with mount rights (a small tmpfs stands in for the disk); not available here"


def test_the_data_cache_on_a_full_disk_is_one_line(tmp_path, text_file, capsys):
    with tmpfs(tmp_path / "full", "size=40k") as mounted:
        if not mounted:
            pytest.skip(NO_MOUNT)
        _one_line_error(
            capsys,
            main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'full'}")),
            "No space left",
            "full",
        )
        assert os.listdir(tmp_path / "full") == []  # no temp file, no half entry
    assert not (tmp_path / "runs" / "t" / "checkpoints").exists()


def test_the_data_cache_on_a_read_only_disk_is_one_line(tmp_path, text_file, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mounted:
        if not mounted:
            pytest.skip(NO_MOUNT)
        _one_line_error(
            capsys,
            main(_args(tmp_path, text_file, f"--data.cache_dir={tmp_path / 'ro'}")),
            "Read-only file system",
            "--data.cache_dir",
        )
    assert not (tmp_path / "runs" / "t" / "checkpoints").exists()


# ----------------------------------------------------------------------------- 14: --data a device or a FIFO


def test_data_that_is_a_device_or_a_fifo_is_named_for_what_it_is(tmp_path, text_file, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _one_line_error(
        capsys,
        main(_args(tmp_path, text_file, "--data", "/dev/zero")),
        "/dev/zero",
        "a device",
        "not a file or a folder",
    )
    _one_line_error(capsys, main(_args(tmp_path, text_file, "--data", str(fifo))), "named pipe (FIFO)")
    err = ""
    with pytest.raises(Exception) as info:
        open_tokens(str(fifo), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    err = str(info.value)
    assert "permissions" not in err and "Not a directory" not in err


# ----------------------------------------------------------------------------- 7, 15, 16: profile, tune, bench on broken workloads

WORKLOADS = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

class M(nn.Module):
    def __init__(self, mode="ok"):
        super().__init__()
        self.l, self.mode, self.calls = nn.Linear(8, 1), mode, 0
    def forward(self, x, y):
        self.calls += 1
        if self.mode == "raise" or (self.mode == "late" and self.calls > 1):
            raise RuntimeError("my forward is broken")
        loss = ((self.l(x) - y) ** 2).mean()
        if self.mode == "vector":
            return (self.l(x) - y) ** 2
        return loss * float("nan") if self.mode == "nan" else loss

def data(n=64):
    return DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 1)), batch_size=8)

def ok(): return {"model": M(), "train_loader": data()}
def empty(): return {"model": M(), "train_loader": data(0)}
def raising(): return {"model": M("raise"), "train_loader": data()}
def late(): return {"model": M("late"), "train_loader": data()}
def nan(): return {"model": M("nan"), "train_loader": data()}
def vector(): return {"model": M("vector"), "train_loader": data()}
"""


@pytest.fixture
def workloads(tmp_path):
    path = tmp_path / "wl.py"
    path.write_text(WORKLOADS)
    return path


def _profile(tmp_path, workloads, func: str) -> list[str]:
    return [
        "profile",
        "--model",
        f"{workloads}:{func}",
        "--warmup",
        "1",
        "--timed",
        "2",
        "--steps",
        "1",
        f"--run.out_dir={tmp_path / 'runs'}",
        "--run.device=cpu",
    ]


def test_profile_of_a_workload_that_fails_is_one_line_and_leaves_no_run_folder(tmp_path, workloads, capsys):
    """Item 7: an empty loader (StopIteration) or a forward that raises gave a 42-line traceback and a
    run folder holding only metrics.jsonl."""
    for func, words in (
        ("empty", ["yielded no batch"]),
        ("raising", ["RuntimeError: my forward is broken", "wl.py:"]),
    ):
        code = main(_profile(tmp_path, workloads, func))
        err = [
            line
            for line in capsys.readouterr().err.strip().splitlines()
            if not line.startswith(("INFO", "WARNING", "profiling"))
        ]
        assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
        assert all(w in err[0] for w in words), err
        assert not list((tmp_path / "runs").glob("profile-*"))


def test_profile_of_a_model_whose_loss_is_nan_says_so_first(tmp_path, workloads, capsys):
    """Item 16: it named a bottleneck and said nothing about the NaN."""
    assert main(_profile(tmp_path, workloads, "nan")) == 0
    out = capsys.readouterr().out
    assert "**bottleneck: non-finite loss** — the loss is nan" in out


def test_bench_exits_non_zero_when_every_contender_failed(tmp_path, workloads, capsys):
    """Item 16: a table of failures exited 0."""
    code = main(
        ["bench", "--model", f"{workloads}:late", "--device", "cpu", "--contenders", "turbotrain,eager"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "every row failed" in err[-1] and "my forward is broken" in err[-1]


def test_bench_of_a_workload_whose_forward_raises_is_one_line(tmp_path, workloads, capsys):
    """The FLOP count runs the user's forward before any row: it raised a traceback from there."""
    code = main(["bench", "--model", f"{workloads}:raising", "--device", "cpu", "--contenders", "eager"])
    err = [
        line
        for line in capsys.readouterr().err.strip().splitlines()
        if not line.startswith(("INFO", "WARNING"))
    ]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert (
        "counting its FLOPs" in err[0]
        and "RuntimeError: my forward is broken" in err[0]
        and "wl.py:" in err[0]
    )


def test_tune_stops_at_once_when_the_baseline_fails_for_a_reason_no_setting_changes(
    tmp_path, workloads, capsys
):
    """Item 15: a loss that is not a scalar kept the study proposing (16 proposals, 49 s)."""
    pytest.importorskip("optuna")
    code = main(
        [
            "tune",
            "--model",
            f"{workloads}:vector",
            "--trials",
            "4",
            "--confirm",
            "0",
            f"--run.out_dir={tmp_path / 'runs'}",
            "--run.name=v",
            "--run.device=cpu",
        ]
    )
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error:" in line]
    assert (
        code == 2 and len(err) == 1 and "no setting tune searches changes" in err[0] and "scalar" in err[0]
    ), err
    assert (tmp_path / "runs" / "v" / "tune.json").is_file()
    assert [p.name for p in (tmp_path / "runs" / "v" / "trials").iterdir()] == ["trial-000"]


def test_tune_stopped_by_sigterm_writes_what_it_has_and_prints_the_resume_command(tmp_path, workloads):
    """Item 15: SIGTERM wrote nothing and printed no resume command (Ctrl-C did both)."""
    pytest.importorskip("optuna")
    import signal
    import sys
    import time

    run = tmp_path / "runs" / "s"
    args = ["--model", f"{workloads}:ok", "--trials", "20", "--confirm", "0"]
    args += [f"--run.out_dir={tmp_path / 'runs'}", "--run.name=s", "--run.device=cpu"]
    # tune's own process (forked: it is SIGTERM-ed below); its trials start their own
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    proc = inprocess.fork(lambda: sys.exit(main(["tune", *args])), out_path, err_path)
    deadline = time.monotonic() + HANG_S
    while not (run / "trials" / "trial-001").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == 128 + signal.SIGTERM, err_path.read_text()
    out, err = out_path.read_text(), err_path.read_text()
    assert "interrupted (SIGTERM): continue the study with the same command and --run.out_dir=" in out
    assert "Traceback" not in err and (run / "tune.json").is_file() and (run / "tune.md").is_file()


def test_a_missing_data_path_is_said_before_choose_measures(tmp_path, capsys):
    """#44 item 12: was found after `choose` had measured twice and printed a failure table."""
    code = main(
        [
            "train",
            "--preset=gpt-tiny",
            "--run.device=cpu",
            f"--run.out_dir={tmp_path / 'runs'}",
            f"--data.path={tmp_path / 'nope.txt'}",
            "--choose.measure=always",
            "--train.max_steps=2",
        ]
    )
    captured = capsys.readouterr()
    assert code == 2 and "choose" not in captured.out + captured.err
    runs = tmp_path / "runs"
    assert not runs.exists() or not list(runs.iterdir())  # no run folder holding only its lock file
    assert captured.err.strip() == (
        f"turbotrain train: error: data path {str(tmp_path / 'nope.txt')!r} does not exist; "
        "pass --data with a .bin token file, a text file or a folder"
    )
