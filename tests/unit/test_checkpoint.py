from pathlib import Path

import pytest
import torch

from turbotrain.checkpoint import list_checkpoints, load_latest, rng_state, save_checkpoint, set_rng_state
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
