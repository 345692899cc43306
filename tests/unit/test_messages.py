"""What a user reads: warnings as one line, no noise from optional packages, no traceback from a
closed pipe, no warning a default causes, and wordings that name the field the user set (issue 32)."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest

from turbotrain.app import training
from turbotrain.base.config import load_config
from turbotrain.base.errors import TurbotrainWarning, quiet_imports
from turbotrain.cli import format_warning
from turbotrain.core.precision import DeviceCaps, resolve_precision


def test_a_turbotrain_warning_is_one_line_without_a_source_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_precision("bf16-mixed", DeviceCaps("cpu"))
    [w] = caught
    text = format_warning(w.message, w.category, w.filename, w.lineno, None)
    assert text == "WARNING turbotrain: precision.mode = 'bf16-mixed' on CPU: without bf16 units this is often many " \
                   "times slower than fp32\n"
    other = format_warning(UserWarning("theirs"), UserWarning, "/x/lib.py", 7, "warn()")
    assert "/x/lib.py:7" in other  # someone else's warning keeps the line that points at it


def test_quiet_imports_hides_torchao_load_noise_only_inside(caplog: pytest.LogCaptureFixture) -> None:
    with quiet_imports():
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torch.utils._pytree").warning("Enum subclass ... deprecated")
        logging.getLogger("torchao").error("a real failure")
    logging.getLogger("torchao").warning("after the import")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["a real failure", "after the import"]


def test_help_config_into_head_ends_without_a_traceback() -> None:
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m turbotrain train --help-config | head -1; "
                           "echo rc=${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["[run]", "rc=141"]
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_the_default_warmup_is_not_a_warning_on_a_short_run(caplog: pytest.LogCaptureFixture) -> None:
    training._warn_long_warmup(load_config("gpt-tiny", {"train": {"max_steps": 20}}))
    assert not caplog.records
    training._warn_long_warmup(load_config("gpt-tiny", {"train": {"max_steps": 20}, "optim": {"warmup_steps": 40}}))
    assert "optim.warmup_steps = 40 is longer than the run" in caplog.text
