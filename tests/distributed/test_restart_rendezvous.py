"""torchrun's automatic restart (``--max-restarts``) under its default static rendezvous (a
``--master-port`` and no ``--standalone``/``--rdzv-id``: the rendezvous id is ``none``): the group
torchrun starts again after kill -9 of a rank resumes its run by itself, as it does under
``--standalone``; another torchrun under the same run name, restarted by its own torchrun after its
refusal, still never takes the run over (the run records which torchrun agent started it). The
kill is of a real command's rank (found by its RANK in /proc); the other launch runs forked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import CORPUS, HANG_S, free_port
from test_torchrun_train import _forked

from turbotrain.base.launch import Launch

SRC = Path(__file__).resolve().parents[2] / "src"
STEPS = 24
TINY = [
    "--run.device=cpu",
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=64",
    "--model.block_size=32",
    "--model.dropout=0",
    f"--train.max_steps={STEPS}",
    "--monitor.log_every=1",
    "--train.eval_every=0",
    "--train.eval_batches=2",
    "--train.checkpoint_every=8",
    "--precision.mode=fp32",
    "--optim.warmup_steps=5",
    "--data.num_workers=0",
    "--no-progress",
    "--monitor.nvml=false",
    "--batch.micro=4",
    "--distributed.strategy=ddp",
]


def _static_torchrun(work: Path, name: str) -> list[str]:
    """torchrun with its static rendezvous (no --standalone, no --rdzv-id) and one restart allowed."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--master-port",
        str(free_port()),
        "-m",
        "turbotrain",
        "train",
        "--data",
        str(work / "corpus.txt"),
        f"--run.out_dir={work / 'runs'}",
        f"--run.name={name}",
        f"--data.cache_dir={work / 'cache'}",
        *TINY,
    ]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def _rank_1(pid: int) -> int | None:
    """The process with RANK=1 among ``pid``'s children (torchrun starts the ranks itself)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    for child in map(int, out.split()):
        try:
            if b"RANK=1" in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                return child
        except OSError:
            continue
    return None


def test_a_static_rendezvous_restart_resumes_and_another_launch_never_takes_the_run(tmp_path: Path) -> None:
    work = tmp_path
    (work / "corpus.txt").write_text(CORPUS)
    run = work / "runs" / "el"
    proc = subprocess.Popen(
        _static_torchrun(work, "el"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + HANG_S
    while (
        not any((run / "checkpoints").glob("step_*")) and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    victim = _rank_1(proc.pid)
    assert victim is not None and proc.poll() is None, "the run ended before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err[-3000:]
    assert "torchrun starts the workers again (restart 1 of --max-restarts 1)" in err  # promised ...
    assert "resuming" in out and "TORCHELASTIC_RESTART_COUNT=1 of 1" in out, out  # ... and kept
    assert "already exists" not in err and "Traceback" not in err, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["status"] == "completed"
        and summary["steps"] == STEPS
        and summary["resumed_from"].startswith("step_")
    )
    assert summary["restarts"]["count"] == 1
    steps = [
        r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert sorted(steps) == list(range(1, STEPS + 1))  # every step logged once

    # another torchrun under the same name: refused, then restarted by its torchrun (restart count 1), refused again
    before = {
        p.name: p.read_bytes() for p in (run / "summary.json", run / "metrics.jsonl", run / "config.toml")
    }
    other = _forked(_static_torchrun(work, "el"), work / "other")  # torchrun's main and its ranks forked
    assert other.returncode != 0
    assert other.stderr.count("run directory") >= 2 and "already exists" in other.stderr, other.stderr[-3000:]
    assert "was started by another torchrun" in other.stderr and "resuming" not in other.stdout
    assert {
        p.name: p.read_bytes() for p in (run / "summary.json", run / "metrics.jsonl", run / "config.toml")
    } == before


def test_the_agent_tells_a_restart_of_the_same_launch_from_another_launch() -> None:
    """Rank 0 under a rendezvous without an id resumes only a run its own torchrun agent started;
    with no agent known, --max-restarts has nothing to find its run by (refused at the start)."""

    def launch(log_dir: str, restart: int, rank: int = 0) -> Launch:
        return Launch.from_env(
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_RESTART_COUNT": str(restart),
                "TORCHELASTIC_MAX_RESTARTS": "1",
                "TORCHELASTIC_ERROR_FILE": f"{log_dir}/attempt_{restart}/{rank}/error.json"
                if log_dir
                else "",
            }
        )

    first = launch("/tmp/torchelastic_a/none_x1", 0).record()
    assert "TORCHELASTIC_RESTART_COUNT=1" in launch("/tmp/torchelastic_a/none_x1", 1).relaunch_of(first)
    assert launch("/tmp/torchelastic_b/none_y2", 1).relaunch_of(first) == ""  # another torchrun's restart
    # a first start is never a relaunch
    assert launch("/tmp/torchelastic_a/none_x1", 0).relaunch_of(first) == ""
    assert (
        launch("", 1).restart_unfindable and not launch("/tmp/torchelastic_a/none_x1", 1).restart_unfindable
    )
