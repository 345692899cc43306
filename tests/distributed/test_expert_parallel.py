"""Expert parallelism on 2 gloo processes (torchrun): experts sharded over the ranks, tokens
exchanged with all-to-all, equals one process on the same global batch: the forward output and
every gradient (fp32) within 1e-5, and the loss and gradient norm of each of 30 clipped optimizer
steps (the norm spans every rank's experts, so every rank clips by the one-process factor);
checkpoints hold every expert whole, so they resume at another degree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import inprocess
import pytest
import torch
from test_finder_restores import assert_left_as_before
from test_torchrun_train import _forked

WORKER = Path(__file__).with_name("ep_worker.py")
N_EXPERTS = 4


def _single(tmp_path: Path) -> dict:
    """ep_worker.py's one-process reference, in this process."""
    inprocess.worker(WORKER, "single", "1", str(tmp_path / "single-1"))
    return json.loads(Path(f"{tmp_path / 'single-1'}.rank0.json").read_text())


def test_two_ranks_with_sharded_experts_train_like_one_process(tmp_path: Path, launched: Path):
    single = _single(tmp_path)
    ranks = [json.loads(Path(f"{launched / 'ep-2'}.rank{r}.json").read_text()) for r in range(2)]
    assert [r["first_expert"] for r in ranks] == [0, 2]
    # forward: each rank's logits are the reference's rows for its part of the batch
    ref_logits = torch.tensor(single["logits"])
    torch.testing.assert_close(
        torch.cat([torch.tensor(r["logits"]) for r in ranks]), ref_logits, rtol=0, atol=1e-5
    )
    # every gradient: expert weights from the rank holding each slice, the rest from every rank
    experts = [n for n in single["grads"] if n.endswith((".w1", ".w2"))]
    assert len(experts) == 4 and set(ranks[0]["grads"]) == set(single["grads"])
    for name, ref in single["grads"].items():
        ref = torch.tensor(ref)
        if name in experts:
            got = torch.cat([torch.tensor(r["grads"][name]) for r in ranks])
            assert got.shape == ref.shape and torch.tensor(ranks[0]["grads"][name]).shape[0] == 2
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=name)
        else:
            for r in ranks:
                torch.testing.assert_close(torch.tensor(r["grads"][name]), ref, rtol=0, atol=1e-5, msg=name)
    # 30 optimizer steps, the same loss (the mean over ranks, as every rank reports it) and the same
    # global gradient norm, which clipping divided by: it spans the experts of both ranks
    assert min(single["norms"]) > single["clip"]  # every step was clipped
    for r in ranks:
        assert len(r["losses"]) == len(single["losses"]) == len(r["norms"]) == 30
        worst = max(abs(a - b) for a, b in zip(r["losses"], single["losses"]))
        assert worst <= 1e-5, f"losses differ from one process by {worst}"
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(single["norms"]), rtol=1e-5, atol=1e-6
        )
    assert single["losses"][-1] < single["losses"][0] - 0.5  # it learns
    # checkpoints hold every expert whole (gathered from the shards), weights and optimizer state,
    # equal to the one-process run's; loading them back keeps each rank's slice
    for key in ("w1", "exp_avg"):
        ref = torch.tensor(single["saved"][key])
        for r in ranks:
            got = torch.tensor(r["saved"][key])
            assert got.shape == ref.shape == (N_EXPERTS, 32, 128), key
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4, msg=key)
    assert all(r["saved"]["reloaded_equal"] and r["saved"]["reloaded_shape"] == [2, 32, 128] for r in ranks)
    # saving left the live state alone
    assert all(r["saved"]["live_exp_avg_shape"] == [2, 32, 128] for r in ranks)


CKPT_WORKER = Path(__file__).with_name("ep_ckpt_worker.py")


