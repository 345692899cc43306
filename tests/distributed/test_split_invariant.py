"""The data order does not depend on how the global batch is split (issue 25 item 1).

The rows of optimizer step ``s`` come from (seed, s) and the global batch alone, so a tiny GPT with a
global batch of 8 trains alike, loss at every step and final validation loss within 1e-5 (fp32),
as one process with micro 8, one process with micro 4 x accumulation 2, two gloo processes under
DDP with micro 4 (test_torchrun_train.py's 2-rank ddp run is this split, held to one process with
micro 8 within 1e-5 absolute: one launch checks both), and two under FSDP with micro 2 x
accumulation 2 -- that last one stopped at step 8; resumed in one process with no batch flag it is refused in one line naming the old and the new
global batch, before anything trains (issue 23 item 3); resumed with micro 4 x accumulation 2
(``--batch.global_size=8``) it ends at the uninterrupted run's loss. Expert parallelism over 2 processes (micro 4) equals one process
with micro 4 x accumulation 2, load-balancing loss and router-bias update included (the bias moves
once per optimizer step, from all its micro-batches' loads over all ranks). Token batching keeps the token-budget batches of each step
for any split with the same processes x accumulation, and a resume at another world size that keeps
it continues exactly; one that does not is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import inprocess
import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_torchrun_train import _forked, _torchrun

STEPS, STOP = 16, 8
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
    f"--train.checkpoint_every={STOP}",
    "--precision.mode=fp32",
    "--optim.warmup_steps=3",
    "--data.num_workers=0",
    "--no-progress",
    "--monitor.nvml=false",
]
MOE = [
    "--preset=moe-tiny",
    "--model.n_layer=1",
    "--model.d_model=32",
    "--model.n_head=2",
    "--model.block_size=32",
    "--moe.n_experts=4",
    "--moe.expert_hidden=32",
    "--optim.warmup_steps=3",
    "--optim.grad_clip=1.0",
]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("split")
    (root / "corpus.txt").write_text(
        "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600))
    )
    return root


def _train(
    work: Path, name: str, micro: int, accumulation: int = 1, nproc: int = 1, *more: str
) -> dict[int, float]:
    args = [
        "--data",
        str(work / "corpus.txt"),
        f"--run.out_dir={work / 'runs'}",
        f"--run.name={name}",
        f"--data.cache_dir={work / 'cache'}",
        *TINY,
        *more,
        f"--batch.micro={micro}",
        f"--batch.accumulation={accumulation}",
    ]
    # one process: in this one; torchrun: in a fork of this process, its ranks forked
    proc = _forked(_torchrun(nproc) + args, work / name) if nproc > 1 else inprocess.train(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(work, name)


def _losses(work: Path, name: str) -> dict[int, float]:
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}


def _summary(work: Path, name: str) -> dict:
    return json.loads((work / "runs" / name / "summary.json").read_text())


def _assert_same(losses: dict[int, float], reference: dict[int, float], steps: int = STEPS) -> None:
    assert sorted(losses) == list(range(1, steps + 1))
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in losses)
    assert worst <= 1e-5, (
        f"the loss per step differs from one process with micro 8 by up to {worst:.3g} (relative)"
    )


def test_every_split_of_the_global_batch_trains_alike_and_resumes_at_another_world_size(work):
    reference = _train(work, "micro8", 8)
    assert reference[STEPS] < reference[1] - 0.3  # it learns
    val = _summary(work, "micro8")["final_val_loss"]

    _assert_same(_train(work, "accumulated", 4, 2), reference)
    stopped = _train(work, "fsdp", 2, 2, 2, "--distributed.strategy=fsdp", f"--train.stop_after_steps={STOP}")
    _assert_same(stopped, reference, STOP)
    # validation: the same rows too
    assert abs(_summary(work, "accumulated")["final_val_loss"] - val) <= 1e-5 * val

    # resumed in one process with no batch flag: it would halve the global batch, so it is refused in
    # one line before anything trains (issue 23 item 3), and the run is left as it was
    run = work / "runs" / "fsdp"
    config, metrics = (run / "config.toml").read_bytes(), (run / "metrics.jsonl").read_bytes()
    refused = inprocess.train(["--resume", str(run), "--no-progress", "--distributed.strategy=single"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        "turbotrain train: error: step_00000008 was trained at a global batch of 8 (2 processes x batch.micro 2 x "
        "accumulation 2) and this resume would train at 4 (1 process x 2 x 2); keep 8 (the same batches) with "
        "--batch.micro=4 or --batch.global_size=8 (by accumulation 4), or train at 4 with --batch.micro=2"
    ]
    assert (run / "config.toml").read_bytes() == config and (run / "metrics.jsonl").read_bytes() == metrics
    assert not list(run.glob(".config.toml.tmp*"))

    # resumed in one process: micro 4 x accumulation 2 keeps the global batch, and the same rows per step
    resumed = inprocess.train(
        [
            "--resume",
            str(work / "runs" / "fsdp"),
            "--no-progress",
            "--distributed.strategy=single",
            "--batch.micro=4",
            "--batch.global_size=8",
        ]
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = _summary(work, "fsdp")
    assert summary["resumed_from"] == f"step_{STOP:08d}" and summary["world_size"] == 1
    assert (
        summary["resolved"]["global_batch"] == 8
        and summary["optimizations"]["micro_batch x accumulation"] == "4 x 2"
    )
    _assert_same(_losses(work, "fsdp"), reference)
    assert abs(summary["final_val_loss"] - val) <= 1e-5 * val


# the sharded checkpoint read in one process
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_expert_parallel_on_two_processes_equals_one_process_with_accumulation(work):
    """moe-tiny, cut down, with the auxiliary loss and the router-bias update on (the preset's
    default): the same micro-batches go through the same routers (per micro-batch load-balancing
    loss, averaged alike) and the bias moves once per optimizer step from the loads of the step's
    8 rows (both micro-batches in one process, both ranks' under expert parallelism), so every
    step's loss matches, and the final biases (in the last checkpoint) are the same and moved."""
    one = _train(work, "moe-one", 4, 2, 1, *MOE)
    ep = _train(
        work, "moe-ep", 4, 1, 2, *MOE, "--distributed.strategy=ddp", "--distributed.expert_parallel=2"
    )
    _assert_same(ep, one)
    assert one[STEPS] < one[1]
    one_bias, ep_bias = (_expert_bias(work, name) for name in ("moe-one", "moe-ep"))
    # a step: rows x T x top_k
    assert float(one_bias[:4].abs().max()) > 0 and int(one_bias[4:].sum()) == 8 * 32 * 2
    torch.testing.assert_close(ep_bias, one_bias, rtol=0, atol=1e-7)


def test_token_batching_keeps_the_batches_per_step_at_another_world_size(work):
    """``data.batching = 'tokens'``: step s trains on stream batches s x A x world ..., so two
    processes (accumulation 1) stopped at step 4 and resumed in one with accumulation 2 give the
    losses of one process with accumulation 2 throughout; resumed in one process with
    accumulation 1 (half the batches per step) it is refused in one line."""
    folder = work / "docs"
    folder.mkdir()
    for i in range(40):  # documents of different lengths
        (folder / f"m{i:02d}.py").write_text(
            "".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(1 + (i * 37) % 60))
        )
    tokens = [
        "--data.batching=tokens",
        "--batch.max_tokens=96",
        "--train.max_steps=8",
        "--train.checkpoint_every=4",
    ]

    def run(name: str, nproc: int, accumulation: int, *more: str) -> dict[int, float]:
        args = [
            "--data",
            str(folder),
            f"--run.out_dir={work / 'runs'}",
            f"--run.name={name}",
            f"--data.cache_dir={work / 'cache'}",
            *TINY,
            *tokens,
            f"--batch.accumulation={accumulation}",
            *more,
        ]
        proc = _forked(_torchrun(nproc) + args, work / name) if nproc > 1 else inprocess.train(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _losses(work, name)

    reference = run("tokens-one", 1, 2)
    _assert_same(run("tokens-two", 2, 1, "--train.stop_after_steps=4"), reference, 4)
    plain = ["--resume", str(work / "runs" / "tokens-two"), "--no-progress", "--distributed.strategy=single"]
    metrics = (work / "runs" / "tokens-two" / "metrics.jsonl").read_bytes()
    refused = inprocess.train(plain)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[
        -1
        # after the RNG re-seed warning
    ] == (
        "turbotrain train: error: data.batching = 'tokens' resumes exactly only with the same token-budget batches per "
        "optimizer step (processes x accumulation): the checkpoint's run took 2 (2 processes x accumulation 1) and this "
        "run takes 1 (1 process x accumulation 1); resume with --batch.accumulation=2"
    ), refused.stderr[-3000:]
    assert (work / "runs" / "tokens-two" / "metrics.jsonl").read_bytes() == metrics  # nothing trained
    resumed = inprocess.train(plain + ["--batch.accumulation=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same(_losses(work, "tokens-two"), reference, 8)


def _expert_bias(work: Path, name: str) -> torch.Tensor:
    """Run ``name``'s last checkpoint's router bias and its pending loads (the extra state: the
    last step's loads over all ranks), as one row (one process: a ``.pt``; two: a sharded folder,
    read without a process group)."""
    last = max(
        (p for p in (work / "runs" / name / "checkpoints").glob("step_*") if p.suffix in ("", ".pt")),
        key=lambda p: p.stem,
    )
    keys = ["blocks.0.mlp.expert_bias", "blocks.0.mlp._extra_state"]
    if last.is_file():
        model = torch.load(last, map_location="cpu", weights_only=False)["model"]
        return torch.cat([model[k].double() for k in keys])
    state = {"model/" + keys[0]: torch.zeros(4), "model/" + keys[1]: torch.zeros(4, dtype=torch.long)}
    dcp.load(state, checkpoint_id=str(last), no_dist=True)
    return torch.cat([state["model/" + k].double() for k in keys])
