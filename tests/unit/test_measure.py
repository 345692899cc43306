"""app/measure: a measured run leaves nothing open behind it."""

from __future__ import annotations

import gc
import warnings

import pytest

from turbotrain.app.measure import Target, measure_once


@pytest.mark.slow
def test_a_measured_run_closes_its_token_files_when_it_ends(tmp_path):
    target = Target("gpt-tiny", overrides={"run": {"device": "cpu"}, "data": {"num_workers": 0}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        out = measure_once(target, None, tmp_path / "run", warmup=1, steps=2)
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
    assert out["steps"] == 2 and out["final_loss"] > 0
