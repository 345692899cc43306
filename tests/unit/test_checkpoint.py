import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults.limits import file_size_limit

from turbotrain.app.training import train
from turbotrain.base.atomic import DiskFullError, atomic_write, clean_stale_temps
from turbotrain.base.config import load_config, to_toml
from turbotrain.base.errors import TurbotrainError
from turbotrain.cli import main
from turbotrain.core.distributed import Strategy
from turbotrain.loop.checkpoint import (
    Checkpointer,
    RunState,
    finished_checkpoints,
    is_verified,
    list_checkpoints,
    load_latest,
    load_latest_weights,
    model_settings_changed,
    restore_latest,
    rng_state,
    save_checkpoint,
    save_sharded,
    set_rng_state,
)
from turbotrain.loop.hooks import FitContext
from turbotrain.parts.models.registry import build_model


def _payload(v: float) -> dict:
    return {"model": {"w": torch.full((3,), v)}, "step": int(v), "rng": rng_state()}


def test_save_keeps_last_k_and_loads_the_newest(tmp_path: Path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _payload(step), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004.pt"]
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind
    path, payload = load_latest(tmp_path)
    assert path.name == "step_00000004.pt" and payload["model"]["w"][0] == 4


def test_corrupt_newest_falls_back_to_the_previous(tmp_path: Path, caplog):
    save_checkpoint(tmp_path, 1, _payload(1))
    newest = save_checkpoint(tmp_path, 2, _payload(2))
    newest.write_bytes(newest.read_bytes()[:100])  # truncated by a crash
    path, payload = load_latest(tmp_path)
    assert path.name == "step_00000001.pt"
    assert "checksum" in caplog.text


def test_all_corrupt_is_a_clear_error(tmp_path: Path):
    only = save_checkpoint(tmp_path, 1, _payload(1))
    only.write_bytes(b"garbage")
    with pytest.raises(TurbotrainError, match="no usable checkpoint"):
        load_latest(tmp_path)


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    save_checkpoint(tmp_path, 1, {"model": {}, "evil": Evil()})
    with pytest.raises(TurbotrainError, match="holds objects that are refused") as info:
        load_latest(tmp_path)
    # item 13: no advice to load it
    assert "was not loaded" in str(info.value) and "weights_only=False" not in str(info.value)


def test_rng_state_round_trips():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


# ----------------------------------------------------------------------------- issue 12: nothing lost


def test_pruning_never_deletes_the_last_usable_checkpoint(tmp_path: Path, caplog):
    """Defect 1: keep_last kept the newest files by name, so an unloadable newest one (its
    checksum file gone) pushed out every usable checkpoint. Only verified ones count now."""
    for step in (50, 100, 150):
        save_checkpoint(tmp_path, step, _payload(step))
    (tmp_path / "step_00000150.pt.sha256").unlink()
    path, _ = load_latest(tmp_path)
    assert path.name == "step_00000100.pt"  # the resume point
    save_checkpoint(tmp_path, 101, _payload(101), keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000101.pt", "step_00000150.pt"]
    path, payload = load_latest(tmp_path)
    assert path.name == "step_00000101.pt" and payload["model"]["w"][0] == 101
    assert not list(tmp_path.glob("step_00000050*")) and not list(tmp_path.glob("step_00000100*"))


def test_damaged_checksum_files_and_foreign_payloads_fall_back(tmp_path: Path, caplog):
    """Defect 4: a checksum file whose first byte is not UTF-8 gave a UnicodeDecodeError, a
    checkpoint without the run's entries a KeyError. Both are skipped for the previous one, and
    nothing is half-loaded."""
    model = torch.nn.Linear(2, 2)
    state = RunState(model=model, extra=(lambda: {"n": 1}, lambda sd: None))
    save_checkpoint(tmp_path, 1, state.state_dict())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    newest = save_checkpoint(tmp_path, 2, {"model": {k: v + 1 for k, v in expected.items()}, "extra": {}})
    newest.with_name(newest.name + ".sha256").write_bytes(b"\xff\xfe\x00 not a digest")
    save_checkpoint(tmp_path, 3, {"model": {}})  # verifies, but holds no 'extra'
    assert restore_latest(tmp_path, state).name == "step_00000001.pt"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert "does not match its checksum" in caplog.text and "holds no extra state" in caplog.text
    with pytest.raises(TurbotrainError, match="holds no extra state"):
        state.load_state_dict({"model": expected}, source="x.pt")


def test_a_malicious_pickle_never_runs_even_with_a_valid_checksum(tmp_path: Path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    save_checkpoint(tmp_path, 1, _payload(1))
    save_checkpoint(tmp_path, 2, {"model": {}, "evil": Evil()})  # its checksum matches: it was written so
    path, _ = load_latest(tmp_path)
    assert path.name == "step_00000001.pt" and not marker.exists()


def test_a_full_disk_is_one_error_naming_the_file_and_leaves_no_temp_file(tmp_path: Path):
    """Defect 5: torch.save reported a full disk as `RuntimeError: ... unexpected pos` and the
    atomic writer left its temp file."""
    first = save_checkpoint(tmp_path, 1, _payload(1))
    target = tmp_path / "big.bin"
    target.write_bytes(b"old")
    with file_size_limit(4096):
        with pytest.raises(DiskFullError, match="big.bin: File too large"):
            atomic_write(target, b"x" * 100_000)
        with pytest.raises(DiskFullError, match="step_00000002.pt: File too large"):
            save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(10_000)}})
    assert target.read_bytes() == b"old"
    assert not list(tmp_path.glob(".*tmp*"))
    assert [p.name for p in list_checkpoints(tmp_path)] == [first.name] and is_verified(first)


