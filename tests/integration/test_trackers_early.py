"""A tracker whose package is missing is one line before anything slow runs: the settings left at
auto are not measured first (found in review: the user waited through the measuring, then got the
line)."""

from __future__ import annotations

import sys

from turbotrain.cli import main


def test_a_missing_tracker_package_is_said_before_the_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trackio", None)  # import trackio raises ImportError
    code = main(
        [
            "train",
            "--preset=gpt-tiny",
            "--run.device=cpu",
            f"--run.out_dir={tmp_path / 'runs'}",
            f"--data.cache_dir={tmp_path / 'cache'}",
            "--monitor.trackio=true",
            "--choose.measure=always",
            "--train.max_steps=2",
        ]
    )
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 2
    assert "pip install 'turbotrain[trackio]'" in out and "choose: measuring" not in out
