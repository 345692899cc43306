"""``turbotrain bench --batch auto``: the workload's batch chosen by turbotrain's batch finder, in a
process of its own (its memory and compiled graphs are gone before the first row). The largest size
that fits at turbotrain's defaults becomes the global batch of EVERY row: a contender that needs
more memory there (fp32 eager, say) fails with out-of-memory, which the table reports."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...base.batch import move_to
from ...base.config import load_config
from ...base.errors import TurbotrainError
from ...base.failure import cause_in_log
from ...core.assembly import build_trainable
from ...tools.memory import resolve_batch_size
from ..measure import child_main, run_child
from .contenders import turbotrain_overrides
from .suite import BenchOptions, row_env
from .workloads import make_data, resolve_workload, seeded_model, to_spec

AUTO_MAX_MICRO = 1024  # samples; the finder's own ceiling


def search(name: str, device_type: str, seed: int) -> dict[str, Any]:
    """The batch finder's search for workload ``name``, in this process, as a dict."""
    w = resolve_workload(name, device_type)
    spec = to_spec(w, device=device_type, seed=seed, data_file=Path(os.devnull))
    device = torch.device(device_type)
    overrides = turbotrain_overrides(spec, device, w.total_steps)
    overrides["batch"] = {"micro": "auto", "global_size": 0, "accumulation": 1}
    config = load_config(overrides=overrides)
    t = build_trainable(config, seeded_model(w.model, w.model_kwargs, seed))

    def make_batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = make_data(w.replace(batch_size=micro, pool=1), seed)
        return move_to((xs[0], ys[0]), t.engine.device)

    _, found = resolve_batch_size(
        config, t.engine, t.model, t.optimizer, max_micro=AUTO_MAX_MICRO, make_batch=make_batch
    )
    assert found is not None  # micro was "auto"
    return {"workload": name, "device": device_type, "summary": found.describe(), **found.to_dict()}


def find_workload_batch(name: str, opts: BenchOptions, keep_log: bool = True) -> dict[str, Any]:
    """:func:`search` in its own process with a row's environment, so its answer holds for the rows."""
    work_dir = opts.work_dir / f"batch-{name}"
    spec = {"workload": name, "device": opts.device, "seed": opts.seed}
    env, log = row_env(work_dir, opts), work_dir / "log.txt"
    code, result, _ = run_child("turbotrain.app.bench.autobatch", work_dir, spec, env, opts.timeout_s)
    where = f"see {log}" if keep_log else "pass --work-dir DIR to keep its log"
    if code is None:
        raise TurbotrainError(
            f"--batch auto: the batch search for {name} took over {opts.timeout_s:g} s ({where}); "
            "pass --batch N or a larger --timeout-s"
        )
    if code != 0 or result is None:
        cause = cause_in_log(log.read_text(errors="replace"), code)  # not the last line: a warning's, often
        raise TurbotrainError(
            f"--batch auto: the batch search for {name} failed: {cause} ({where}); pass --batch N"
        )
    return result


def child(spec: dict[str, Any], _: argparse.Namespace) -> dict[str, Any]:
    """:func:`search` in a child process (``--spec``: written by :func:`find_workload_batch`)."""
    found = search(spec["workload"], spec["device"], spec["seed"])
    print(found["summary"], flush=True)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(argv, __doc__.splitlines()[0], child)


if __name__ == "__main__":
    sys.exit(main())
