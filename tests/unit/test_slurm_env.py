"""SLURM's variables read into the launch topology (issue 25 item 3): the node list's compact form,
torchrun's variables winning, one task (an salloc shell) a plain process, the derived port."""

from __future__ import annotations

import pytest

from turbotrain.base.errors import ConfigError
from turbotrain.base.launch import Launch, Topology, first_host, slurm_hosts

TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[007-008,010],cpu1",
}


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
        ("gpu[7-10]", ["gpu7", "gpu8", "gpu9", "gpu10"]),
        ("a[098-101]-ib,b[3]", ["a098-ib", "a099-ib", "a100-ib", "a101-ib", "b3"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_the_node_list_expands_in_order(nodelist, hosts):
    assert slurm_hosts(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


def test_a_node_list_it_cannot_read_is_one_line():
    with pytest.raises(ConfigError, match="node list"):
        slurm_hosts("n[a-c]")


def test_an_srun_task_joins_from_slurms_variables():
    t = Topology.from_env(TASK)
    assert (t.rank, t.local_rank, t.world, t.launched, t.launcher) == (3, 1, 8, True, "slurm")
    assert (t.master_addr, t.master_port) == ("gpu007", 15000 + 4242)
    t = Topology.from_env({**TASK, "SLURM_NODELIST": "x1", "SLURM_JOB_NODELIST": "", "MASTER_PORT": "29501"})
    assert (t.master_addr, t.master_port) == ("x1", 29501)
    assert Topology.from_env({**TASK, "MASTER_ADDR": "head"}).master_addr == "head"


def test_torchrun_wins_and_one_task_or_an_interactive_job_is_a_plain_process():
    t = Topology.from_env({**TASK, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})  # torchrun inside srun
    assert (t.rank, t.world, t.launcher) == (1, 2, "torchrun")
    # salloc / srun -n 1
    assert Topology.from_env({**TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == Topology()
    assert Topology.from_env({**TASK, "SLURM_JOB_NAME": "interactive"}) == Topology()
    assert Topology.from_env({k: v for k, v in TASK.items() if k != "SLURM_PROCID"}) == Topology()
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        Topology.from_env({**TASK, "SLURM_PROCID": "8"})


def test_requeued_counts_only_under_slurm():
    assert Launch.from_env({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "2"}).slurm_restart == 2
    assert Launch.from_env({"SLURM_JOB_ID": "1"}).slurm_restart == 0
    assert Launch.from_env({"SLURM_RESTART_COUNT": "2"}).slurm_restart == 0