def test_temp_files_of_killed_writes_are_removed_at_the_start(tmp_path: Path, caplog):
    """Defect 6: temp files of a checkpoint write killed mid-way stayed forever. The
    Checkpointer removes those whose process has ended; a live writer's stay."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".step_00000003.pt.tmp{dead.pid}"
    stale.write_bytes(b"\0" * 10_000)
    live = tmp_path / f".step_00000004.pt.tmp{os.getppid()}"
    live.write_bytes(b"")
    Checkpointer(tmp_path, 1, 1, RunState()).on_fit_start(None)  # type: ignore[arg-type]
    assert not stale.exists() and live.exists()
    assert clean_stale_temps(tmp_path) == []


# ------------------------------------------------------------------ sharded (DCP) folders in one process


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, _Counter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    counter = _Counter()
    counter.n = seed
    return model, optimizer, counter


def _state(model, optimizer, counter) -> RunState:
    return RunState(counter=counter, model=model, optimizer=optimizer, rng=(rng_state, set_rng_state))


def test_a_sharded_folder_restores_model_optimizer_and_state_in_one_process(tmp_path: Path):
    saved = _trained(1)
    path = save_sharded(tmp_path, 5, _state(*saved))
    assert path.name == "step_00000005" and path.is_dir() and is_verified(path)
    assert {"finished.json", ".metadata", "state.pt", "rank0.pt"} <= {p.name for p in path.iterdir()}
    fresh = _trained(2)
    assert restore_latest(tmp_path, _state(*fresh)) == path
    assert fresh[2].n == 1
    for a, b in zip(saved[0].state_dict().values(), fresh[0].state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(saved[1].state_dict()["state"].values(), fresh[1].state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    _, weights = load_latest_weights(tmp_path)  # what `turbotrain sample` reads: plain names, full tensors
    assert weights.keys() == saved[0].state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in saved[0].state_dict().items())


def test_the_checkpointer_writes_the_format_of_the_strategy(tmp_path: Path):
    class Sharded(Strategy):
        name = "fsdp"

    model, optimizer, counter = _trained(1)
    ctx = FitContext(_Engine(step=3), model, optimizer, 10)  # type: ignore[arg-type]
    Checkpointer(tmp_path, 1, 5, _state(model, optimizer, counter)).save(ctx)
    ctx.engine.state.step = 4
    Checkpointer(tmp_path, 1, 5, _state(model, optimizer, counter), strategy=Sharded()).save(ctx)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004"]


class _Engine:
    def __init__(self, step: int) -> None:
        self.state = type("S", (), {"step": step})()


def test_unfinished_sharded_saves_are_never_loaded_and_are_removed_at_the_start(tmp_path: Path, caplog):
    first = save_sharded(tmp_path, 1, _state(*_trained(1)))
    killed = save_sharded(tmp_path, 2, _state(*_trained(2)))
    (killed / "finished.json").unlink()  # as if killed before the marker
    partial = tmp_path / ".step_00000003.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert finished_checkpoints(tmp_path) == [first]
    fresh = _trained(5)
    assert restore_latest(tmp_path, _state(*fresh)) == first and fresh[2].n == 1
    assert "step_00000002 has no finished marker" in caplog.text
    Checkpointer(tmp_path, 1, 1, RunState()).on_fit_start(None)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_keep_last_counts_verified_checkpoints_of_both_kinds(tmp_path: Path, caplog):
    save_checkpoint(tmp_path, 1, _payload(1), keep_last=2)
    save_sharded(tmp_path, 2, _state(*_trained(2)), keep_last=2)
    save_checkpoint(tmp_path, 3, _payload(3), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003.pt"]
    four = save_sharded(tmp_path, 4, _state(*_trained(4)), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004"]
    shard = four / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")  # corrupt, same size
    save_sharded(tmp_path, 5, _state(*_trained(5)), keep_last=2)  # 4 does not count: 3 stays
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_00000003.pt",
        "step_00000004",
        "step_00000005",
    ]
    save_sharded(tmp_path, 6, _state(*_trained(6)), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]
    shutil.rmtree(tmp_path / "step_00000006")
    (tmp_path / "step_00000005" / "state.pt").write_bytes(b"x")
    with pytest.raises(TurbotrainError, match="no usable checkpoint.*step_00000005/state.pt has 1 bytes"):
        load_latest_weights(tmp_path)
    with pytest.raises(TurbotrainError, match="no usable checkpoint.*step_00000005/state.pt has 1 bytes"):
        restore_latest(tmp_path, _state(*_trained(7)))


def test_a_sharded_folder_never_unpickles_arbitrary_objects(tmp_path: Path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    folder = tmp_path / "ck"
    path = save_sharded(folder, 1, _state(*_trained(1)))
    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    done = json.loads((path / "finished.json").read_text())
    done["files"][".metadata"] = {
        "size": (path / ".metadata").stat().st_size,
        "sha256": hashlib.sha256((path / ".metadata").read_bytes()).hexdigest(),
    }
    (path / "finished.json").write_text(json.dumps(done))  # its checksums match: it was written so
    assert is_verified(path)
    with pytest.raises(TurbotrainError, match="not part of a checkpoint's metadata"):
        load_latest_weights(folder)
    with pytest.raises(TurbotrainError, match="not part of a checkpoint's metadata"):
        restore_latest(folder, _state(*_trained(2)))
    assert not marker.exists()


def _other_shape(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, _Counter]:
    """Like :func:`_trained`, with a hidden layer of 16: a model of another shape."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), _Counter()


