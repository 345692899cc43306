"""SLURM, simulated (issue 25 item 3): two local processes (forks of the test process running the
command) started the way ``srun`` starts them --
no torchrun, only SLURM's variables (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST,
SLURM_JOB_ID), set by the test -- join one gloo group and train a tiny GPT to the losses of one
process with the same global batch (which is torchrun's too: tests/distributed/test_split_invariant.py);
SIGUSR1 (SLURM's warning before the time limit) to both mid-run saves and exits 79, the requeue
code; started again as a requeued job (SLURM_RESTART_COUNT=1, the same command, no --resume) it
resumes by itself and ends at the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import inprocess
import pytest
from conftest import HANG_S, free_port

STEPS, PAUSE = 6, 3
EXIT_REQUEUE = 79
TINY = [
    "--run.device=cpu",
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=32",
    "--model.dropout=0",
    f"--train.max_steps={STEPS}",
    "--monitor.log_every=1",
    "--train.eval_every=0",
    "--train.eval_batches=2",
    "--train.checkpoint_every=100",
    "--precision.mode=fp32",
    "--optim.warmup_steps=2",
    "--data.num_workers=0",
    "--no-progress",
    "--monitor.nvml=false",
]
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TT_FAULT",
    "TT_FAULT_MARKER",
)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slurm")
    (root / "corpus.txt").write_text(
        "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))
    )
    return root


def _args(work: Path, name: str, micro: int) -> list[str]:
    return [
        "--data",
        str(work / "corpus.txt"),
        f"--run.out_dir={work / 'runs'}",
        f"--run.name={name}",
        f"--data.cache_dir={work / 'cache'}",
        f"--batch.micro={micro}",
        *TINY,
    ]


def _job_id() -> int:
    """A job id whose derived port (15000 + id % 20000) is free here, held free (conftest's free_port)."""
    start = random.randrange(20000)
    for i in range(20000):
        job = (start + i) % 20000
        try:
            free_port(15000 + job)
        except OSError:
            continue
        return 1_000_000 + job
    raise RuntimeError("no free port in 15000-34999")


def _srun(work: Path, name: str, *more: str, restart: int = 0, fault: str = "") -> list[inprocess.Forked]:
    """What ``srun -N 2 -n 2 python -m turbotrain train ...`` starts: one process per task with
    SLURM's variables and nothing of torchrun's; each a fork of this process running the command
    (inprocess.turbotrain), not a new interpreter."""
    base: dict[str, str | None] = {
        k: None for k in os.environ if k in LAUNCHER_VARS or k.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    base.update(
        OMP_NUM_THREADS="1",
        SLURM_JOB_ID=str(_job_id()),
        SLURM_JOB_NAME="tt-test",
        SLURM_NTASKS="2",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="127.0.0.[1-2]",
        SLURM_RESTART_COUNT=str(restart),
    )
    procs = []
    for rank in range(2):
        env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank)}
        out = work / f"{name}-{restart}-{rank}"
        procs.append(
            inprocess.turbotrain(
                ["train", *_args(work, name, 4), *more],
                out.with_suffix(".stdout"),
                out.with_suffix(".stderr"),
                fault=fault,
                marker=work / f"paused-{rank}" if fault else None,
                env=env,
            )
        )
    return procs


def _wait(procs: list[inprocess.Forked]) -> list[tuple[int | None, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=HANG_S)
        finally:
            p.kill()
        out.append((p.returncode, stdout, stderr))
    return out


def _losses(work: Path, name: str) -> dict[int, float]:
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}


def _summary(work: Path, name: str) -> dict:
    return json.loads((work / "runs" / name / "summary.json").read_text())


def _assert_same(work: Path, name: str, reference: dict[int, float]) -> None:
    losses = _losses(work, name)
    assert sorted(losses) == list(range(1, STEPS + 1))
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in losses)
    assert worst <= 1e-5, (
        f"the loss per step differs from one process with the same global batch by {worst:.3g}"
    )
    val, ref_val = _summary(work, name)["final_val_loss"], _summary(work, "one")["final_val_loss"]
    assert abs(val - ref_val) <= 1e-5 * ref_val


@pytest.fixture(scope="module")
def reference(work: Path) -> dict[int, float]:
    """One plain process with the global batch of 8 (micro 8): this one."""
    proc = inprocess.train(_args(work, "one", 8))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(work, "one")


def test_two_srun_tasks_train_like_one_process_and_the_requeued_job_resumes_exactly(work, reference):
    """One job, two launches of 2 tasks: the first trains steps 1 to PAUSE and more, gets SIGUSR1,
    saves and exits 79; the requeued one resumes. Every step's loss (from both launches) and the
    final validation loss equal one process with the global batch: the 2 tasks train like it, and
    the requeue resumes exactly (one run for both facts: a run of its own for the first cost a
    third launch)."""
    procs = _srun(work, "preempted", "--distributed.strategy=ddp", fault=f"pause-step:{PAUSE}")
    markers = [work / f"paused-{rank}" for rank in range(2)]
    deadline = time.monotonic() + HANG_S
    while not all(m.exists() for m in markers):  # both tasks inside step PAUSE: a state, not a time
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _wait(procs)
        time.sleep(0.02)
    for p in procs:  # what --signal=USR1@90 does: every task of the step gets it
        p.send_signal(signal.SIGUSR1)
    for m in markers:
        m.unlink()
    results = _wait(procs)
    assert [r[0] for r in results] == [EXIT_REQUEUE, EXIT_REQUEUE], results
    stderr = results[0][2]
    assert "SIGUSR1" in stderr and "requeue" in stderr and "Traceback" not in stderr, stderr[-3000:]
    stopped = _summary(work, "preempted")
    assert stopped["status"] == "stopped" and PAUSE <= stopped["steps"] < STEPS
    assert list((work / "runs" / "preempted" / "checkpoints").iterdir())

    # requeued: the same command, SLURM_RESTART_COUNT=1, no --resume
    results = _wait(_srun(work, "preempted", "--distributed.strategy=ddp", restart=1))
    assert [r[0] for r in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert "resuming" in results[0][1] and "SLURM_RESTART_COUNT=1" in results[0][1], results[0][1]
    summary = _summary(work, "preempted")
    assert summary["resumed_from"] and summary["status"] == "completed"
    assert summary["resolved"]["world_size"] == 2 and summary["resolved"]["global_batch"] == 8
    _assert_same(work, "preempted", reference)


def test_a_requeued_job_whose_run_was_never_made_starts_it(work, reference):
    """Preempted before the run existed: the requeued start is a new run (no --resume to refuse)."""
    proc = inprocess.train(
        _args(work, "late", 8),
        env={
            "SLURM_JOB_ID": "7",
            "SLURM_NTASKS": "1",
            "SLURM_PROCID": "0",
            "SLURM_JOB_NODELIST": "n1",
            "SLURM_RESTART_COUNT": "2",
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(work, "late") == reference
