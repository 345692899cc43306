"""Model specs and the epoch order of a workload's dataset: what the run assembly relies on."""

from __future__ import annotations

from torch import nn

from turbotrain import load_config
from turbotrain.parts.data.epochs import EpochSampler
from turbotrain.parts.data.loader import Position
from turbotrain.parts.models.blocks import declare_blocks, repeated_blocks
from turbotrain.parts.models.gpt.spec import GPTSpec
from turbotrain.parts.models.moe.spec import MoESpec
from turbotrain.parts.models.registry import spec_for
from turbotrain.parts.models.workload_spec import WorkloadSpec


def _step_rows(sampler_args: dict, step: int) -> list[int]:
    """Every rank's rows of optimizer ``step``, over its micro-steps, sorted."""
    world, accumulation = sampler_args["world"], sampler_args["accumulation"]
    rows: list[int] = []
    for rank in range(world):
        s = EpochSampler(
            100,
            sampler_args["micro"],
            seed=7,
            shuffle=True,
            at=Position(rank=rank, world=world, accumulation=accumulation),
        )
        for j in range(accumulation):
            rows += s.batch(step * accumulation + j)
    return sorted(rows)


def test_every_split_of_the_global_batch_gets_the_same_rows_per_step_and_an_epoch_visits_each_once():
    splits = [
        dict(micro=8, world=1, accumulation=1),
        dict(micro=4, world=1, accumulation=2),
        dict(micro=4, world=2, accumulation=1),
        dict(micro=2, world=2, accumulation=2),
    ]
    for step in (0, 5, 11, 12, 13):  # 100 rows / 8 = 12 steps per epoch: 12 and 13 are in the second epoch
        assert len({tuple(_step_rows(split, step)) for split in splits}) == 1
    first = [r for step in range(12) for r in _step_rows(splits[0], step)]
    second = [r for step in range(12, 24) for r in _step_rows(splits[0], step)]
    assert len(set(first)) == len(first) == 96 and first != second  # each row once, then a new order
    # after step 3, micro-step 1
    resumed = EpochSampler(100, 4, seed=7, shuffle=True, at=Position(start=7, accumulation=2))
    assert next(iter(resumed)) == EpochSampler(
        100, 4, seed=7, shuffle=True, at=Position(accumulation=2)
    ).batch(7)


def test_the_config_names_the_spec_and_a_spec_declares_the_blocks_the_engine_acts_on():
    assert type(spec_for(load_config("gpt-tiny"))) is GPTSpec
    assert type(spec_for(load_config("moe-tiny"))) is MoESpec
    assert type(spec_for(load_config(None, {"model": {"workload": "x.py:make"}}))) is WorkloadSpec
    model = nn.Sequential(
        nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    )
    assert repeated_blocks(model) is model[1]  # found by size
    declare_blocks(model, model[0])
    assert repeated_blocks(model) is model[0]  # what the spec said
    declare_blocks(model, None)
    assert repeated_blocks(model) is model[1]