def test_a_newest_checkpoint_of_another_shape_or_unsafe_metadata_falls_back_to_an_older_one(
    tmp_path: Path, caplog
):
    """Issue 23 item 10: the choice verifies everything a load needs before it chooses: a newest
    checkpoint of another model (either kind), or a sharded one whose .metadata the safe reader
    refuses, is skipped with one line saying why, and the older one that fits loads."""
    save_checkpoint(tmp_path, 1, _state(*_trained(1)).state_dict(), keep_last=9)
    save_checkpoint(tmp_path, 2, _state(*_other_shape(2)).state_dict(), keep_last=9)
    save_sharded(tmp_path, 3, _state(*_other_shape(3)), keep_last=9)
    unsafe = save_sharded(tmp_path, 4, _state(*_trained(4)), keep_last=9)
    (unsafe / ".metadata").write_bytes(pickle.dumps(print))
    done = json.loads((unsafe / "finished.json").read_text())
    done["files"][".metadata"] = {
        "size": (unsafe / ".metadata").stat().st_size,
        "sha256": hashlib.sha256((unsafe / ".metadata").read_bytes()).hexdigest(),
    }
    (unsafe / "finished.json").write_text(json.dumps(done))
    fresh = _trained(9)
    assert restore_latest(tmp_path, _state(*fresh)).name == "step_00000001.pt" and fresh[2].n == 1
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 3 and all(len(line.splitlines()) == 1 for line in skipped), skipped
    assert "step_00000004/.metadata" in skipped[0] and "not part of a checkpoint's metadata" in skipped[0]
    for line, name in zip(skipped[1:], ("step_00000003", "step_00000002.pt")):
        assert (
            f"{name} does not fit the model this config builds" in line and "0.weight: saved [16, 4]" in line
        ), line
        assert "override" not in line


