"""Compile warm start: artefacts saved after a compiled run and loaded before the next start of
the same model; a stale or foreign blob, a damaged one, or a torch without the API is one line
and a cold start, never an error. torch.compiler's functions are replaced by stand-ins (a real
compile costs tens of seconds here; benchmarks/results/cpu/compile-warm-start.md measures one)."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch

from turbotrain import load_config
from turbotrain.app.warmstart import WarmStart
from turbotrain.core.compile_guard import CompileGuard, payback_step


def _config(tmp_path, **sections):
    base = {
        "run": {"device": "cpu"},
        "data": {"cache_dir": str(tmp_path / "cache")},
        "compile": {"scope": "model"},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return load_config("gpt-tiny", base)


@pytest.fixture
def compiler(monkeypatch):
    """Stand-ins for torch.compiler.save/load_cache_artifacts: what was saved, what was loaded."""
    seen = {"loaded": []}

    def save():
        return (b"ARTEFACTS", types.SimpleNamespace(artifacts={"inductor": ["a", "b"]}))

    def load(data):
        if not data.startswith(b"ARTEFACTS"):
            raise RuntimeError("bad magic\nmore detail")
        seen["loaded"].append(data)
        return types.SimpleNamespace(artifacts={"inductor": ["a", "b"], "autotune": ["c"]})

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save, raising=False)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load, raising=False)
    return seen


def test_a_second_start_of_the_same_model_loads_the_first_ones_artefacts(tmp_path, compiler):
    first = WarmStart(_config(tmp_path))
    assert first.begin().startswith("cold: no saved compile artefacts")
    assert first.save() == str(first.blob) and first.blob.read_bytes() == b"ARTEFACTS"
    second = WarmStart(_config(tmp_path, train={"max_steps": 50}))  # run length is not part of the key
    assert second.begin() == f"warm: loaded 3 compile artefacts from {first.blob}"
    assert compiler["loaded"] == [b"ARTEFACTS"]
    assert CompileGuard().summary()["warm_start"] == second.note  # into the run's summary
    other = WarmStart(_config(tmp_path, model={"n_layer": 2}))  # another model: its own key, cold
    assert other.begin().startswith("cold: no saved") and compiler["loaded"] == [b"ARTEFACTS"]


def test_a_stale_foreign_or_damaged_blob_is_ignored_in_one_line(tmp_path, compiler, caplog):
    caplog.set_level(logging.WARNING)
    w = WarmStart(_config(tmp_path))
    w.save()
    w.described.write_text(w.described.read_text().replace(torch.__version__, "1.0"))  # another torch
    assert "made for another model, device or version" in WarmStart(_config(tmp_path)).begin()
    w.save()
    w.blob.write_bytes(b"garbage")
    note = WarmStart(_config(tmp_path)).begin()
    assert note.startswith("cold: ignoring") and "RuntimeError: bad magic" in note and "\n" not in note
    assert compiler["loaded"] == [] and all("\n" not in r.message for r in caplog.records)


def test_without_the_api_the_start_is_cold(tmp_path, monkeypatch):
    monkeypatch.delattr(torch.compiler, "load_cache_artifacts", raising=False)
    monkeypatch.delattr(torch.compiler, "save_cache_artifacts", raising=False)
    w = WarmStart(_config(tmp_path))
    assert "has no torch.compiler.load_cache_artifacts" in w.begin() and w.save() == ""


def test_a_run_that_does_not_compile_does_nothing(tmp_path, compiler):
    w = WarmStart(_config(tmp_path, compile={"scope": "auto"}))  # auto on CPU: off
    assert w.begin() == "" and w.save() == "" and not w.folder.exists()


def test_payback_step():
    assert payback_step(30.0, 10.0, 9.0) == 30_001  # 30 s back at 1 ms a step
    assert payback_step(30.0, 10.0, 11.0) is None and payback_step(None, 10.0, 9.0) is None


def test_a_damaged_blob_torch_reads_nothing_from_is_one_warning_and_a_refusal(tmp_path, caplog, capfd):
    """Issue 44 item 7, with torch's real loader: it logs its own traceback and loads nothing;
    that is one warning "cold: ignoring ...", torch's traceback not shown, never "warm: loaded 0"."""
    w = WarmStart(_config(tmp_path))
    w.folder.mkdir(parents=True)
    w.described.write_text(json.dumps({"material": w.material}, default=str))
    w.blob.write_bytes(b"garbage, not torch's artefacts")
    caplog.set_level(logging.INFO)
    note = WarmStart(_config(tmp_path)).begin()
    assert note.startswith(f"cold: ignoring {w.blob} (") and "\n" not in note
    assert "corrupted" in note  # torch's reason, in the one line
    shown = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in shown] == [f"compile warm start: {note}"]
    assert "Traceback" not in capfd.readouterr().err
    assert CompileGuard().summary()["warm_start"] == note
