"""One-process runs inside the test process: `turbotrain train` through the CLI's main() and the
workers' one-process mode. A reference run or a refusal needs no process of its own, and each
start costs seconds of imports on CI's 2 cores; only what is about processes (torchrun, signals,
kills, SLURM tasks) starts one.

As in the subprocesses the tests start (OMP_NUM_THREADS=1), torch runs on one thread meanwhile.
``stderr`` holds what the process would have printed there: the lines printed to it, every log
record from INFO up (the CLI logs to stderr at INFO) and every warning."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


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
