"""The default loop reads device values only on logging steps.

On CPU a host-device sync costs nothing, so it cannot be timed; instead every Python-level way of
pulling a tensor's value to the host (``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``,
``float()``/``int()``/``bool()`` of a tensor) is counted while ``fit()`` runs the full default
hook set (monitor with its probes, evaluation, checkpoints, stop hooks). Each call is attributed
to the optimizer step the engine had completed when it happened. The GPU twin of this test, with
``torch.cuda.set_sync_debug_mode("error")``, is in tests/gpu/test_gpu_monitor.py.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
from conftest import tiny_overrides

from turbotrain import load_config
from turbotrain.app.training import build_training
from turbotrain.base.rundir import new_run_dir
from turbotrain.core.precision import NonFiniteGuard

READS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__", "__bool__")
LOG_EVERY, MAX_STEPS = 3, 9


# Reads of host-only tensors, which are not device reads on any machine: the data pipeline samples
# window positions with host tensors (``randint(...).tolist()``, in DataLoader workers on a GPU
# machine), and non-fused torch optimizers keep their step counters on the host and read them.
HOST_ONLY = ("torch/utils/data/", "turbotrain/parts/data/", "torch/optim/")


def _from_host_only_code() -> bool:
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return False
        if any(part in frame.f_code.co_filename.replace("\\", "/") for part in HOST_ONLY):
            return True
        frame = frame.f_back
    return False


def _count_reads(monkeypatch, training) -> Counter:
    """Run the training with every tensor read counted per completed optimizer step."""
    counts: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if not _from_host_only_code():
                counts[(training.engine.state.step, _name)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    training.run()
    monkeypatch.undo()
    return counts


# fused is the default (auto) wherever torch has it
@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_fit_reads_device_values_only_on_logging_steps(
    tmp_path, text_file, monkeypatch, caplog, implementation
):
    # Evaluation and checkpoints only at the end, so logging is the only periodic reader.
    config = load_config(
        overrides=tiny_overrides(
            tmp_path,
            data={"path": str(text_file)},
            optim={"implementation": implementation},
            train={"max_steps": MAX_STEPS, "eval_every": 0, "checkpoint_every": 0},
            monitor={"log_every": LOG_EVERY},
        )
    )
    training = build_training(config, new_run_dir(config), progress=False)
    # On CPU the engine checks finiteness on the host (free there); put in the guard that CUDA
    # uses, so this test covers the code path that must not sync a GPU.
    training.engine.guard = NonFiniteGuard(training.engine.device)
    counts = _count_reads(monkeypatch, training)

    by_step = Counter()
    for (step, _name), n in counts.items():
        by_step[step] += n
    warnings = [r.getMessage() for r in caplog.records if "host-device sync per step" in r.getMessage()]
    if implementation == "foreach":
        # A non-fused optimizer cannot take the on-device finite flag, so the skip decision reads
        # it on the host every step (free on CPU; never the default: auto is fused wherever torch has the kernel).
        # Not silently: the engine says so once, naming the fix. Everything else must hold.
        per_step = {step: counts[(step, "__bool__")] for step in range(MAX_STEPS)}
        assert all(n == 1 for n in per_step.values()), per_step
        for step in range(MAX_STEPS):
            by_step[step] -= 1
        assert len(warnings) == 1 and "AdamW" in warnings[0] and "fused" in warnings[0], warnings
    else:
        assert not warnings
    log_steps = set(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
    between = {step: n for step, n in by_step.items() if n and step not in log_steps}
    assert not between, f"tensor reads after non-logging steps: {between} ({sorted(counts.items())})"
    assert all(by_step[s] >= 1 for s in log_steps), by_step  # the loss really is read when logging
    assert [r["step"] for r in training.monitor.records] == sorted(log_steps)
