"""Child processes that never outlive their parent (bench rows, the batch search, tune trials): each
in a session of its own, so ending it also ends its workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

SRC_DIR = str(Path(__file__).resolve().parents[2])  # the folder holding the turbotrain package


def child_env(*, threads: int = 0, compile_cache: Path | None = None) -> dict[str, str]:
    """This process's environment for a child: the same source, ``threads``, compile caches."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    if compile_cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache / "inductor-cache")
        env["TRITON_CACHE_DIR"] = str(compile_cache / "triton-cache")
    return env


def run_process(
    cmd: list[str],
    log_path: Path,
    env: dict[str, str],
    timeout_s: float,
    poll: Callable[[], bool] | None = None,
    poll_every_s: float = 0.5,
) -> int | None:
    """Run ``cmd`` logged to ``log_path``; its exit code, or None past ``timeout_s`` or ``poll()``."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        code: int | None = None
        try:
            remaining = timeout_s
            while True:
                step = remaining if poll is None else min(poll_every_s, remaining)
                try:
                    code = proc.wait(timeout=max(step, 0.0))
                    break
                except subprocess.TimeoutExpired:
                    remaining -= step
                    if remaining <= 0 or (poll is not None and poll()):
                        break
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return code


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(143), so :func:`run_process` ends its child before this process goes."""
    signal.signal(signal.SIGTERM, _terminate)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_after_threads(code: int) -> None:
    """End this process with ``code`` as the interpreter's exit would, less its teardown: wait for the
    non-daemon threads it started (a checkpoint write in flight), flush, then ``os._exit``."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
