"""One-process runs inside the test process: `turbotrain train` through the CLI's main() and the
workers' one-process mode. A reference run or a refusal needs no process of its own, and each
start costs seconds of imports on CI's 2 cores; only what is about processes (torchrun, signals,
kills, SLURM tasks) starts one, and where torch and turbotrain need not be imported afresh it is a
fork of this process (:func:`fork`).

As in the subprocesses the tests start (OMP_NUM_THREADS=1), torch runs on one thread meanwhile.
``stderr`` holds what the process would have printed there: the lines printed to it, every log
record from INFO up (the CLI logs to stderr at INFO) and every warning."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turbotrain.base import runlock
from turbotrain.base.process import exit_after_threads


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train(args: list[str], env: dict[str, str] | None = None) -> Result:
    """``python -m turbotrain train ARGS`` (with ``env`` added to the environment), in this process."""
    from turbotrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with (
            _one_thread(),
            _environ(env or {}),
            warnings.catch_warnings(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            warnings.simplefilter("default")
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: (
                err.write(warnings.formatwarning(message, category, filename, lineno, line))
            )
            try:
                code = main(["train", *args])
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return Result(code, out.getvalue(), err.getvalue())


def worker(script: Path, *args: str) -> None:
    """``python SCRIPT ARGS`` for a worker's one-process mode, in this process."""
    argv = sys.argv
    sys.argv = [str(script), *args]
    try:
        with _one_thread():
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


@dataclass
class Forked:
    """A child process :func:`fork` started, with :class:`subprocess.Popen`'s ``pid``, ``poll``,
    ``wait``, ``communicate`` (its output files, read once it ended), ``send_signal``, ``kill`` and
    ``returncode`` (minus the signal's number when a signal ended it)."""

    pid: int
    stdout: Path
    stderr: Path
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:  # as subprocess.run's timeout: the child does not outlive it,
                with contextlib.suppress(ProcessLookupError):  # nor what it forked (its process group)
                    os.killpg(self.pid, signal.SIGKILL)
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
                raise subprocess.TimeoutExpired(f"fork {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def communicate(self, timeout: float) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout.read_text(), self.stderr.read_text()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _as_a_new_interpreter() -> None:
    """This forked process's state as a new interpreter's: no record of run locks held (the kernel's
    locks do not pass a fork), no process group, default signal handlers (not pytest's or torchrun's),
    no log handler (not pytest's capture)."""
    runlock._HELD.clear()
    assert not torch.distributed.is_initialized(), "forked from a process holding a process group"
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)


def _status(exc: SystemExit) -> int:
    """The exit status of a program that raised ``exc``, its message printed as the interpreter does."""
    if exc.code is not None and not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr)
    return exc.code if isinstance(exc.code, int) else int(exc.code is not None)


def _install_fault() -> None:
    """TT_FAULT's fault, as tests/faults/sitecustomize.py installs it at an interpreter's start
    (with tests/faults on the path, as PYTHONPATH=tests/faults gives the command)."""
    from faults.faultenv import FAULTS

    if os.environ.get("TT_FAULT"):
        sys.path.insert(0, str(FAULTS))
        runpy.run_path(str(FAULTS / "sitecustomize.py"))


