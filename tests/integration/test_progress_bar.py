"""The progress bar on a real terminal (issue 47 item 3): a pseudo-terminal 80 columns wide runs a
tiny ``turbotrain train`` whose steps take 0.6 s each (longer than the bar's redraw period) and
whose loss function logs a line of its own; the test reads what the terminal was sent."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import termios
import time
from pathlib import Path

import inprocess
import pytest

pty = pytest.importorskip("pty")

WORKLOAD = Path(__file__).with_name("slow_step_workload.py")
STEPS = 6


def _terminal_run(args: list[str], columns: int = 80, timeout_s: float = 300) -> tuple[int, bytes]:
    """``python -m turbotrain ARGS`` on a pseudo-terminal ``columns`` wide (its stdout and stderr;
    the process forked from this one): exit code, bytes sent."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {"COLUMNS": str(columns), "LINES": "24", "TERM": "xterm"}
    terminal = Path(os.ttyname(slave))
    proc = inprocess.turbotrain(args, terminal, terminal, env=env)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
    os.close(master)
    return proc.wait(timeout_s), out


def _screen_lines(raw: bytes) -> list[str]:
    """What was drawn, one entry per line or per redraw of the same line (``\\r``), colours left out."""
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", raw.decode("utf-8", "replace"))
    return [seg.rstrip() for seg in re.split(r"\r\n|\r|\n", text) if seg.strip()]


@pytest.mark.slow
def test_the_bar_ticks_every_step_in_80_columns_with_log_and_validation_lines_above_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)  # the terminal's process inherits this environment
    code, raw = _terminal_run(
        [
            "train",
            "--model",
            f"{WORKLOAD}:make",
            f"--train.max_steps={STEPS}",
            "--train.eval_every=3",
            "--train.eval_batches=1",
            f"--run.out_dir={tmp_path}",
            "--run.name=bar",
        ]
    )
    lines = _screen_lines(raw)
    assert code == 0, "\n".join(lines)
    bars = [line for line in lines if re.match(rf"step \d+/{STEPS} ", line)]
    # every step was drawn (log_every is 10: the bar no longer waits for a logging step)
    assert {int(line.split("/")[0][5:]) for line in bars} >= set(range(1, STEPS + 1)), bars
    for bar in bars:  # the step, the elapsed time and the ETA fit in 80 columns
        assert len(bar) <= 80 and re.search(r" \d:\d\d:\d\d eta (\d:\d\d:\d\d|-:--:--)", bar), bar
    # a log line of the user's code and the run's opening line: lines of their own, not on the bar
    assert "WARNING user: a line from the user's own code" in lines, lines
    assert any(line.startswith("INFO turbotrain.loop.monitor.hook: training 5 params") for line in lines)
    # the validation results stay as lines of their own
    vals = [line for line in lines if re.match(r"step +[36] \| loss [\d.]+ \| val [\d.]+ \|", line)]
    assert [v.split("|")[0].split()[1] for v in vals] == ["3", "6"], lines
