"""Kubernetes as the Kubeflow operators run turbotrain: ``torchrun`` configured by the ``PET_*``
variables alone (no torchrun flags: PET_NPROC_PER_NODE, PET_NNODES, PET_RDZV_BACKEND,
PET_RDZV_ENDPOINT), checkpoints mirrored to an S3 store (``run.remote``: a moto server here), and
a pod's preemption: SIGTERM to torchrun (the container's first process). Within the grace period
(30 s by default) the ranks stop after a step, save, the newest checkpoint is complete in the store,
and torchrun exits (with 1, its own status after a signal; the run continues with --resume). The model is a 2-layer gpt-tiny (the reference GPT's
own stop took 33 s on this loaded machine: docs/cluster.md); the time from SIGTERM to exit is printed.
torchrun's own main runs in a fork of the test process and its agent forks the ranks
(inprocess.torchrun): the signal, the agent's forwarding and the ranks' stop are turbotrain's and
torchrun's own, through torchrun's function entry point (its ranks forked); a pod's
``torchrun -m turbotrain`` starts interpreters and ends each through ``turbotrain/__main__.py``,
the path test_torchrun_train's kill -9 and bad-input tests run for real.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import inprocess
import pytest
from conftest import BUCKET, HANG_S, free_port, s3_client

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[2] / "src"


def test_sigterm_to_torchrun_from_pet_variables_ends_with_the_newest_checkpoint_in_the_store(
    tmp_path: Path, s3
) -> None:
    env, _ = s3
    port = free_port()
    pet = {
        "PET_NPROC_PER_NODE": "2",
        "PET_NNODES": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "-m", "turbotrain", "train", "--preset", "gpt-tiny"]
    cmd += [
        "--run.device=cpu",
        "--batch.micro=4",
        "--model.n_layer=2",  # small: the stop fits torchrun's 30 s on a loaded 2-core machine
        "--model.d_model=64",
        "--model.block_size=32",
        "--distributed.strategy=ddp",
        "--train.max_steps=10000",
        "--train.checkpoint_every=5",
        "--train.eval_every=0",
        "--monitor.log_every=1",
        "--data.num_workers=0",
        "--monitor.nvml=false",
        "--no-progress",
        f"--run.out_dir={tmp_path}",
        "--run.name=k8s",
        f"--run.remote=s3://{BUCKET}/runs",
    ]
    run_env = {
        **os.environ,
        **env,
        **pet,
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    # torchrun's main in a fork of this process, its ranks forked by its agent (inprocess.torchrun)
    out = tmp_path / "torchrun"
    proc = inprocess.torchrun(cmd[3:], out.with_suffix(".stdout"), out.with_suffix(".stderr"), env=run_env)
    metrics = tmp_path / "k8s" / "metrics.jsonl"
    deadline = time.monotonic() + HANG_S
    while not (metrics.is_file() and metrics.read_text().count('"loss"') >= 8):  # past the first checkpoint
        assert proc.poll() is None, out.with_suffix(".stderr").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the kubelet's preemption
    _, stderr = proc.communicate(timeout=HANG_S)
    took = time.monotonic() - sent
    print(f"SIGTERM to exit: {took:.1f} s")
    # torchrun's agent ends with 1 after a signal (its SignalException); the ranks stopped as asked
    assert proc.returncode == 1 and "got signal: 15" in stderr, stderr[-3000:]
    assert "signal SIGTERM stopped the run at step" in stderr, stderr[-3000:]
    local = sorted(
        p.name for p in (tmp_path / "k8s" / "checkpoints").glob("step_*") if (p / "finished.json").is_file()
    )
    keys = {o["Key"] for o in s3_client(env).list_objects_v2(Bucket=BUCKET, Prefix="runs/k8s/")["Contents"]}
    newest = local[-1]
    assert f"runs/k8s/checkpoints/{newest}/finished.json" in keys, sorted(keys)
    marker = json.loads(
        s3_client(env)
        .get_object(Bucket=BUCKET, Key=f"runs/k8s/checkpoints/{newest}/finished.json")["Body"]
        .read()
    )
    for name in marker["files"]:  # every file the marker vouches for is there
        assert f"runs/k8s/checkpoints/{newest}/{name}" in keys
    assert "runs/k8s/config.toml" in keys and "runs/k8s/summary.json" in keys
    assert "not in the store" not in stderr
    # torchrun's agent kills the ranks 30 s after it forwarded the SIGTERM; the examples' grace is 120 s
    assert took < 60, f"{took:.1f} s from SIGTERM to exit"