def test_when_every_checkpoint_is_another_model_the_advice_names_the_saved_settings(tmp_path: Path):
    save_checkpoint(tmp_path, 1, _state(*_other_shape(1)).state_dict())
    with pytest.raises(TurbotrainError) as info:
        restore_latest(tmp_path, _state(*_trained(2)))
    text = str(info.value)
    assert (
        "another shape" in text
        and "config.toml" in text
        and "override" not in text
        and "move them away" not in text
    )


@pytest.mark.slow
def test_sample_reads_a_sharded_checkpoint_as_it_reads_a_pt_one(tmp_path: Path, tiny_config, capsys):
    train(tiny_config, progress=False)
    run = Path(tiny_config.run.out_dir) / tiny_config.run.name
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "20", "--seed", "3"]) == 0
    from_pt = capsys.readouterr().out
    path, weights = load_latest_weights(run / "checkpoints")
    model = build_model(tiny_config, weights["wte.weight"].shape[0])
    model.load_state_dict(weights)
    # what a ddp/fsdp run leaves (one process here)
    save_sharded(run / "checkpoints", 7, RunState(model=model))
    for p in (run / "checkpoints").glob("*.pt*"):
        p.unlink()
    assert main(["sample", str(run), "--tokens", "20", "--seed", "3"]) == 0
    assert capsys.readouterr().out == from_pt and len(from_pt) > 20


def test_a_full_disk_during_a_sharded_save_is_one_error_and_keeps_the_previous_one(tmp_path: Path):
    first = save_sharded(tmp_path, 1, _state(*_trained(1)))
    big = torch.nn.Linear(200, 200)
    with file_size_limit(16384):
        with pytest.raises(DiskFullError, match="cannot write .*step_00000002: .*ulimit -f"):
            save_sharded(tmp_path, 2, RunState(model=big, optimizer=torch.optim.AdamW(big.parameters())))
    assert [p.name for p in tmp_path.iterdir()] == [first.name] and is_verified(first)


def test_a_background_checkpoint_is_the_state_of_its_step_and_the_end_waits_for_it(
    tmp_path: Path, monkeypatch
):
    """train.async_checkpoint: the step returns while its checkpoint is still being written; the
    copy it writes is the state at that step although training changes the weights right after;
    the final checkpoint waits for the write in flight (as a SIGTERM's does: it ends the fit)."""
    import threading

    import turbotrain.loop.checkpoint as checkpoint

    release, original = threading.Event(), checkpoint.save_checkpoint

    def held(*args, **kwargs):
        assert release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", held)
    model, optimizer, counter = _trained(1)
    at_step_3 = {k: v.clone() for k, v in model.state_dict().items()}
    hook = Checkpointer(tmp_path, 3, 5, _state(model, optimizer, counter), async_write=True)
    ctx = FitContext(_Engine(step=3), model, optimizer, 10)  # type: ignore[arg-type]
    hook.on_step_end(ctx)
    assert hook.background is not None and hook.background.in_flight and list_checkpoints(tmp_path) == []
    with torch.no_grad():  # the next steps change the weights in place
        for p in model.parameters():
            p.add_(1.0)
    ctx.engine.state.step = 4
    release.set()
    hook.on_fit_end(ctx)
    assert [p.name for p in finished_checkpoints(tmp_path)] == ["step_00000003.pt", "step_00000004.pt"]
    assert all(is_verified(p) for p in list_checkpoints(tmp_path)) and not hook.background.in_flight
    saved = torch.load(tmp_path / "step_00000003.pt", weights_only=True)["model"]
    assert all(torch.equal(saved[k], v) for k, v in at_step_3.items())
    assert ctx.metrics["checkpoint"] == str(tmp_path / "step_00000004.pt")


