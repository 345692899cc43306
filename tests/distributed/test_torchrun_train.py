"""`turbotrain train` under torchrun (gloo, 2 CPU processes): what a user launching it would check.

- ddp and fsdp give the per-step loss of one process with the same global batch (fp32, within
  1e-5 over 30+ steps, read from metrics.jsonl, which rank 0 alone writes);
- two "nodes" (two torchrun commands meeting at a c10d rendezvous) match it too;
- bad input: one line and exit 2 on rank 0, the other rank ends quietly with status 0;
- kill -9 of one rank under ``--max-restarts 1``: the other ends with a clear message, the
  checkpoints written before stay, and the group torchrun starts again resumes by itself with the
  uninterrupted run's losses, the restart recorded in the summary;
- an out-of-memory error under ddp or fsdp stops with the rank, the micro-batch and "lower --batch.micro".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import inprocess
import pytest
from conftest import CORPUS, HANG_S, free_port
from faults.faultenv import FAULTS

SRC = Path(__file__).resolve().parents[2] / "src"
STEPS = 40
MICRO = 4  # per rank; the one-process reference runs 2 x MICRO
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
    "--train.checkpoint_every=20",
    "--precision.mode=fp32",
    "--optim.warmup_steps=5",
    "--data.num_workers=0",
    "--no-progress",
    "--monitor.nvml=false",
]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def _torchrun(nproc: int, *extra: str, log_dir: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if log_dir is not None:  # each rank's stdout/stderr in its own file
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]
    return cmd + [*extra, "-m", "turbotrain", "train"]


def _plain() -> list[str]:
    return [sys.executable, "-m", "turbotrain", "train"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train_cli")
    (root / "corpus.txt").write_text(CORPUS)
    return root


def _args(work: Path, name: str, micro: int = MICRO, *more: str) -> list[str]:
    return [
        "--data",
        str(work / "corpus.txt"),
        f"--run.out_dir={work / 'runs'}",
        f"--run.name={name}",
        f"--data.cache_dir={work / 'cache'}",
        f"--batch.micro={micro}",
        *TINY,
        *more,
    ]


def _run(cmd: list[str], timeout: float = HANG_S, fault: str = "") -> subprocess.CompletedProcess:
    """``cmd`` to its end; ``fault``: TT_FAULT=POINT:N for each process (tests/faults/sitecustomize.py)."""
    env = _env()
    if fault:
        env.update(TT_FAULT=fault, PYTHONPATH=f"{FAULTS}{os.pathsep}{env['PYTHONPATH']}")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _forked(
    cmd: list[str], out: Path, fault: str = "", before: Callable[[], object] | None = None
) -> inprocess.Result:
    """``cmd`` (:func:`_torchrun`'s) to its end as :func:`inprocess.torchrun` runs it: torchrun's
    own main in a fork, the ranks forked (its output in ``out``.stdout/.stderr). The tests whose
    subject is the real command (its exit status under torchrun, kills, the --nproc launcher) start
    it; the --nproc test holds the forked ranks to the real ones' losses, bit for bit."""
    env = _env()
    if fault:
        env["TT_FAULT"] = fault
    launched = cmd.index("torch.distributed.run") + 1
    proc = inprocess.torchrun(
        cmd[launched:], out.with_suffix(".stdout"), out.with_suffix(".stderr"), env=env, before=before
    )
    return inprocess.completed(proc, HANG_S)


def _losses(work: Path, name: str) -> dict[int, float]:
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}


def _val(work: Path, name: str) -> float:
    return json.loads((work / "runs" / name / "summary.json").read_text())["final_val_loss"]