def _ckpt(tmp_path: Path, nproc: int, *jobs: tuple[str, int, Path, str]) -> None:
    """Jobs (action, degree, folder, tag) one after the other in one torchrun launch of ``nproc``
    ranks (in a fork of this process, the ranks forked; or, for 1, in this process)."""
    args = [str(x) for action, degree, folder, tag in jobs for x in (action, degree, folder, tmp_path / tag)]
    if nproc == 1:
        inprocess.worker(CKPT_WORKER, *args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    proc = _forked([*cmd, str(CKPT_WORKER), *args], tmp_path / f"torchrun-{nproc}")
    assert proc.returncode == 0, proc.stderr[-4000:]


def _results(tmp_path: Path, nproc: int, *tags: str) -> list[list[dict]]:
    """Each job's (by tag) ranks' results."""
    return [
        [torch.load(f"{tmp_path / tag}.rank{r}.pt", weights_only=True) for r in range(nproc)] for tag in tags
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """Every 2-rank job of this file in one torchrun launch (four before: ep_worker.py's run,
    finder_ep_worker.py's, the sharded save, then the loads), each job building its engine, model
    and optimizer anew: the expert-parallel training run, the batch finder's search; then the save at degree 2 (folder ep2) and its loads at degree 2
    and 1, and the load of the one-process checkpoint (folder one), saved here in this process
    before the launch. The folder holds each job's results by tag."""
    tmp = tmp_path_factory.mktemp("ep")
    sharded, single = tmp / "ep2", tmp / "one"
    _ckpt(tmp, 1, ("save", 1, single, "save1"))
    _ckpt(
        tmp,
        2,
        ("ep", 2, tmp, "ep-2"),
        ("finder", 2, tmp, "finder-2"),
        ("save", 2, sharded, "save2"),
        ("load", 2, sharded, "load2x2"),
        ("load", 1, sharded, "load1x2"),
        ("load", 2, single, "load-one-into-2"),
    )
    return tmp


def _full(ranks: list[dict], name: str, key: str | None = None) -> torch.Tensor:
    """A parameter (key None) or its optimizer state ``key``, whole: expert tensors concatenated
    from the ranks' slices, other tensors as rank 0 holds them (after checking every rank agrees)."""

    def get(r: dict) -> torch.Tensor:
        return r["weights"][name] if key is None else r["optim"][name][key]

    if name.endswith((".w1", ".w2")) and ranks[0]["n_local"] < N_EXPERTS and get(ranks[0]).dim() > 0:
        return torch.cat([get(r) for r in sorted(ranks, key=lambda r: r["first_expert"])])
    for r in ranks[1:]:
        assert torch.equal(get(r), get(ranks[0])), (name, key)
    return get(ranks[0])


def _assert_same_state(saved: list[dict], loaded: list[dict]) -> None:
    """The loaded run holds exactly the saved weights and AdamW state (exp_avg, exp_avg_sq, step)
    of every parameter, each rank its slice of the experts, and the router-bias loads pending."""
    names = sorted(saved[0]["weights"])
    assert sorted(loaded[0]["weights"]) == names and sorted(loaded[0]["optim"]) == names
    for name in names:
        assert torch.equal(_full(loaded, name), _full(saved, name)), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got, want = _full(loaded, name, key), _full(saved, name, key)
            assert got.shape == want.shape and torch.equal(got, want), (name, key, got.shape, want.shape)
    for r in loaded:
        for name in names:  # each rank's live state has the shape of its parameter: Adam can step
            assert r["optim"][name]["exp_avg"].shape == r["weights"][name].shape, name
    for layer in saved[0]["pending"]:

        def total(ranks):
            return sum(r["pending"][layer] for r in ranks if r["pending"][layer] is not None)

        assert torch.equal(total(loaded), total(saved)) and int(total(saved).sum()) > 0, layer


def test_expert_parallel_checkpoint_resumes_optimizer_state_at_any_degree(launched: Path):
    """Optimizer state follows the experts: saved whole from 2 ranks holding 2 experts each, it
    loads into 2 ranks (same degree), into 2 ranks without expert parallelism and into one process;
    a one-process checkpoint loads into 2 expert-parallel ranks. The state is compared, not only the
    model, and the step after the load gives the loss the saving run's next step gave. (Each load
    builds its engine, model and optimizer anew, from another seed.)"""
    sharded = launched / "ep2"
    _ckpt(launched, 1, ("load", 1, sharded, "load1x1"))  # after the launch's save: in this process
    [saved1, loaded1x1] = _results(launched, 1, "save1", "load1x1")
    saved2, loaded2x2, loaded1x2, loaded = _results(
        launched, 2, "save2", "load2x2", "load1x2", "load-one-into-2"
    )
    assert [r["first_expert"] for r in saved2] == [0, 2]
    for (degree, nproc), loaded_sharded in zip(((2, 2), (1, 2), (1, 1)), (loaded2x2, loaded1x2, loaded1x1)):
        _assert_same_state(saved2, loaded_sharded)
        tolerance = 0 if (degree, nproc) == (2, 2) else 1e-4  # the load-balancing loss is per rank's rows
        assert abs(loaded_sharded[0]["next_loss"] - saved2[0]["next_loss"]) <= tolerance, (degree, nproc)
    _assert_same_state(saved1, loaded)
    assert abs(loaded[0]["next_loss"] - saved1[0]["next_loss"]) <= 1e-4


def test_the_search_leaves_experts_as_they_were_on_2_expert_parallel_ranks(launched: Path):
    """test_finder_restores.py's check on 2 ranks with the experts sharded (its ep-2 case before)."""
    assert_left_as_before(launched / "finder-2", "ep", 2)
