"""Fault injection on `python -m turbotrain train`: kill -9 at chosen points (mid-step, mid-write
of a checkpoint, between its rename and its checksum), SIGTERM/SIGINT, two processes on one run,
a full disk. Every run resumes to exactly the loss of an uninterrupted run, and nothing already
written is lost. The points are reached deterministically (tests/faults/sitecustomize.py acts at
the N-th call of a function): no test waits on timing. Only the processes that are killed or
signalled run as subprocesses; the others run in-process (a subprocess costs seconds of imports).
The long series (more points, a soak) is benchmarks/fault_injection.py.
"""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import inprocess
import pytest
from conftest import CORPUS, HANG_S, tiny_overrides
from faults.limits import tmpfs
from test_train_cli import _args, _one_line_error

from turbotrain import load_config
from turbotrain.app.prepare import default_preset
from turbotrain.app.training import train
from turbotrain.cli import main
from turbotrain.cli.train import EXIT_STOPPED
from turbotrain.loop.checkpoint import is_verified, list_checkpoints

MAX_STEPS = 8  # checkpoints at 3, 6 and 8 (tiny config: checkpoint_every 3)


def _cli(tmp_path: Path, text_file: Path, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
    """`python -m turbotrain train` on the tiny config in its own (forked) process, with ``fault`` injected."""
    args = _args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", *extra)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    code = inprocess.turbotrain(args, out, err, fault=fault).wait(HANG_S)
    return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _temp_files(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob(".*tmp*"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run's summary (same preset, tiny config and text as the CLI's)."""
    tmp = tmp_path_factory.mktemp("reference")
    text = tmp / "corpus.txt"
    text.write_text(CORPUS)
    overrides = tiny_overrides(tmp, data={"path": str(text)}, train={"max_steps": MAX_STEPS})
    return train(load_config(default_preset(), overrides), progress=False)


def test_kill_9_anywhere_resumes_to_the_identical_loss(tmp_path, text_file, reference, capsys):
    """A chain of kill -9: before the first checkpoint (defect 3: such a run could neither
    resume nor restart), half-way through writing a checkpoint, then between a checkpoint's
    rename and its checksum file; each time `--resume` continues. The last resume skips the
    unfinished newest file for the previous checkpoint and ends with exactly the uninterrupted
    run's losses, one metrics record per step, and no temporary file anywhere."""
    run = tmp_path / "runs" / "t"
    kills = [
        ("step:2", []),  # mid-step 2, before the first checkpoint (step 3)
        ("ckpt-mid-write:1", ["--resume"]),  # resumed from step 0; killed half-way through writing step_3.pt
        ("ckpt-before-sidecar:2", ["--resume"]),  # from 0 again: step_3 saved; step_6.pt renamed, no .sha256
    ]
    for fault, extra in kills:
        result = _cli(tmp_path, text_file, *extra, fault=fault)
        assert result.returncode == -signal.SIGKILL, (fault, result.stderr)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000003.pt", "step_00000006.pt"]
    # the killed first attempt cannot be restarted by accident: it says to resume
    _one_line_error(
        capsys,
        main(_args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}")),
        "already exists",
        "--resume",
    )
    assert main(_args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", "--resume")) == 0
    summary = _summary(run)
    assert summary["resumed_from"] == "step_00000003.pt" and summary["steps"] == MAX_STEPS
    assert summary["final_train_loss"] == reference["final_train_loss"]
    assert summary["final_val_loss"] == reference["final_val_loss"]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # logged or evaluated, each step once, although steps 1-2 ran four times and 4-6 twice
    assert steps == [
        2,
        3,
        4,
        6,
        8,
    ]
    assert _temp_files(run) == []
    assert all(is_verified(p) for p in list_checkpoints(run / "checkpoints"))


def _start_paused(
    tmp_path: Path, text_file: Path, marker: Path, fault: str, *extra: str, sigint=signal.default_int_handler
) -> inprocess.Forked:
    """`python -m turbotrain train` in its own (forked) process, paused at ``fault``'s point. SIGINT
    is Ctrl-C's as at a terminal unless ``sigint`` says otherwise: a test suite started in the
    background (`(pytest &)`) inherits SIGINT ignored, which turbotrain rightly keeps ignored
    (test_sigint_inherited_as_ignored_...)."""
    args = _args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", *extra)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    proc = inprocess.turbotrain(args, out, err, fault=fault, marker=marker, sigint=sigint)
    while not marker.exists():  # waits for a state, not a time: the process has reached the point
        if proc.poll() is not None:
            raise AssertionError(err.read_text() or "exited early")
        time.sleep(0.02)
    return proc


def test_sigterm_saves_exits_75_and_a_second_process_is_refused(tmp_path, text_file, reference, capsys):
    """Defects 2 and 11: while a run trains, a second `train` under its name and a `--resume`
    of it are refused (exit 2, one line naming the process); SIGTERM then saves a checkpoint at
    the step it stopped and exits 75, not 0; the resume ends with the uninterrupted losses."""
    run = tmp_path / "runs" / "t"
    marker = tmp_path / "paused"
    proc = _start_paused(tmp_path, text_file, marker, "pause-step:5")  # paused inside step 5
    try:
        # this test's own process is the second one (run locks are per process)
        _one_line_error(
            capsys, main(_args(tmp_path, text_file)), "turbotrain train: error:", "already exists", "--resume"
        )
        _one_line_error(
            capsys, main(_args(tmp_path, text_file, "--resume")), "in use by process", str(proc.pid)
        )
        before = (run / "config.toml").read_text()
        proc.send_signal(signal.SIGTERM)
        marker.unlink()
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_STOPPED, err
    assert "SIGTERM" in err and "--resume" in err and "Traceback" not in err
    assert (run / "config.toml").read_text() == before  # the refused processes wrote nothing
    stopped = _summary(run)
    assert stopped["status"] == "stopped" and stopped["steps"] == 5
    assert list_checkpoints(run / "checkpoints")[-1].name == "step_00000005.pt"
    assert main(_args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", "--resume")) == 0
    assert _summary(run)["final_train_loss"] == reference["final_train_loss"]


def test_a_signal_during_start_up_stops_cleanly(tmp_path, text_file):
    """Defect 3: SIGTERM while a new run starts left a folder that could neither resume nor
    restart. Now: SIGINT during a new run's start-up exits 75 and leaves nothing (start it
    again); SIGTERM during a resume's start-up exits 75 and the run resumes later."""
    run = tmp_path / "runs" / "t"
    marker = tmp_path / "paused"
    proc = _start_paused(tmp_path, text_file, marker, "pause-startup:1")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == EXIT_STOPPED and "start it again" in err and "Traceback" not in err, err
    assert not run.exists()
    assert (
        main(_args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", "--train.stop_after_steps=3")) == 0
    )
    marker.unlink()  # left by the process stopped while it waited
    proc = _start_paused(tmp_path, text_file, marker, "pause-startup:1", "--resume")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == EXIT_STOPPED and "--resume" in err and "Traceback" not in err, err
    assert _summary(run)["steps"] == 3 and [p.name for p in list_checkpoints(run / "checkpoints")] == [
        "step_00000003.pt"
    ]


@pytest.mark.slow  # a signalled subprocess
def test_a_signal_while_choose_measures_leaves_no_run_folder(tmp_path, text_file):
    """#44 item 12: SIGTERM while `choose` measures a new run's settings said "nothing was written"
    and left a run folder holding only its .lock (which then refused a new start)."""
    marker = tmp_path / "paused"
    proc = _start_paused(tmp_path, text_file, marker, "pause-choose:1", "--choose.measure=always")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == EXIT_STOPPED and "nothing was written" in err and "Traceback" not in err, err
    assert not (tmp_path / "runs" / "t").exists()
    assert main(_args(tmp_path, text_file, "--train.max_steps=2")) == 0  # started again as it says


def _small_disk(folder: Path, size_bytes: int):
    """A tmpfs of ``size_bytes`` at ``folder`` (root with mount rights); otherwise None."""
    return tmpfs(folder, f"size={size_bytes}")


def test_a_full_disk_ends_in_one_line_and_loses_nothing(tmp_path, text_file, capsys):
    """Defect 5: a checkpoint write that runs out of space (a full file system where the tests
    run as root, else a `ulimit -f` file-size limit) gave 45-63 lines of tracebacks and left
    temp files. Now: exit 2, one line naming the file and the last intact checkpoint, no temp
    file, the earlier checkpoint intact, the metrics kept."""
    disk = tmp_path / "disk"
    args = _args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", f"--run.out_dir={disk / 'runs'}")
    with _small_disk(disk, 800_000) as tmpfs:  # a checkpoint is ~470 KB: one fits, not a second beside it
        if tmpfs:
            _one_line_error(
                capsys,
                main(args),
                "step_00000006.pt",
                "No space left",
                "last intact checkpoint",
                "step_00000003.pt",
            )
        else:  # every checkpoint is over the limit: the first one fails
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
            try:
                code = main(args)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            _one_line_error(capsys, code, "step_00000003.pt", "File too large", "no checkpoint was saved yet")
        run = disk / "runs" / "t"
        assert _temp_files(run) == []
        assert all(is_verified(p) for p in list_checkpoints(run / "checkpoints"))
        assert (run / "metrics.jsonl").read_text().strip()  # what was logged is kept


def test_a_signal_between_start_up_and_training_saves_and_stops(tmp_path, text_file, reference):
    """Issue 23, item 4: the start-up handlers were restored before the config was written and
    the loop installed its own, so a SIGTERM there killed the run without a word (-15, a stale
    `.config.toml.tmpPID`) and a single Ctrl-C gave 130. Now the handlers hold from the command's
    start to its exit: one SIGTERM or SIGINT there stops after the first step with a checkpoint
    (75), and the resume ends with the uninterrupted losses."""
    run = tmp_path / "runs" / "t"
    marker = tmp_path / "paused"
    for sig, extra in ((signal.SIGINT, ()), (signal.SIGTERM, ("--resume",))):
        # built, metrics.jsonl there, no step yet
        proc = _start_paused(tmp_path, text_file, marker, "pause-fit:1", *extra)
        proc.send_signal(sig)
        marker.unlink()
        _, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == EXIT_STOPPED, err
        assert sig.name in err and "--resume" in err and "Traceback" not in err, err
        assert _temp_files(run) == []
        assert _summary(run)["status"] == "stopped"
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000001.pt", "step_00000002.pt"]
    assert main(_args(tmp_path, text_file, f"--train.max_steps={MAX_STEPS}", "--resume")) == 0
    assert _summary(run)["final_train_loss"] == reference["final_train_loss"]


def test_a_signal_after_training_keeps_the_run_skips_the_report_and_says_how_to_make_it(tmp_path, text_file):
    """Issue 23's signal handling, last phase: a SIGTERM after the run trained and wrote its summary,
    while the report is being made, stops the report (it can be made later), keeps every file of
    the completed run and exits 75 with one line naming `turbotrain report`."""
    run = tmp_path / "runs" / "t"
    marker = tmp_path / "paused"
    proc = _start_paused(tmp_path, text_file, marker, "pause-report:1")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == EXIT_STOPPED, err
    said = [line for line in err.splitlines() if line.startswith("turbotrain train:")]
    assert (
        len(said) == 1
        and "SIGTERM arrived as the run was ending" in said[0]
        and "turbotrain report" in said[0]
    ), err
    assert "Traceback" not in err and _temp_files(run) == []
    assert _summary(run)["status"] == "completed" and not (run / "summary.md").exists()
    assert main(["report", str(run)]) == 0 and (run / "summary.md").exists()


def test_sigint_inherited_as_ignored_stays_ignored_and_sigterm_still_stops(tmp_path, text_file):
    """Issue 23, item 4: a background job (SIGINT inherited as ignored) lost a SIGINT in one phase
    and honoured it in another. Now SIGINT stays ignored in every phase (the run trains to its
    end, 0) and SIGTERM stops it in every phase (75); a second signal stops it at once (130)."""
    run = tmp_path / "runs" / "t"
    marker = tmp_path / "paused"
    # two: stop now
    for fault, sigs, code in (
        ("pause-fit:1", [signal.SIGINT], 0),
        ("pause-step:2", [signal.SIGINT], 0),
        ("pause-startup:1", [signal.SIGTERM], EXIT_STOPPED),
        ("pause-step:2", [signal.SIGTERM, signal.SIGTERM], 130),
    ):
        shutil.rmtree(run, ignore_errors=True)
        proc = _start_paused(tmp_path, text_file, marker, fault, sigint=signal.SIG_IGN)
        for sig in sigs:
            proc.send_signal(sig)
            time.sleep(0.2)
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        _, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == code, (fault, err)
        assert "Traceback" not in err, err
        if code == 0:
            assert _summary(run)["steps"] == MAX_STEPS
