"""The batch finder's trials train (forward, backward, optimizer step at each size); afterwards the
model must be as before the search. Under expert parallelism the state dict holds gathered copies
of the experts, so copying into it restored nothing: the expert weights kept the trials' updates,
and the router-bias loads the trials counted stayed pending for the first training forward (in
one process too). One process here; 2 gloo ranks with the experts sharded (finder_ep_worker.py):
test_expert_parallel.py's test_the_search_leaves_experts_as_they_were_on_2_expert_parallel_ranks,
a job of that file's one launch, with these checks."""

from __future__ import annotations

import json
from pathlib import Path

import inprocess

WORKER = Path(__file__).with_name("finder_ep_worker.py")


def assert_left_as_before(out: Path, mode: str, nproc: int) -> None:
    """Each rank's results (``OUT.rank<R>.json``): nothing changed, nothing pending or tallied, no
    optimizer state, and its slice of the 4 experts."""
    for rank in range(nproc):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        # each rank still holds its slice of the 4 experts
        assert r["w1_shape"][0] == (2 if mode == "ep" else 4)
        assert r["changed"] == [] and r["pending"] == [] and r["tallied"] == [] and r["optimizer_state"] == 0


def test_the_search_leaves_experts_router_bias_and_loads_as_they_were(tmp_path):
    inprocess.worker(WORKER, "single", str(tmp_path / "single"))  # in this process
    assert_left_as_before(tmp_path / "single", "single", 1)
