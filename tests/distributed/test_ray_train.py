"""turbotrain under Ray Train's TorchTrainer on a real local Ray cluster (``ray.init``, 2 CPUs, gloo),
as a user would check it (#48 item 2):

- two Ray workers give the per-step losses of ``torchrun --nproc-per-node 2 -m turbotrain train``
  with the same settings (the two-process tolerance, 1e-5);
- a worker killed with SIGKILL mid-run: Ray starts the group again (``FailureConfig``), it resumes
  from the checkpoint Ray was told of, and the run ends with the per-step losses and the final
  weights of the run never killed, exactly; the restart is in its summary.

One Ray cluster and one Ray run for the module (each costs tens of seconds on 2 shared cores): the
run whose worker is killed. The run never killed is torchrun's, which Ray's unkilled runs equal bit
for bit (same ranks, same gloo reductions): the killed run held to it exactly shows both. A Ray
run that ends with no restart is not run on its own (its path is the killed run's first attempt).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CORPUS, HANG_S
from test_torchrun_train import TINY

from turbotrain.base.config import parse_overrides
from turbotrain.loop.checkpoint.restore import load_latest_weights

# Ray (and turbotrain.integrations.ray, which imports it) is imported by the fixtures, not here:
# every xdist worker collects this module, and importing Ray costs each of them seconds
WHY = "Ray Train is an optional extra: pip install 'turbotrain[ray]'"

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SRC, FAULTS = ROOT / "src", ROOT / "tests" / "faults"
STEPS, EVERY, KILL_AT = 12, 4, 10  # rank 1 dies inside step 10: the group resumes from step 8
# the tiny GPT of the torchrun tests, shorter, checkpointing more often, ddp
ARGS = [
    *(a for a in TINY if a != "--no-progress"),  # loop_config takes config fields only
    "--monitor.progress=false",
    f"--train.max_steps={STEPS}",
    f"--train.checkpoint_every={EVERY}",
    "--batch.micro=4",
    "--distributed.strategy=ddp",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray_train")
    (root / "corpus.txt").write_text(CORPUS)
    return root


def _args(work: Path, name: str) -> list[str]:
    return [
        f"--data.path={work / 'corpus.txt'}",
        f"--data.cache_dir={work / 'cache'}",
        f"--run.out_dir={work / 'runs'}",
        f"--run.name={name}",
        *ARGS,
    ]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs; its workers import this checkout and tests/faults, one torch thread each."""
    ray = pytest.importorskip("ray", reason=WHY)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS", "RAY_DEDUP_LOGS")}
    path = os.pathsep.join(filter(None, [str(SRC), str(FAULTS), saved["PYTHONPATH"]]))
    os.environ.update(PYTHONPATH=path, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
    sys.path.insert(0, str(FAULTS))
    for attempt in (1, 2):  # Ray gives its node 30 s to register: a loaded machine may need a second try
        try:
            ray.init(num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        yield
    finally:
        ray.shutdown()
        sys.path.remove(str(FAULTS))
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def torchrun(work: Path, cluster: None) -> Iterator[subprocess.Popen]:
    """The reference, ``torchrun --nproc-per-node 2 -m turbotrain train``, started once Ray
    runs: it trains while Ray starts its workers (most of which is waiting)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    with (
        (work / "torchrun.log").open("w") as log,
        subprocess.Popen(
            [*cmd, "-m", "turbotrain", "train", *_args(work, "torchrun")], env=env, stdout=log, stderr=log
        ) as proc,
    ):
        yield proc
        if proc.poll() is None:
            proc.kill()


def _fit(work: Path, name: str, loop: Any, **extra: Any) -> Any:
    """A 2-worker TorchTrainer run of ``_args(work, name)``, at most one restart; Ray's result."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from turbotrain.integrations.ray import loop_config

    config = {**loop_config(**parse_overrides(_args(work, name))), **extra}
    trainer = TorchTrainer(
        loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name, storage_path=str(work / "ray"), failure_config=FailureConfig(max_failures=1)
        ),
    )
    return trainer.fit()


def _losses(work: Path, name: str) -> dict[int, float]:
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}


def _pointer(result: Any) -> dict[str, Any]:
    from turbotrain.integrations.ray import POINTER

    with result.checkpoint.as_directory() as folder:
        return dict(json.loads((Path(folder) / POINTER).read_text()))


@pytest.fixture(scope="module")
def reference(work: Path, torchrun: subprocess.Popen) -> dict[int, float]:
    """The run never killed: torchrun's per-step losses."""
    assert torchrun.wait(timeout=HANG_S) == 0, (work / "torchrun.log").read_text()[-3000:]
    losses = _losses(work, "torchrun")
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5  # it learns
    return losses


@pytest.fixture(scope="module")
def killed(work: Path, torchrun: subprocess.Popen) -> Any:
    """The Ray run whose rank 1 is killed with SIGKILL inside step KILL_AT, once: Ray's result."""
    from ray_faults import train_loop_killed_once

    marker = work / "killed"
    kill = {"rank": 1, "step": KILL_AT, "marker": str(marker)}
    result = _fit(work, "killed", train_loop_killed_once, kill=kill)
    assert marker.is_file(), "rank 1 was never killed"
    assert result.error is None, result.error
    return result


def test_two_ray_workers_give_the_losses_of_torchrun_nproc_per_node_2(
    work: Path, killed: Any, reference: dict[int, float]
) -> None:
    under_ray = _losses(work, "killed")
    assert sorted(reference) == sorted(under_ray)
    worst = max(abs(under_ray[s] - reference[s]) for s in reference)
    assert worst <= 1e-5, f"Ray's losses differ from torchrun's by {worst}"
    # Ray's last checkpoint names the run's store and its last step
    assert _pointer(killed) == {
        "run": "killed",
        "resume": f"file://{work / 'ray' / 'killed' / 'turbotrain'}/killed",
        "run_dir": str(work / "runs" / "killed"),
        "step": STEPS,
    }


def test_a_worker_killed_with_sigkill_is_restarted_by_ray_and_resumes_exactly(
    work: Path, killed: Any, reference: dict[int, float]
) -> None:
    assert _losses(work, "killed") == reference  # every step, to the bit
    _, got = load_latest_weights(work / "runs" / "killed" / "checkpoints")
    _, want = load_latest_weights(work / "runs" / "torchrun" / "checkpoints")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    summary = json.loads((work / "runs" / "killed" / "summary.json").read_text())
    restart = summary["restarts"]["each"]
    # from the newest complete checkpoint: step 8's, or step 4's when step 8's async write was still
    # going at the kill (a loaded machine)
    assert summary["restarts"]["count"] == 1 and restart[0]["step"] in (EVERY, 2 * EVERY)
    assert restart[0]["resumed_from"] == f"step_{restart[0]['step']:08d}"
    assert "Ray Train started the worker group again" in restart[0]["why"]
