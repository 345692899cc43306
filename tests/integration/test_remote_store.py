"""Checkpoints and records in an S3 store (``run.remote``), against a real S3-compatible server:
moto's standalone server, started here as its own process on a free port, spoken to over HTTP by
s3fs, its endpoint and credentials in the standard AWS variables (never in turbotrain's config).

- kill -9 while a checkpoint is half uploaded (its data in the store, its marker not), the local
  run directory deleted, ``--resume s3://...`` alone: the half-uploaded checkpoint skipped in one
  line, the run ends with the per-step losses and final weights of a run never killed;
- the server stopped mid-run: one warning, training completes, the end names what is missing;
- a bucket that does not exist: one line naming run.remote at the start, exit 2, no traceback.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import inprocess
import pytest
import torch
from conftest import BUCKET, HANG_S, s3_client

pytestmark = pytest.mark.slow

TINY = [
    "--run.device=cpu",
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=64",
    "--model.block_size=32",
    "--model.dropout=0",
    "--batch.micro=4",
    "--train.max_steps=12",
    "--train.checkpoint_every=3",
    "--train.keep_last=2",
    "--train.eval_every=0",
    "--train.eval_batches=2",
    "--monitor.log_every=1",
    "--precision.mode=fp32",
    "--data.num_workers=0",
    "--monitor.nvml=false",
    "--no-progress",
]


def _train(
    tmp_path: Path, args: list[str], env: dict[str, str], fault: str = "", marker: Path | None = None
) -> inprocess.Forked:
    """`python -m turbotrain train ARGS` with the store's ``env`` and ``fault`` injected, in its own
    process (forked from this one: it is killed, or runs while the server is stopped); its output
    in tmp_path/stdout.txt and stderr.txt."""
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    return inprocess.turbotrain(["train", *args], out, err, fault, marker, env=env)


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "step_00000012.pt", weights_only=True)["model"]


def test_kill_mid_upload_then_resume_from_the_uri_alone_equals_the_unkilled_run(tmp_path: Path, s3) -> None:
    env, _ = s3
    out = ["--run.out_dir", str(tmp_path)]
    full = inprocess.train(
        [*TINY, *out, "--run.name=full"]
    )  # the reference: no store, no kill, in this process
    assert full.returncode == 0, full.stderr
    # training held at step 8 (checkpoints 3 and 6 written, synchronously: none pruned yet) while the
    # mirror uploads them: step 6's marker is never uploaded, its data is in the store, it is not whole
    killed = _train(
        tmp_path,
        [*TINY, *out, "--run.name=k", f"--run.remote=s3://{BUCKET}/runs", "--train.async_checkpoint=false"],
        env,
        "pause-step:8,remote-before-marker:2",
        tmp_path / "paused",
    )
    assert killed.wait(timeout=HANG_S) == -9
    listing = s3_client(env).list_objects_v2(Bucket=BUCKET, Prefix="runs/k/checkpoints/")["Contents"]
    assert {o["Key"].rpartition("/")[2] for o in listing} == {
        "step_00000003.pt",
        "step_00000003.pt.sha256",
        "step_00000006.pt",
    }
    shutil.rmtree(tmp_path / "k")  # the node is gone

    resumed = _train(tmp_path, ["--resume", f"s3://{BUCKET}/runs/k", *out, "--no-progress"], env)
    stdout, stderr = resumed.communicate(timeout=HANG_S)
    assert resumed.returncode == 0, stderr
    skipped = [line for line in stderr.splitlines() if "skipped" in line]
    assert skipped == [
        f"WARNING turbotrain.loop.checkpoint.remote: skipped s3://{BUCKET}/runs/k/checkpoints/step_00000006.pt: "
        "its upload did not finish (no marker)"
    ]
    assert "fetched step_00000003.pt" in stdout
    assert _losses(tmp_path / "k") == _losses(
        tmp_path / "full"
    )  # steps 4-12 trained after the resume, to the bit
    got, want = _weights(tmp_path / "k"), _weights(tmp_path / "full")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert "not in the store" not in stderr  # everything reached it this time


def test_server_stopped_mid_run_is_one_warning_and_the_end_names_what_is_missing(tmp_path: Path, s3) -> None:
    env, server = s3
    marker = tmp_path / "paused"
    run = _train(
        tmp_path,
        [*TINY, "--run.out_dir", str(tmp_path), "--run.name=r", f"--run.remote=s3://{BUCKET}/runs"],
        env,
        "pause-step:5",
        marker,
    )
    deadline = time.monotonic() + HANG_S
    while not marker.exists():
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    server.kill()
    server.wait()
    marker.unlink()
    stdout, stderr = run.communicate(timeout=HANG_S)
    assert run.returncode == 0, stderr
    assert "completed at step 12/12" in stdout
    warnings = [line for line in stderr.splitlines() if "uploads fail" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"WARNING turbotrain.loop.checkpoint.remote: run.remote=s3://{BUCKET}/runs/r"
    )
    missing = [line for line in stderr.splitlines() if "not in the store" in line]
    assert len(missing) == 1 and "step_00000012.pt" in missing[0] and "summary.json" in missing[0], stderr
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("*.pt")) == [
        "step_00000009.pt",
        "step_00000012.pt",
    ]


def test_a_bucket_that_does_not_exist_is_one_line_at_the_start(tmp_path: Path, s3) -> None:
    env, _ = s3
    run = _train(
        tmp_path,
        [*TINY, "--run.out_dir", str(tmp_path), "--run.name=b", "--run.remote=s3://no-such-bucket/runs"],
        env,
    )
    stdout, stderr = run.communicate(timeout=HANG_S)
    assert run.returncode == 2
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "run.remote=s3://no-such-bucket/runs/b" in lines[0], stderr
    assert "Traceback" not in stderr and not (tmp_path / "b" / "config.toml").exists()


def test_the_same_command_on_an_empty_disk_continues_the_run_in_the_store(tmp_path: Path) -> None:
    """A Kubernetes pod rescheduled on another node runs the same command (same run.name and
    run.remote) with no run directory: the run in the store continues (file:// store: no server)."""
    store = f"file://{tmp_path / 'store'}"
    args = [*TINY, "--run.out_dir", str(tmp_path / "runs"), "--run.name=pod", f"--run.remote={store}"]
    # the same command twice, in this process (what is checked is the store and the output, not a process)
    first = inprocess.train([*args, "--train.max_steps=6"])
    assert first.returncode == 0, first.stderr
    shutil.rmtree(tmp_path / "runs")
    again = inprocess.train([*args, "--train.max_steps=9"])
    assert again.returncode == 0, again.stderr
    assert f"continuing {store}/pod: run.remote holds a run named pod" in again.stdout
    assert sorted(_losses(tmp_path / "runs" / "pod")) == list(range(1, 10))  # steps 1-6 fetched, 7-9 trained
    assert (
        json.loads((tmp_path / "runs" / "pod" / "summary.json").read_text())["resumed_from"]
        == "step_00000006.pt"
    )
