"""Shared fixtures: tiny configs and data so the CPU suite stays fast."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from turbotrain import RunConfig, load_config

# One CPU thread here and in every process the tests start: the models are tiny and pytest-xdist
# runs a worker per core, so torch's default (a thread per core) oversubscribes the cores and each
# operator spins at its barrier (examples/own_loop.py on the shared 2-core machine: 1.4 s of CPU
# on one thread, 44 s on two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def tiny_overrides(tmp_path: Path, **sections: dict) -> dict:
    """Overrides for a 2-layer, d=32, T=32 GPT on a small text file, in ``tmp_path``."""
    base = {
        "run": {"out_dir": str(tmp_path / "runs"), "name": "t", "device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32},
        "data": {"cache_dir": str(tmp_path / "cache"), "num_workers": 0},
        "batch": {"micro": 4},
        "optim": {"warmup_steps": 2, "lr": 3e-3, "min_lr": 3e-4},
        "train": {"max_steps": 6, "eval_every": 3, "eval_batches": 2, "checkpoint_every": 3},
        "monitor": {"log_every": 2, "progress": False, "nvml": False},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return base


# A bound on a hang, never on speed: every wait on a process the tests start (a subprocess's timeout,
# a wait for a file it writes) uses it. On a shared 2-core machine at load 30 a 16-step torchrun
# launch of 2 ranks took over 240 s (test_split_invariant failed so, its run complete, 1 in 6).
HANG_S = 900

# about 40 KB of Python-like text: the tiny GPT's corpus in every test that trains on a file
CORPUS = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(1200))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    """About 40 KB of Python-like text."""
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS)
    return path


@pytest.fixture
def tiny_config(tmp_path: Path, text_file: Path) -> RunConfig:
    return load_config(overrides=tiny_overrides(tmp_path, data={"path": str(text_file)}))


@pytest.fixture(scope="session", autouse=True)
def _sqlite_without_fsync() -> None:
    """Optuna's sqlite studies (turbotrain tune) commit every trial attribute; on disk each commit
    waits for an fsync, seconds per test on CI. Nothing here needs them to survive a power cut."""
    try:
        from sqlalchemy import event
        from sqlalchemy.engine import Engine
    except ImportError:  # no optuna, no studies
        return

    @event.listens_for(Engine, "connect")
    def _no_fsync(connection, record) -> None:  # noqa: ANN001
        if type(connection).__module__.startswith("sqlite3"):
            connection.execute("PRAGMA synchronous = OFF")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    np.random.seed(0)


# every test in these folders is slow: tests/distributed starts several processes (torchrun with
# gloo, or a worker launched twice); tests/integration runs the product end to end (turbotrain
# train, bench, profile, tune, the trackers and the framework callbacks: whole runs, many in a
# process of their own)
SLOW_FOLDERS = (Path(__file__).parent / "distributed", Path(__file__).parent / "integration")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in :data:`SLOW_FOLDERS` is marked ``slow``, as are the tests in tests/unit that
    start a process, compile or train more than a few seconds (``@pytest.mark.slow`` at each):
    ``pytest -m "not slow"`` is the fast tier, to run before each commit; the whole suite (CI's)
    runs them all. Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA
    device: ``pytest -m gpu`` on a GPU machine runs exactly them. (One hook here, not a conftest
    per folder: a second file imported as ``conftest`` shadowed this one's ``tiny_overrides``.)"""
    skip = (
        None
        if torch.cuda.is_available()
        else pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    )
    for item in items:
        if any(folder in Path(item.path).parents for folder in SLOW_FOLDERS):
            item.add_marker(pytest.mark.slow)
        if skip is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under -n: the long tests out first, the short fill the end
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: in order within


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole, in order: a module of :data:`SLOW_FOLDERS` (its tests
    share the run a module-scoped fixture trains once, or build on each other: test_docs.py's pages
    share a folder), else the one test."""
    module = nodeid.split("::")[0]
    slow = any(module.startswith(f"{folder.parent.name}/{folder.name}/") for folder in SLOW_FOLDERS)
    return module if slow else nodeid


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook (the dev extra): known only where it is
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N`` (``--dist load``, xdist's default; another ``--dist`` is left to xdist):
    xdist's scope scheduler with :func:`work_unit` as the scope. Units go out the modules first,
    most tests first, then tests/unit's slow tests, then its fast ones (the hook above sorts them
    so), the short ones last to fill the end; a worker takes the next when it has 2 tests left.
    xdist's own ``loadgroup`` cannot group: it marks a group by rewriting node ids, which pytest 9
    ignores (pytest-dev/pytest-xdist#1386)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only here: the module needs pytest-xdist

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)


# ---------------------------------------------------------------------------- an S3 server (run.remote tests)

BUCKET = "turbotrain-test"


_HELD_PORTS: list[socket.socket] = []


def free_port(port: int = 0) -> int:
    """A TCP port on localhost that stays free for the server a test starts on it: bound here
    (SO_REUSEADDR, never listening) until this pytest process ends, so the kernel hands it to no
    other ``bind(port 0)`` or outgoing connection on the machine (another xdist worker's test,
    another program), while the test's server, which sets SO_REUSEADDR too (moto's, torch's
    TCPStore: torchrun's rendezvous, gloo's MASTER_PORT), listens on it. A port bound and released
    at once could be handed to another worker's server before the test's own started.
    ``port``: that one (OSError when something else holds it)."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    _HELD_PORTS.append(s)
    return s.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + HANG_S  # its imports take seconds, minutes on a loaded machine
    while time.monotonic() < deadline and server.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"moto_server did not start on port {port} (exit {server.wait()})")


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[tuple[dict[str, str], subprocess.Popen]]:
    """A moto S3 server (``moto_server``, its own process on a free port) with the bucket; the
    environment a run reaches it with (the standard AWS variables: endpoint and test credentials)."""
    pytest.importorskip("s3fs")
    port = free_port()
    server = _start_server(port)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "OMP_NUM_THREADS": "1",
    }
    s3_client(env).create_bucket(Bucket=BUCKET)
    try:
        yield env, server
    finally:
        server.kill()
        server.wait()


def s3_client(env: dict[str, str]) -> Any:
    """A boto3 S3 client of the server ``env`` (the ``s3`` fixture's) points at."""
    boto3 = pytest.importorskip("boto3")
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