@pytest.fixture(scope="module")
def single(work: Path) -> dict[int, float]:
    """The reference: one plain process with the global batch (2 x MICRO), in this process."""
    proc = inprocess.train(_args(work, "single", 2 * MICRO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(work, "single")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5  # it learns
    return losses


def _assert_same(losses: dict[int, float], reference: dict[int, float], tolerance: float = 1e-5) -> None:
    assert sorted(losses) == sorted(reference), "every step logged once, by rank 0 alone"
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst <= tolerance, f"per-step loss differs from one process by up to {worst:.3g}"


@pytest.fixture(scope="module")
def launched(work: Path) -> Callable[[str], subprocess.CompletedProcess]:
    """``launched(strategy)``: the 2-rank torchrun run (runs/STRATEGY) with the global batch of
    ``single``, launched once per module: its test checks it, and the --nproc test and the resume
    refusals below build on the ddp one (a completed run with checkpoints at steps 20 and 40)."""
    done: dict[str, subprocess.CompletedProcess] = {}

    def launch(strategy: str) -> subprocess.CompletedProcess:
        if strategy not in done:
            args = _args(work, strategy, MICRO, f"--distributed.strategy={strategy}")
            done[strategy] = _forked(_torchrun(2) + args, work / strategy)
        return done[strategy]

    return launch


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_trains_like_one_process_with_the_global_batch(work, single, launched, strategy):
    proc = launched(strategy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same(_losses(work, strategy), single)
    # validation: each rank its slice, averaged
    assert abs(_val(work, strategy) - _val(work, "single")) <= 1e-5
    summary = json.loads((work / "runs" / strategy / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resolved"]["global_batch"] == 2 * MICRO
    assert summary["resolved"]["strategy"] == strategy
    assert summary["tokens"] == json.loads((work / "runs" / "single" / "summary.json").read_text())["tokens"]
    assert summary["rank_tokens_per_s_median"] > 0
    # rank 0 prints the run's lines; rank 1 prints nothing on success
    assert proc.stdout.count(f"run {work / 'runs' / strategy}:") == 1
    assert "[rank 1]" not in proc.stderr


LLAMA = ["--preset=llama-tiny", "--llama.n_kv_head=1", "--train.max_steps=10"]  # grouped-query: 2 heads, 1 kv


@pytest.fixture(scope="module")
def llama_single(work: Path) -> dict[int, float]:
    """The Llama family's reference (issue 42 item 4): one plain process with the global batch."""
    proc = inprocess.train(_args(work, "llama-single", 2 * MICRO, *LLAMA))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(work, "llama-single")
    assert sorted(losses) == list(range(1, 11)) and losses[10] < losses[1]
    return losses


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_llama_family_under_torchrun_trains_like_one_process(work, llama_single, strategy):
    name = f"llama-{strategy}"
    proc = _forked(
        _torchrun(2) + _args(work, name, MICRO, *LLAMA, f"--distributed.strategy={strategy}"), work / name
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same(_losses(work, name), llama_single)
    resolved = json.loads((work / "runs" / name / "summary.json").read_text())["resolved"]
    assert resolved["model_family"] == "llama" and resolved["strategy"] == strategy


def test_nproc_2_gives_the_losses_of_torchrun_nproc_per_node_2(work, single, launched):
    """``turbotrain train --nproc 2``: torchrun's launcher started from the command itself."""
    assert launched("ddp").returncode == 0
    proc = _run([*_plain(), "--nproc", "2", *_args(work, "nproc", MICRO, "--distributed.strategy=ddp")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(work, "nproc") == _losses(work, "ddp")  # the same launch: the same bits
    _assert_same(_losses(work, "nproc"), single)
    assert json.loads((work / "runs" / "nproc" / "summary.json").read_text())["world_size"] == 2
    # a mistake only the world size makes: rank 0's one line and its status 2, not the agent's 1
    bad = _run([*_plain(), "--nproc", "2", *_args(work, "bad-nproc", MICRO, "--batch.global_size=12")])
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.count("turbotrain train: error: batch.global_size = 12 does not divide") == 1


def test_two_nodes_on_one_machine_match_one_process(work, single):
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        launcher = [
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes",
        ]
        out = work / f"node{node_rank}"
        argv = [*launcher, "-m", "turbotrain", "train", *_args(work, "nodes")]
        nodes.append(
            inprocess.torchrun(argv, out.with_suffix(".stdout"), out.with_suffix(".stderr"), env=_env())
        )
    for node in nodes:
        assert inprocess.completed(node, HANG_S).returncode == 0, node.stderr.read_text()[-3000:]
    _assert_same(_losses(work, "nodes"), single)


def _rank_logs(log_dir: Path) -> dict[int, str]:
    """Each local rank's stderr, as torchrun's --redirects wrote it."""
    out: dict[int, str] = {}
    for path in log_dir.rglob("stderr.log"):
        out[int(path.parent.name)] = path.read_text()
    return out


def test_bad_input_under_torchrun_is_one_line_on_rank_0(work, tmp_path):
    """A mistake found before the ranks join (an invalid value, or, as here, one that only the
    world size makes wrong: the same path, tried with one launch)."""
    bad, expected = (
        "--batch.global_size=12",
        (
            "batch.global_size = 12 does not divide by batch.micro x world = "
            "4 x 2 = 8; use --batch.global_size=8"
        ),
    )
    proc = _run(_torchrun(2, log_dir=tmp_path / "logs") + _args(work, "bad", MICRO, bad))
    assert proc.returncode != 0
    logs = _rank_logs(tmp_path / "logs")
    assert sorted(logs) == [0, 1]
    lines = [line for line in logs[0].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"turbotrain train: error: {expected}"), logs[0]
    # the other rank ends quietly (status 0, or ended by torchrun before it got that far)
    assert "error" not in logs[1] and "Traceback" not in logs[1], logs[1]
    root_cause = proc.stderr.split("Root Cause")[-1]
    # torchrun's summary: rank 0, status 2
    assert "rank      : 0" in root_cause and "exitcode  : 2" in root_cause
    assert not (work / "runs" / "bad").exists()


def test_fsdp_in_one_plain_process_is_one_line(work):
    proc = inprocess.train(_args(work, "bad-fsdp", MICRO, "--distributed.strategy=fsdp"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "turbotrain train: error: distributed.strategy = 'fsdp' needs processes started by torchrun, e.g. "
        "`torchrun --nproc-per-node 2 -m turbotrain train ...`; in one plain process use --distributed.strategy=single"
    ]
    proc = inprocess.train(_args(work, "bad-strategy", MICRO, "--distributed.strategy=zero3"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "turbotrain train: error: distributed.strategy = 'zero3' is not valid; choose one of: auto, single, ddp, fsdp"
    ]
    assert not (work / "runs" / "bad-fsdp").exists() and not (work / "runs" / "bad-strategy").exists()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def test_kill_9_of_one_rank_restarts_the_group_which_resumes_by_itself(work, single):
    """torchrun --max-restarts 1, rank 1 killed after the checkpoint at step 20: the surviving rank
    ends saying why, torchrun names the killed rank and starts the group again, which resumes from
    that checkpoint with no one's help and ends at the uninterrupted run's losses (every step and
    validation); metrics.jsonl and the summary record the restart. (Without --max-restarts the
    survivor prints the --resume command instead: the same resume, tested with the stopped runs
    below; its line: tests/unit/test_relaunch.py.)"""
    name = "restarted"
    proc = subprocess.Popen(
        _torchrun(2, "--max-restarts", "1") + _args(work, name, MICRO, "--distributed.strategy=ddp"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints = work / "runs" / name / "checkpoints"
    deadline = time.monotonic() + HANG_S
    while (
        not any(checkpoints.glob("step_*/finished.json"))
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    victim = next((p for p in _children(proc.pid) if _rank_of(p) == 1), None)
    assert victim is not None and proc.poll() is None, "the run ended before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err[-3000:]
    # torchrun names the first failure it polled: the killed rank, or the survivor when it ended (status 1)
    # within the same poll, whose timestamp comes first
    assert "(exitcode: -9) local_rank: 1" in err or "(exitcode: 1) local_rank: 0" in err, err[-3000:]
    assert "[rank 0] another rank stopped or was lost: a collective failed" in err  # the survivor says why
    assert "torchrun starts the workers again (restart 1 of --max-restarts 1)" in err
    assert "resuming" in out and "TORCHELASTIC_RESTART_COUNT=1 of 1" in out, out
    _assert_same(_losses(work, name), single)
    assert abs(_val(work, name) - _val(work, "single")) <= 1e-5
    summary = json.loads((work / "runs" / name / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == "step_00000020"
    restart = summary["restarts"]["each"]
    assert summary["restarts"]["count"] == 1 and restart[0]["step"] == 20 and restart[0]["world_size"] == 2
    assert "## Restarts" in (work / "runs" / name / "summary.md").read_text()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_out_of_memory_under_data_parallel_stops_with_the_rank_and_what_to_lower(work, tmp_path, strategy):
    proc = _forked(
        _torchrun(2, log_dir=tmp_path / "logs")
        + _args(
            work,
            f"oom-{strategy}",
            MICRO,
            f"--distributed.strategy={strategy}",
            # longer than _run's HANG_S bound: a rank that waited for the one that stopped would make
            # the launch outlive HANG_S and fail the test (TimeoutExpired), whatever the machine's load
            f"--distributed.timeout_s={3 * HANG_S}",
        ),
        tmp_path / "out",
        fault="oom:3",  # an out-of-memory error in step 3 (tests/faults/oom.py)
    )
    assert proc.returncode != 0
    logs = _rank_logs(tmp_path / "logs")
    assert all("timed out" not in text.lower() for text in logs.values()), logs
    assert "out of memory on rank 0 of 2 in step 3 with micro-batch 4" in logs[0]
    assert "lower --batch.micro (e.g. --batch.micro=2)" in logs[0]
    assert all("Traceback" not in text for text in logs.values()), logs


MOE = ["--preset=moe-tiny", "--moe.expert_hidden=64", "--distributed.strategy=ddp"]


def test_expert_parallel_run_resumes_exactly_at_its_degree_and_at_degree_1(work):
    """moe-tiny (router-bias updates on) with its experts over 2 ranks, stopped at step 10 of 20 and
    resumed by the same command: every step and the final validation loss are the uninterrupted
    run's (the optimizer's expert state comes back sliced like the experts, the bias's pending
    loads too). The stopped run, resumed in one process with the documented batch (the same global
    batch by accumulation, degree 1), ends at the same losses too. The experts grow during the run
    (moe.grow_at_step 5: 8 -> 10): one new expert on each rank, the resumes past it exact, the new
    experts in experts.json (the load plot's data) from step 6 on."""
    steps = STEPS // 2  # half the others' steps: the resume, not the learning, is what this checks
    grow = ["--moe.grow_at_step=5", "--moe.grow_to=10"]
    ep = [*MOE, *grow, "--distributed.expert_parallel=2", f"--train.max_steps={steps}"]
    proc = _forked(_torchrun(2) + _args(work, "ep", MICRO, *ep), work / "ep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _losses(work, "ep")
    assert sorted(reference) == list(range(1, steps + 1)) and reference[steps] < reference[1] - 0.3
    # grown after step 5: each rank held 4 experts, kept them and got one new one (positions 4, 9)
    experts = json.loads((work / "runs" / "ep" / "experts.json").read_text())
    assert experts["grown"] == [{"step": 5, "from": 8, "to": 10, "new": [4, 9]}]
    assert experts["placement"]["ranks"] == [list(range(5)), list(range(5, 10))]
    loads = {h["step"]: h["load"] for h in experts["history"]}
    assert all(row[4] == row[9] == 0 for s in range(1, 6) for row in loads[s])
    assert all(sum(row[4] + row[9] for row in loads[s]) > 0 for s in range(6, steps + 1))
    assert (work / "runs" / "ep" / "plots" / "expert_load.png").is_file()

    proc = _forked(
        _torchrun(2) + _args(work, "ep-stopped", MICRO, *ep, f"--train.stop_after_steps={steps // 2}"),
        work / "ep-stopped",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(work / "runs" / "ep-stopped", work / "runs" / "ep-degree1")
    resumed = _forked(
        _torchrun(2) + ["--resume", str(work / "runs" / "ep-stopped"), "--no-progress"], work / "ep-resumed"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the same ranks and degree: bit for bit
    _assert_same(_losses(work, "ep-stopped"), reference, tolerance=0.0)
    assert _val(work, "ep-stopped") == _val(work, "ep")

    # as the README says
    one = inprocess.train(
        [
            "--resume",
            str(work / "runs" / "ep-degree1"),
            "--no-progress",
            "--distributed.strategy=single",
            "--distributed.expert_parallel=1",
            f"--batch.global_size={2 * MICRO}",
        ]
    )
    assert one.returncode == 0, one.stderr[-3000:]
    summary = json.loads((work / "runs" / "ep-degree1" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["resolved"]["global_batch"] == 2 * MICRO
    # one process, micro MICRO x accumulation 2, is the two ranks' step: the same rows, the same
    # load-balancing loss (one mean per micro-batch) and the same router-bias moves
    _assert_same(_losses(work, "ep-degree1"), reference)
    assert abs(_val(work, "ep-degree1") - _val(work, "ep")) <= 1e-5


def _said_once_by_rank_0(proc: subprocess.CompletedProcess, log_dir: Path, *expected: str) -> None:
    """The failure is one line on rank 0, which found it, holding each of ``expected``; rank 1 ends
    quietly (no error, no "another rank stopped or was lost", no traceback); torchrun names rank 0
    as the root cause."""
    assert proc.returncode != 0
    logs = _rank_logs(log_dir)
    said = {
        r: [line for line in text.splitlines() if line.startswith("turbotrain train:")]
        for r, text in logs.items()
    }
    assert len(said[0]) == 1 and all(e in said[0][0] for e in expected), logs[0]
    assert said[1] == [] and "Traceback" not in logs[1] and "another rank" not in logs[1], logs[1]
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "rank      : 0" in root_cause and "exitcode  : 2" in root_cause


@pytest.fixture(scope="module")
def ddp_run(work: Path, launched) -> Path:
    """A completed 2-rank ddp run with sharded checkpoints at steps 20 and 40, for the resumes below
    to copy (a resume reaches the run lock and the checkpoints whether the run ended or stopped)."""
    proc = launched("ddp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "runs" / "ddp"


def _copy_run(run: Path, name: str) -> Path:
    target = run.parent / name
    shutil.copytree(run, target)
    return target


def test_a_run_in_use_is_said_once_by_rank_0(ddp_run, tmp_path):
    from turbotrain.base.runlock import RunLock

    run = _copy_run(ddp_run, "in-use")
    held = tmp_path / "held"

    def hold() -> None:  # another process trains it, as far as the resume can tell
        with RunLock(run):
            held.touch()
            time.sleep(HANG_S)

    holder = inprocess.fork(hold, tmp_path / "holder.out")
    try:
        deadline = time.monotonic() + HANG_S
        while not held.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held.exists(), (tmp_path / "holder.out").read_text()
        cmd = _torchrun(2, log_dir=tmp_path / "logs") + ["--resume", str(run), "--no-progress"]
        proc = _forked(cmd, tmp_path / "out")
    finally:
        holder.kill()
        holder.wait(HANG_S)
    _said_once_by_rank_0(proc, tmp_path / "logs", f"run directory {run} is in use by process {holder.pid}")


def test_no_usable_checkpoint_and_a_refused_metadata_are_said_once_by_rank_0(ddp_run, tmp_path):
    """One resume, each checkpoint refused for its own reason: step 20's .metadata no longer
    matches its marker; step 40's (the newest, tried first) would run code when unpickled, its
    marker rewritten to vouch for it (refused, never called). Rank 0's one line says there is no
    usable checkpoint and names the refused metadata."""
    import hashlib
    import pickle

    run = _copy_run(ddp_run, "no-usable")
    older, newest = sorted(run.glob("checkpoints/step_*"))
    (older / ".metadata").write_bytes(b"garbage")
    evil = pickle.dumps(os.system)  # a function to call: refused, never called
    (newest / ".metadata").write_bytes(evil)
    marker = json.loads((newest / "finished.json").read_text())
    marker["files"][".metadata"] = {"size": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    (newest / "finished.json").write_text(json.dumps(marker))
    proc = _forked(
        _torchrun(2, log_dir=tmp_path / "logs") + ["--resume", str(run), "--no-progress"], tmp_path / "out"
    )
    _said_once_by_rank_0(
        proc,
        tmp_path / "logs",
        f"no usable checkpoint in {run / 'checkpoints'}",
        "is not part of a checkpoint's metadata",
    )


def test_a_full_disk_at_a_sharded_save_is_said_once(work, tmp_path):
    """A file-size limit (what a full disk looks like to a write) hit by every rank's checkpoint
    files: the first rank that failed says it, in one line; the other ends quietly."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    # the first save (step 2) is the one that fails: no need to train further
    cmd = _torchrun(2, log_dir=tmp_path / "logs") + _args(
        work, "full-disk", MICRO, "--distributed.strategy=ddp", "--train.checkpoint_every=2"
    )
    proc = _forked(cmd, tmp_path / "out", before=limit)
    _said_once_by_rank_0(proc, tmp_path / "logs", "full-disk/checkpoints/step_00000002")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ranks_whose_launcher_was_killed_stop_with_a_checkpoint(work, tmp_path):
    """kill -9 of torchrun's whole process group leaves the ranks (each in its own session)
    orphaned: they notice, stop together after a step, save a checkpoint there and write the
    summary, instead of training on to the end with no launcher."""
    name, steps = "orphans", 2000
    cmd = _torchrun(2, log_dir=tmp_path / "logs") + _args(
        work, name, MICRO, "--distributed.strategy=ddp", f"--train.max_steps={steps}", "--monitor.log_every=1"
    )
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    metrics = work / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline and proc.poll() is None and len(_losses_if_any(metrics)) < 5:
        time.sleep(0.05)
    ranks = [p for p in _children(proc.pid) if _rank_of(p) is not None]
    assert len(ranks) == 2 and proc.poll() is None, "the run ended before its launcher could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its agent; the ranks live in their own sessions
    proc.wait()
    killed_at = time.monotonic()
    # a bound on a hang: ranks that trained on without their launcher would end at step 2000 (the
    # summary below says so), not here
    while any(_alive(p) for p in ranks) and time.monotonic() - killed_at < HANG_S:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), "orphaned ranks must stop on their own"
    summary = json.loads((work / "runs" / name / "summary.json").read_text())
    assert summary["steps"] < steps and summary["stop_reason"].startswith("signal")
    saved = sorted(work.glob(f"runs/{name}/checkpoints/step_*/finished.json"))
    assert saved and saved[-1].parent.name == f"step_{summary['steps']:08d}", (
        "a checkpoint at the step it stopped"
    )
    logs = _rank_logs(tmp_path / "logs")
    # the rank whose watcher polls first says it; the other may stop at the agreed step before its own poll
    assert any("launcher of this rank" in text for text in logs.values()), logs
    assert not any("Traceback" in text for text in logs.values()), logs


def _losses_if_any(metrics: Path) -> list[str]:
    try:
        return [line for line in metrics.read_text().splitlines() if '"loss"' in line]
    except OSError:
        return []


def test_resuming_a_completed_run_removes_what_killed_saves_left(work, single):
    run = _copy_run(work / "runs" / "single", "completed-with-temps")
    dead = _dead_pid()
    temp = run / "checkpoints" / f".step_00000041.pt.tmp{dead}"  # a save killed mid-write
    temp.write_bytes(b"half")
    partial = run / "checkpoints" / ".step_00000042.partial"  # a sharded save killed mid-way
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    proc = inprocess.train(["--resume", str(run), "--no-progress"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not temp.exists() and not partial.exists()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