def fork(target: Callable[[], object], stdout: Path, stderr: Path | None = None) -> Forked:
    """``target()`` in a child process forked from this one, its stdout written to ``stdout`` and
    its stderr to ``stderr`` (default: the same file), file descriptors 1 and 2 too: a real process
    to signal, kill and read the exit status of, without the seconds a new interpreter spends
    importing torch and turbotrain. It exits as a program would: SystemExit's code, 1 after another
    exception (traceback on stderr), else 0. Signals and logging start as in a new interpreter
    (SIGTERM ends it, no log handler); warnings are printed to stderr, under the filters of the test
    that forked it (which may show a warning a new interpreter would not). Its own process group."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return Forked(pid, stdout, stderr or stdout)
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own: a timeout kills what it forked too (torchrun's ranks)
        _as_a_new_interpreter()
        out = open(stdout, "w", buffering=1)  # noqa: SIM115 (they end with the process)
        err = out if stderr is None else open(stderr, "w", buffering=1)  # noqa: SIM115
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = out, err
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
            warnings.formatwarning(message, category, filename, lineno, line)
        )
        target()
        code = 0
    except SystemExit as exc:
        code = _status(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_after_threads(code)  # as the interpreter's exit: the threads it started end first


def torchrun(
    argv: list[str],
    stdout: Path,
    stderr: Path,
    env: dict[str, str] | None = None,
    before: Callable[[], object] | None = None,
) -> Forked:
    """``python -m torch.distributed.run ARGV`` (``env``: its whole environment) in a :func:`fork`:
    torchrun's own ``main`` (its arguments, rendezvous, agent, restarts and failure summary), whose
    agent forks the ranks (start method ``fork``, as torchrun does for a function entry point)
    where the command line would start an interpreter each: the seconds of imports a rank spends
    are saved. A rank runs ``-m turbotrain ARGS`` through the CLI's ``main`` or ``SCRIPT ARGS`` as
    ``__main__`` (:func:`_rank`). What is about the interpreter itself (the exit of
    ``python -m turbotrain`` under torchrun, a rank's environment as /proc shows it) needs the real
    command: the tests that check it start it. ``before``: called first in the fork (a
    ``preexec_fn``)."""
    import torch.distributed.run as run
    from torch.distributed.launcher.api import elastic_launch

    def launcher() -> None:
        environ = dict(os.environ if env is None else env)
        os.environ.clear()
        os.environ.update(environ)
        if before is not None:
            before()

        def forking(config: Any, entrypoint: object) -> Callable[..., object]:
            config.start_method = "fork"
            return elastic_launch(config, _rank)

        run.elastic_launch = forking  # this fork's torchrun only
        run.main(argv)

    return fork(launcher, stdout, stderr)


def _rank(*cmd: str) -> int:
    """A rank torchrun's agent forked: ``-u -m turbotrain ARGS`` or ``-u SCRIPT ARGS`` (what it
    would have run with ``python``) as a new interpreter would: default signal handlers (not the
    launcher's), no log handler, torch on OMP_NUM_THREADS threads, TT_FAULT's fault installed as
    tests/faults/sitecustomize.py does at an interpreter's start, a script's folder first on
    ``sys.path`` (ep_ckpt_worker.py imports the workers beside it). Returns 0, or raises SystemExit
    with the command's status (multiprocessing's exit status)."""
    from turbotrain.cli import main

    _as_a_new_interpreter()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _install_fault()
    args = list(cmd[1:] if cmd[0] == "-u" else cmd)
    if args[:2] == ["-m", "turbotrain"]:
        sys.argv = [str(Path(main.__code__.co_filename).parents[1] / "__main__.py"), *args[2:]]
        code = main(args[2:])
    else:
        sys.argv = args
        sys.path.insert(0, str(Path(args[0]).resolve().parent))  # as `python SCRIPT` does: imports beside it
        try:
            runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _status(exc)
    if code:
        raise SystemExit(code)
    return 0


def completed(proc: Forked, timeout: float) -> Result:
    """``proc`` waited for (killed past ``timeout``, as subprocess.run's): its status and output."""
    out, err = proc.communicate(timeout)
    assert proc.returncode is not None
    return Result(proc.returncode, out, err)


def turbotrain(
    args: list[str],
    stdout: Path,
    stderr: Path,
    fault: str = "",
    marker: Path | None = None,
    sigint: Callable[..., object] | int = signal.default_int_handler,
    env: dict[str, str | None] | None = None,
) -> Forked:
    """``python -m turbotrain ARGS`` with ``fault`` (and its pause ``marker``) injected as
    tests/faults/sitecustomize.py does at a new interpreter's start, in a :func:`fork`; ``sigint``:
    SIGINT's handler as the interpreter starts (``signal.SIG_IGN``: inherited as ignored); ``env``
    set in its environment (a value None: the variable removed)."""
    from faults.faultenv import fault_env

    from turbotrain.cli import main

    def command() -> None:
        os.environ.update(fault_env(fault, marker))
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        signal.signal(signal.SIGINT, sigint)
        _install_fault()
        sys.exit(main(args))

    return fork(command, stdout, stderr)
