"""``turbotrain train --nproc N``: N processes on this machine, started by torchrun's own launcher
(``elastic_launch``), so everything torchrun gives holds (docs/cluster.md).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

import torch

from ..base.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_nproc(nproc: str) -> int:
    """The process count ``--nproc`` asks for (a mistake: one ConfigError line)."""
    gpus = torch.cuda.device_count()  # counted without initialising CUDA in this process
    if nproc == "auto":
        if gpus == 0:
            raise ConfigError(
                "--nproc auto starts one process per visible GPU and none is visible; give a number "
                "(CPU processes, gloo), e.g. --nproc 2"
            )
        return gpus
    if not nproc.isdigit() or int(nproc) < 1:
        raise ConfigError(f"--nproc {nproc!r} is not valid; give a whole number >= 1 or 'auto'")
    n = int(nproc)
    if gpus and n > gpus:
        raise ConfigError(
            f"--nproc {n}: this machine shows {gpus} GPU{'s' if gpus > 1 else ''} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); give --nproc {gpus} or fewer, or auto"
        )
    return n


def launch_local(nproc: str, argv: list[str], max_restarts: int = 0) -> int:
    """Run ``python -m turbotrain train ARGV`` in ``--nproc`` processes; returns the first failed
    rank's exit status (not the agent's 1)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError(
            "--nproc starts the processes itself; under torchrun (RANK and WORLD_SIZE are set) leave it out"
        )
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts {max_restarts} is not valid; give a whole number >= 0")
    n = resolve_nproc(nproc)
    # torchrun's launcher: imported when used (it pulls in the elastic agent)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if n > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does: N processes must not oversubscribe the cores
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: a free port
        max_restarts=max_restarts,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "turbotrain", "train", *argv)
    except ChildFailedError as exc:
        failures = exc.failures
        rank = 0 if 0 in failures else exc.get_first_failure()[0]
        code = failures[rank].exitcode
        return code if code > 0 else 128 - code  # a signal: 128 + its number, as a shell reports it
    return 0
