"""bench --to-loss: a run stops at the target loss and says where; the verdict weighs the
difference of the medians against the seed spread; bad contenders are one line."""

from __future__ import annotations

import pytest

from turbotrain.app.bench.to_loss import ToLossOptions, parse_contender, run_one, verdicts
from turbotrain.cli import main

TINY = {
    "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32},
    "batch": {"micro": 8},
    "train": {"eval_batches": 2},
    "run": {"device": "cpu"},
}


def _row(name, times, tokens, seeds=None):
    stats = lambda v: {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v), "n": len(v)}  # noqa: E731
    return {
        "contender": name,
        "seeds": seeds or len(times),
        "reached": len(times),
        "time_s": stats(times),
        "tokens": stats(tokens),
    }


def test_a_difference_counts_only_beyond_the_seed_spread():
    fast = _row("a", [10.0, 11.0, 12.0], [100, 110, 120])
    slow = _row("b", [20.0, 21.0, 25.0], [105, 115, 118])
    time_line, tokens_line = verdicts([fast, slow])
    assert "a real difference" in time_line and "1.91x" in time_line
    assert "within the seed spread" in tokens_line  # overlapping ranges: no difference shown
    missed = _row("c", [20.0, 21.0], [100, 120], seeds=3)
    assert "not comparable, c did not reach it" in verdicts([fast, missed])[0]
    one = _row("d", [20.0], [200])
    assert "one seed" in verdicts([_row("e", [10.0], [100]), one])[0]


def test_contenders_are_parsed_and_bad_ones_are_one_line(capsys):
    assert parse_contender("lr:optim.lr=2e-3,batch.micro=4") == (
        "lr",
        {"optim": {"lr": "2e-3"}, "batch": {"micro": "4"}},
    )
    with pytest.raises(ValueError, match="is not section.key=value"):
        parse_contender("x:lr=2")
    assert main(["bench", "--to-loss", "2.5", "--versus", "only:optim.lr=1e-3"]) == 2
    assert "two or more --versus" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_stops_at_the_target_and_records_where(tmp_path, text_file):
    data = {"data": {"path": str(text_file), "cache_dir": str(tmp_path / "cache"), "num_workers": 0}}
    opts = ToLossOptions(
        contenders={"lr": {"optim": {"lr": 3e-3}}},
        overrides={**TINY, **data, "run": {"device": "cpu", "out_dir": str(tmp_path)}},
        target_loss=5.0,  # bytes start at ln(256) = 5.5
        max_steps=40,
        eval_every=5,
    )
    run = run_one(opts, "lr", 0, tmp_path / "run")
    reached = run["reached"]
    assert reached is not None and reached["val_loss"] <= 5.0 and reached["step"] % 5 == 0
    assert run["curve"][-1] == reached and all(p["val_loss"] > 5.0 for p in run["curve"][:-1])
    assert reached["tokens"] == reached["step"] * 8 * 32 and reached["train_s"] > 0
