"""The parallel plan: resolved once per process from the config and the launch, checked before any
process group exists, and the one thing the strategy carries out (data and expert dimensions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turbotrain import load_config
from turbotrain.app.training import plan_run
from turbotrain.base.errors import ConfigError
from turbotrain.base.launch import Topology
from turbotrain.cli import main
from turbotrain.core.plan import ParallelPlan
from turbotrain.parts.models.blocks import repeated_blocks
from turbotrain.parts.models.spec import ModelSpec

TORCHRUN_4 = Topology(rank=1, local_rank=1, world=4, launched=True, launcher="torchrun")


def test_the_plan_resolves_the_strategy_and_the_expert_dimension_from_the_config_and_the_launch():
    plan = ParallelPlan.resolve(
        load_config("moe-tiny", ["--distributed.expert_parallel=2"]).distributed, TORCHRUN_4, 8
    )
    # auto -> ddp
    assert (plan.strategy, plan.expert, plan.data, plan.rank, plan.sharded) == (
        "ddp",
        2,
        4,
        1,
        False,
    )
    assert ParallelPlan.resolve(load_config("gpt-tiny").distributed, Topology()).strategy == "single"
    fsdp = ParallelPlan.resolve(
        load_config("gpt-tiny", ["--distributed.strategy=fsdp"]).distributed, TORCHRUN_4
    )
    assert fsdp.sharded and fsdp.experts is None  # no expert dimension: no groups to make


@pytest.mark.parametrize(
    "preset, args, topology, words",
    [
        ("gpt-tiny", ["--distributed.strategy=ddp"], Topology(), ["needs processes started by torchrun"]),
        ("gpt-tiny", ["--distributed.strategy=single"], TORCHRUN_4, ["'single' but 4 processes"]),
        ("gpt-tiny", ["--distributed.expert_parallel=2"], TORCHRUN_4, ["needs a mixture-of-experts model"]),
        ("moe-tiny", ["--distributed.expert_parallel=8"], TORCHRUN_4, ["must divide the world size 4"]),
        (
            "moe-tiny",
            ["--distributed.expert_parallel=2", "--distributed.strategy=fsdp"],
            TORCHRUN_4,
            ["runs with DDP"],
        ),
        (
            "gpt-tiny",
            ["--batch.micro=3", "--batch.global_size=16"],
            TORCHRUN_4,
            ["batch.global_size = 16", "micro x world = 3 x 4"],
        ),
    ],
)
def test_a_plan_that_cannot_run_is_one_line_before_any_process_joins(preset, args, topology, words):
    with pytest.raises(ConfigError) as err:
        plan_run(load_config(preset, args), topology)  # no process group needed: every rank says the same
    assert all(w in str(err.value) for w in words), err.value


def test_the_global_batch_is_split_over_the_data_dimension():
    config, plan = plan_run(
        load_config("gpt-tiny", ["--batch.micro=2", "--batch.global_size=16"]), TORCHRUN_4
    )
    assert config.batch.accumulation == 2 and plan.data == 4  # 16 = 2 x 2 x 4


@pytest.mark.slow
def test_a_run_resolves_its_plan_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    calls: list[int] = []
    resolve = ParallelPlan.resolve.__func__  # type: ignore[attr-defined]

    def counted(cls, *args, **kwargs):
        calls.append(1)
        return resolve(cls, *args, **kwargs)

    monkeypatch.setattr(ParallelPlan, "resolve", classmethod(counted))
    args = ["--train.max_steps=2", "--train.eval_every=0", "--no-progress", "--run.out_dir", str(tmp_path)]
    assert (
        main(
            [
                "train",
                "--preset",
                "gpt-tiny",
                "--model.n_layer=1",
                "--model.d_model=32",
                "--model.n_head=2",
                *args,
            ]
        )
        == 0
    )
    assert len(calls) == 1  # the command's start; train(), the assembly and the Engine take that plan


def test_the_plans_mesh_has_the_data_dimension_or_replica_by_expert():
    """One DeviceMesh per run (built by join under a launcher): its dimensions, outermost first.
    With experts spread, a mesh row is an expert-parallel group of consecutive ranks and a column
    the ranks holding the same experts (the groups the experts' all-to-all and reductions use)."""
    dense = ParallelPlan.resolve(load_config("gpt-tiny").distributed, TORCHRUN_4)
    assert dense.mesh_dims == (("data", 4),)
    moe = ParallelPlan.resolve(
        load_config("moe-tiny", ["--distributed.expert_parallel=2"]).distributed, TORCHRUN_4, 8
    )
    assert moe.mesh_dims == (("replica", 2), ("expert", 2))
    plain = ParallelPlan.resolve(load_config("gpt-tiny").distributed, Topology())
    plain.join(torch.device("cpu"))  # a plain process: no process group, no mesh
    assert plain.mesh is None and plain.mesh_dims == (("data", 1),)


class _TwoLists(ModelSpec):
    """A family whose blocks are not the longest ModuleList (what the default search would pick)."""

    def open_data(self, c, run_dir, *, show):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def build(self, c, data):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.layers  # type: ignore[return-value]


def test_a_specs_parallelize_declares_its_blocks_and_pipeline_is_declared_not_built():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    model.heads = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
    plan = ParallelPlan.resolve(load_config("gpt-tiny").distributed, Topology())
    spec = _TwoLists()
    assert repeated_blocks(model) is model.heads  # found by size
    assert spec.parallelize(model, plan) is model
    assert repeated_blocks(model) is model.layers  # FSDP's, checkpointing's and compile's units
    with pytest.raises(NotImplementedError, match="pipeline"):
        spec.pipeline(model, plan, None)
