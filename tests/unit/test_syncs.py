"""The sync locator: every kind of host-device sync is named by the exact line that made it, once
per call, and only values on the run's device count."""

from __future__ import annotations

import inspect
import json
import textwrap

import torch

from turbotrain.app.profile.syncs import SyncLocator, classify_frame, is_sync
from turbotrain.cli import main
from turbotrain.core.meter import clock


def _step(x: torch.Tensor) -> None:
    y = (x * 2).sum()
    y.item()  # read
    (x > 0).nonzero()  # shape
    x[x > 0]  # mask
    x.tolist()  # tolist
    x.detach().cpu()  # cpu
    str(x)  # print
    if y > 0:  # if
        pass
    y.backward()


def test_each_kind_of_sync_is_named_by_its_line():
    x = torch.randn(8, requires_grad=True)
    with SyncLocator("cpu") as loc:
        _step(x)
    lines, first = inspect.getsourcelines(_step)
    line = {text.split("# ")[1].strip(): first + i for i, text in enumerate(lines) if "# " in text}
    kinds = {
        "read": "read to the host",
        "shape": "data-dependent shape",
        "mask": "data-dependent shape",
        "tolist": "copy to the host",
        "cpu": "copy to the host",
        "print": "print/format",
        "if": "read to the host",
    }
    found = {s["where"].rsplit(":", 1)[1]: s["what"] for s in loc.sources(1)}
    assert found == {f"{line[k]} (_step)": found.get(f"{line[k]} (_step)", "") for k in kinds}
    for key, what in kinds.items():
        assert what in found[f"{line[key]} (_step)"], key  # every kind, on its own line
    assert len(loc.sources(1)) == len(line)  # once each: .item() is not counted again as its aten read
    assert all(s["kind"] == "user" and s["sync"] and s["per_step"] == 1 for s in loc.sources(1))


def test_values_off_the_runs_device_are_not_syncs():
    """On a GPU run, reading a host tensor (torch.optim's step counter) waits for nothing."""
    x = torch.randn(4)
    with SyncLocator("cuda") as loc:
        x.sum().item()
        x.nonzero()
    assert loc.sources(1) == []


def test_doctor_names_the_line_of_a_models_sync(tmp_path, capsys):
    path = tmp_path / "wl.py"
    path.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn
            from turbotrain import Workload

            seen = []

            def loss(model, batch):
                out = model(batch).square().mean()
                seen.append(float(out.detach()))  # watch it
                return out

            def make():
                return Workload(model=nn.Linear(4, 4), train_loader=[torch.randn(2, 4)], loss_fn=loss)
            """
        )
    )
    assert main(["doctor", "--model", f"{path}:make", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    user = [s for s in report["syncs"]["sources"] if s["kind"] == "user"]
    assert [s["where"].rsplit("/", 1)[1] for s in user] == ["wl.py:10 (loss)"]
    assert user[0]["per_step"] == 1 and report["syncs"]["per_step"] == 1


def test_cudas_own_sync_report_is_taken_at_the_callers_line(monkeypatch):
    """On CUDA, torch.cuda.set_sync_debug_mode('warn') warns at each synchronising call; the
    warning is recorded at the line below the warnings machinery (a stand-in warning here: no
    GPU), and the debug mode is restored."""
    import warnings

    from turbotrain.app.profile import syncs

    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: modes.append(mode))
    loc = SyncLocator("cpu")

    def synchronising_call() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # the sync

    with syncs._cuda_sync_debug(loc):
        synchronising_call()
    (source,) = loc.sources(1)
    assert source["code"].endswith("# the sync") and source["kind"] == "user"
    assert source["where"].endswith("(synchronising_call)") and modes[-1] == 0


def _repeats(counts: torch.Tensor) -> None:
    torch.repeat_interleave(torch.arange(3), counts)  # without
    torch.repeat_interleave(torch.arange(3), counts, output_size=6)


def test_repeat_interleave_is_named_without_output_size_and_not_with_it():
    """Without ``output_size`` the output's length is read from the counts on the host (a sync);
    with it, none (what the MoE layers pass)."""
    with SyncLocator("cpu") as loc:
        _repeats(torch.tensor([1, 2, 3]))
    lines, first = inspect.getsourcelines(_repeats)
    without = first + next(i for i, text in enumerate(lines) if "# without" in text)
    found = loc.sources(1)
    assert [s["where"].rsplit(":", 1)[1] for s in found] == [f"{without} (_repeats)"]
    assert "data-dependent shape" in found[0]["what"] and found[0]["sync"]


def test_the_measuring_clocks_own_reads_are_the_clock_s_not_the_step_s():
    """The step clock's one loss read at the end is the measurement's, never counted against the
    user's step: named by the file the clock really lives in (the kit's), so a move is caught."""
    assert classify_frame(clock.__file__) == "clock"
    assert not is_sync("clock", "cuda")
