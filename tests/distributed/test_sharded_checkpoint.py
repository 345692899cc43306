"""Sharded checkpoints (torch.distributed.checkpoint) on 2 gloo processes, through the engine, fit()
and the Checkpointer (tests/distributed/ckpt_worker.py):

- a one-process ``.pt`` checkpoint resumes in 2 fsdp processes, which then write sharded folders;
  keep-last counts both kinds;
- a folder written by 2 fsdp processes resumes in 2 ddp processes (another layout: one chain covers
  both strategies, three launches instead of six) and in 1 process;
- an unfinished save (no marker, or a ``.partial`` folder) is never loaded and is removed;
- every resumed step has the loss of one uninterrupted process (fp32, within 1e-5).

The 2-process legs run torchrun in a fork of this process, its ranks forked (inprocess.torchrun).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import inprocess
import pytest
from test_torchrun_train import _forked, _torchrun

from turbotrain.cli import main

WORKER = Path(__file__).with_name("ckpt_worker.py")
STEPS = 12


def _run(folder: Path, strategy: str, nproc: int, max_steps: int, every: int, keep_last: int) -> list[dict]:
    out = folder.parent / f"{folder.name}-{strategy}-{nproc}-{max_steps}"
    args = [strategy, str(folder), str(max_steps), str(every), str(keep_last), str(out)]
    if nproc == 1:  # one plain process (no process group): this one
        inprocess.worker(WORKER, *args)
    else:  # torchrun in a fork, its ranks forked
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
        ]
        proc = _forked([*launcher, str(WORKER), *args], out)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _assert_same_losses(run: dict, reference: dict, steps: range) -> None:
    assert sorted(int(s) for s in run["losses"]) == list(steps)
    worst = max(abs(loss - reference["losses"][s]) for s, loss in run["losses"].items())
    assert worst <= 1e-5, f"resumed losses differ from an uninterrupted run by {worst}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, Path]:
    """One process, 12 steps uninterrupted, a .pt checkpoint every 3 steps."""
    folder = tmp_path_factory.mktemp("reference") / "ck"
    run = _run(folder, "single", 1, STEPS, 3, 10)[0]
    assert _names(folder) == [f"step_{s:08d}.pt{x}" for s in (3, 6, 9, 12) for x in ("", ".sha256")]
    assert run["losses"]["12"] < run["losses"]["1"]
    return run, folder


def test_checkpoints_reshard_between_one_and_two_processes_and_between_strategies(tmp_path, reference):
    """One chain over both strategies (each leg a launch): a one-process .pt resumes in 2 fsdp
    processes, whose sharded folder resumes in 2 ddp processes (another layout of the same state)
    and in 1 plain process."""
    ref, ref_folder = reference
    folder = tmp_path / "ck"
    folder.mkdir()
    for name in ("step_00000003.pt", "step_00000003.pt.sha256"):
        shutil.copy(ref_folder / name, folder / name)

    # a one-process checkpoint resumes in 2 fsdp processes; they save sharded folders at 4 and 6 (keep 2)
    ranks = _run(folder, "fsdp", 2, 6, 2, 2)
    for r in ranks:
        assert r["resumed"] == "step_00000003.pt" and r["world"] == 2
        _assert_same_losses(r, ref, range(4, 7))
    assert _names(folder) == ["step_00000004", "step_00000006"]  # keep-last 2 counted both kinds
    marker = json.loads((folder / "step_00000006" / "finished.json").read_text())
    assert marker["world"] == 2 and {"rank0.pt", "rank1.pt", "state.pt", ".metadata"} <= set(marker["files"])

    # unfinished saves: a folder without its marker and a .partial one, both newer
    shutil.copytree(folder / "step_00000006", folder / "step_00000008")
    (folder / "step_00000008" / "finished.json").unlink()
    shutil.copytree(folder / "step_00000008", folder / ".step_00000010.partial")
    alone = tmp_path / "alone"
    shutil.copytree(folder, alone)

    # written by 2 fsdp processes, resumed in 2 ddp processes ...
    for r in _run(folder, "ddp", 2, STEPS, 100, 2):
        assert r["resumed"] == "step_00000006"
        _assert_same_losses(r, ref, range(7, STEPS + 1))
    assert _names(folder) == ["step_00000006", "step_00000012"]  # the unfinished ones were removed
    marker = json.loads((folder / "step_00000012" / "finished.json").read_text())
    assert marker["world"] == 2  # ddp wrote its own sharded folder

    # ... and in 1 plain process (no process group), which writes the one-process format again
    run = _run(alone, "single", 1, STEPS, 100, 2)[0]
    assert run["resumed"] == "step_00000006"
    _assert_same_losses(run, ref, range(7, STEPS + 1))
    assert _names(alone) == ["step_00000006", "step_00000012.pt", "step_00000012.pt.sha256"]


def test_turbotrain_train_under_torchrun_resumes_in_one_process_and_samples(tmp_path, text_file):
    """The user's path: `torchrun ... -m turbotrain train --distributed.strategy fsdp` stopped at step
    6 of 9, `turbotrain train --resume` in one plain process with the same global batch, then
    `turbotrain sample`: every step's loss is the one of an uninterrupted one-process run."""
    runs = tmp_path / "runs"
    common = [
        "--run.out_dir",
        str(runs),
        "--run.device",
        "cpu",
        "--data.path",
        str(text_file),
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--data.num_workers",
        "0",
        "--model.n_layer",
        "2",
        "--model.n_head",
        "2",
        "--model.d_model",
        "32",
        "--model.block_size",
        "32",
        "--optim.warmup_steps",
        "2",
        "--train.max_steps",
        "9",
        "--train.eval_every",
        "3",
        "--train.eval_batches",
        "2",
        "--train.checkpoint_every",
        "3",
        "--monitor.log_every",
        "1",
        "--no-progress",
    ]

    def turbotrain(*args: str, nproc: int = 1) -> str:
        """Under torchrun: in a fork, its ranks forked; one process (the reference run, the resume,
        the sample): in this one, as a plain process with no process group runs it."""
        if nproc == 1:
            if args[0] == "train":
                proc = inprocess.train(list(args[1:]))
                assert proc.returncode == 0, proc.stderr[-4000:]
                return proc.stdout
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(list(args)) == 0
            return out.getvalue()
        assert args[0] == "train"
        proc = _forked(_torchrun(nproc) + list(args[1:]), tmp_path / "torchrun")
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    turbotrain("train", *common, "--run.name", "ref", "--batch.micro", "8")
    # global batch 2 x 4 = 8
    turbotrain(
        "train",
        *common,
        "--run.name",
        "t",
        "--batch.micro",
        "4",
        "--distributed.strategy",
        "fsdp",
        "--train.stop_after_steps",
        "6",
        nproc=2,
    )
    assert _names(runs / "t" / "checkpoints") == ["step_00000003", "step_00000006"]
    turbotrain(
        "train",
        "--resume",
        str(runs / "t"),
        "--batch.micro",
        "8",
        "--distributed.strategy",
        "single",
        "--train.stop_after_steps",
        "0",
        "--no-progress",
    )
    assert json.loads((runs / "t" / "summary.json").read_text())["resumed_from"] == "step_00000006"

    def losses(name: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (runs / name / "metrics.jsonl").read_text().splitlines()]

    ref, resumed = losses("ref"), losses("t")
    assert len(ref) == len(resumed) == 9
    assert max(abs(a - b) for a, b in zip(ref, resumed)) <= 1e-5
    for p in (runs / "t" / "checkpoints").glob("step_00000009.pt*"):
        p.unlink()  # the newest is now the folder the 2 ranks wrote
    assert turbotrain("sample", str(runs / "t"), "--tokens", "10", "--prompt", "def ").startswith("def ")
