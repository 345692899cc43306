"""Which start is a relaunch of the same run (issue 25 item 2): a worker group torchrun started
again in the same job (its rendezvous id recorded in the run) resumes by itself; a new torchrun,
even under the same run name, does not. A run without --run.name under --max-restarts gets a name
every start of the job shares. The summary counts the restarts metrics.jsonl recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from turbotrain import load_config
from turbotrain.app.report import format_markdown, summarize_records
from turbotrain.app.restart import keep_global_batch as _keep_global_batch
from turbotrain.app.restart import named_for_restarts as _named_for_restarts
from turbotrain.app.restart import peer_lost as _peer_lost
from turbotrain.app.restart import resume_command
from turbotrain.base.errors import ConfigError
from turbotrain.base.launch import Launch, Topology

UUID = "3f0c6a2e-8d1b-4b7e-9a55-0c2f1e7d9b31"


def _torchrun(run_id: str = UUID, restart: int = 0, max_restarts: int = 1) -> Launch:
    return Launch.from_env(
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        }
    )


def test_a_restarted_group_of_the_same_job_is_a_relaunch_and_a_new_job_is_not():
    recorded = _torchrun().record()
    assert "TORCHELASTIC_RESTART_COUNT=1 of 1" in _torchrun(restart=1).relaunch_of(recorded)
    assert "elastic" in _torchrun(restart=0).relaunch_of(recorded)  # a membership change keeps the count
    other = _torchrun(run_id="9d2f0000-0000-4000-8000-000000000000", restart=1)
    assert other.relaunch_of(recorded) == ""  # another job's restart never takes over this run
    assert _torchrun(restart=1).relaunch_of(None) == ""  # a run no job recorded (made before, or elsewhere)
    # no rendezvous id: no job known
    assert _torchrun("none", restart=1).relaunch_of(_torchrun("none").record()) == ""
    assert Launch.from_env({}).relaunch_of(recorded) == ""


def test_under_the_static_rendezvous_the_other_ranks_follow_rank_0s_decision_to_resume():
    """No rendezvous id: rank 0 resumes only the run its own agent started; the other ranks (on
    another node their agent differs from the recorded one) follow a restart, never decide alone."""
    recorded = {"torchrun_run_id": "none", "torchrun_agent": "node0:/tmp/torchelastic_a"}
    restarted = Launch(run_id="none", restart=1, max_restarts=3, agent="node0:/tmp/torchelastic_a")
    other_node = Launch(run_id="none", restart=1, max_restarts=3, agent="node1:/tmp/torchelastic_b")
    assert "TORCHELASTIC_RESTART_COUNT=1 of 3" in restarted.relaunch_of(recorded, main=True)
    assert other_node.relaunch_of(recorded, main=True) == ""  # rank 0 of another launch: refused
    assert "TORCHELASTIC_RESTART_COUNT=1 of 3" in other_node.relaunch_of(recorded, main=False)  # follows
    first_start = Launch(run_id="none", restart=0, max_restarts=3, agent="node1:/tmp/torchelastic_b")
    assert first_start.relaunch_of(recorded, main=False) == ""  # not a restart: nothing to follow


def test_a_run_torchrun_may_restart_is_named_from_its_job():
    base = load_config("gpt-tiny")
    assert _named_for_restarts(base, _torchrun()).run.name == "gpt-tiny-3f0c6a2e"
    # the same at every start
    assert _named_for_restarts(base, _torchrun(restart=1)).run.name == "gpt-tiny-3f0c6a2e"
    assert _named_for_restarts(base, _torchrun("job-42")).run.name == "gpt-tiny-job-42"
    # no restarts: the timestamp, as before
    assert _named_for_restarts(base, _torchrun(max_restarts=0)).run.name == ""
    assert _named_for_restarts(base.replace(run={"name": "mine"}), _torchrun()).run.name == "mine"
    with pytest.raises(ConfigError, match=r"name it with --run.name=NAME \(or give torchrun --rdzv-id"):
        _named_for_restarts(base, _torchrun("none"))  # multi-node without --rdzv-id: no job to name it from


def test_a_relaunch_at_another_world_size_keeps_the_global_batch_by_accumulation():
    config = load_config("gpt-tiny", {"batch": {"micro": "4"}})
    one = Topology(world=1)
    kept = _keep_global_batch(config, {"global_batch": 8}, one)
    assert kept.batch.global_size == 8  # resolve_accumulation: accumulation 2 on one process
    assert _keep_global_batch(config, {"global_batch": 8}, Topology(world=2)) is config  # unchanged world
    # cannot: the resume refuses
    assert _keep_global_batch(config, {"global_batch": 6}, Topology(world=4)) is config
    assert _keep_global_batch(config, None, one) is config


def test_the_summary_counts_the_restarts_in_the_metrics():
    records = [{"step": s, "loss": 3.0 - s / 10} for s in range(1, 11)]
    records.insert(
        5,
        {
            "step": 5,
            "event": "restart",
            "restart": 1,
            "time": "2026-01-01T00:00:00Z",
            "why": "torchrun restarted the workers",
            "resumed_from": "step_00000005",
            "steps_redone": 2,
            "world_size": 2,
        },
    )
    summary = summarize_records(records)
    assert summary["restarts"]["count"] == 1 and summary["restarts"]["each"][0]["step"] == 5
    assert summary["logged_steps"] == 10 and summary["last_step"] == 10
    assert (
        "resumed at step 5 from step_00000005 on 2 process(es), 2 logged step(s) trained again"
        in format_markdown({"run": "r", "status": "completed", **summary})
    )
    assert "restarts" not in summarize_records(records[:5])


@pytest.mark.parametrize(
    "restart, then",
    [
        (
            0,
            "torchrun starts the workers again (restart 1 of --max-restarts 1), which resume from the newest one by themselves",
        ),
        # no restart left
        (
            1,
            "continue with `torchrun --nproc-per-node 2 -m turbotrain train --resume runs/r`",
        ),
    ],
)
def test_a_lost_rank_says_whether_torchrun_restarts_the_group(monkeypatch, restart, then):
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": UUID,
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": "1",
    }.items():
        monkeypatch.setenv(key, value)
    line = _peer_lost(
        RuntimeError("gloo: Connection reset by peer"), Topology(0, 0, 2, True, "torchrun"), Path("runs/r")
    )
    assert (
        line is not None
        and line.startswith("[rank 0] another rank stopped or was lost")
        and line.endswith(then)
    )


def test_the_resume_hint_names_the_launch_that_can_continue_the_run(monkeypatch):
    """Issue 23 item 11: a ddp/fsdp run refuses a plain `turbotrain train --resume`, so a stopped
    rank's hint names torchrun (or srun) with the same processes; one process keeps the plain one."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resume_command("runs/a", Topology()) == "turbotrain train --resume runs/a"
    two = Topology.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert resume_command("runs/a", two) == "torchrun --nproc-per-node 2 -m turbotrain train --resume runs/a"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 nodes x 4: the node count comes from the user's launch
    eight = Topology.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert resume_command("runs/a", eight) == "torchrun ... (as before) -m turbotrain train --resume runs/a"
    slurm = Topology(rank=0, world=2, launched=True, launcher="slurm")
    assert resume_command("runs/a", slurm).startswith("srun ") and "--resume runs/a" in resume_command(
        "runs/a", slurm
    )
