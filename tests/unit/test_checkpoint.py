import contextlib
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from turbotrain.atomic import DiskFullError, atomic_write, clean_stale_temps
from turbotrain.checkpoint import (
    Checkpointer,
    RunState,
    is_verified,
    list_checkpoints,
    load_latest,
    restore_latest,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from turbotrain.errors import TurbotrainError


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
    with pytest.raises(TurbotrainError, match="cannot be read"):
        load_latest(tmp_path)


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


@contextlib.contextmanager
def _file_size_limit(n_bytes: int):
    """``ulimit -f``: writes past ``n_bytes`` fail with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_is_one_error_naming_the_file_and_leaves_no_temp_file(tmp_path: Path):
    """Defect 5: torch.save reported a full disk as `RuntimeError: ... unexpected pos` and the
    atomic writer left its temp file."""
    first = save_checkpoint(tmp_path, 1, _payload(1))
    target = tmp_path / "big.bin"
    target.write_bytes(b"old")
    with _file_size_limit(4096):
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