def test_a_background_write_that_fails_stops_the_next_step_in_one_line(tmp_path: Path):
    """A checkpoint written in the background that runs out of space raises the same one-line
    DiskFullError at the next step; the previous checkpoint stays the newest verified one."""
    model, optimizer, counter = _trained(1)
    hook = Checkpointer(tmp_path, 1, 5, _state(model, optimizer, counter), async_write=True)
    ctx = FitContext(_Engine(step=1), model, optimizer, 10)  # type: ignore[arg-type]
    hook.save(ctx)  # a checkpoint now: written when save returns
    assert [p.name for p in finished_checkpoints(tmp_path)] == ["step_00000001.pt"]
    ctx.engine.state.step = 2
    with file_size_limit(4096):  # smaller than a checkpoint of this model
        hook.on_step_end(ctx)
        assert hook.background is not None
        while hook.background.in_flight:
            time.sleep(0.005)
    ctx.engine.state.step = 3
    with pytest.raises(DiskFullError, match="step_00000002.pt: File too large"):
        hook.on_step_end(ctx)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
    assert not list(tmp_path.glob(".*tmp*"))


def test_the_host_copy_keeps_tied_weights_shared_and_the_file_the_same():
    """The staged copy of a model with tied weights (a GPT's embedding and head) writes the file
    the live state writes: one copy of the tied tensor, the state dict's versions kept."""
    import io

    from turbotrain.loop.checkpoint import stage_to_host

    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False))
    model[1].weight = model[0].weight
    buffers: dict = {}
    payload = {"model": model.state_dict(), "step": 3, "betas": (0.9, 0.95)}
    staged = stage_to_host(payload, buffers)
    live, copy = io.BytesIO(), io.BytesIO()
    torch.save(payload, live)
    torch.save(staged, copy)
    copy.seek(0)
    loaded = torch.load(copy, weights_only=True)["model"]
    # stored once, as the live state stores it
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()
    # not a second copy of the tied tensor
    assert abs(len(copy.getvalue()) - len(live.getvalue())) < 64 * 16 * 4
    assert (
        staged["model"]["0.weight"].data_ptr()
        == staged["model"]["1.weight"].data_ptr()
        != model[0].weight.data_ptr()
    )
    assert staged["model"]._metadata == payload["model"]._metadata and staged["betas"] == (0.9, 0.95)
    again = stage_to_host(payload, buffers)  # the next checkpoint reuses the buffers
    assert again["model"]["0.weight"].data_ptr() == staged["model"]["0.weight"].data_ptr()


def test_the_settings_that_rebuild_a_saved_model_span_its_family_sections_and_old_configs():
    """A checkpoint of another shape is answered with the flags that rebuild the saved model: from
    [model] and the family's own [moe], also for a config written when the experts sat in [model]."""
    current = to_toml(load_config("moe-tiny"))
    saved_now = to_toml(load_config("moe-tiny", ["--moe.n_experts=4", "--model.d_model=64"]))
    assert model_settings_changed(saved_now, current) == "--model.d_model=64 --moe.n_experts=4"
    saved_before_the_move = 'preset = "moe-tiny"\n[model]\narch = "moe"\nd_model = 128\nn_experts = 4\n'
    assert model_settings_changed(saved_before_the_move, current) == "--moe.n_experts=4"
