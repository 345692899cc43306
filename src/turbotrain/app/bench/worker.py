"""One contender in its own process: ``python -m turbotrain.app.bench.worker NAME --spec S --result R``;
one JSON result with ``status`` "ok", "skipped" (a missing package, a mode this device lacks) or "failed"."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import torch

from ...base.failure import one_line
from ...base.version import __version__
from ...parts.hardware import device_name
from ..measure import child_main
from .auto import TRAINERS as CHOSEN_TRAINERS
from .contenders import CONTENDERS, TRAINERS, SkipContender
from .protocol import Job, StepClock, init_digest, load_batches
from .workloads import seeded_workload


def run(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Train contender ``name`` on ``spec``; the result's figures (raises SkipContender)."""
    trainers = {**TRAINERS, **CHOSEN_TRAINERS}  # the measured choice and the CUDA-graph row (auto.py)
    if name not in trainers:
        raise SkipContender(f"no in-process trainer for {name!r}")
    device = torch.device(spec["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SkipContender("CUDA requested but no GPU is visible")
    # Imports are not part of the time to first step: torch.optim imports torch._dynamo lazily
    # (~1.4 s here) at the first optimizer built, which Lightning and Accelerate pay at import.
    importlib.import_module("torch._dynamo")

    model, loss_fn = seeded_workload(spec["model"]["kind"], spec["model"]["kwargs"], spec["seed"])
    digest = init_digest(model)
    batches = load_batches(spec, device)
    clock = StepClock(device, spec["warmup_steps"], spec["timed_steps"])
    extra = trainers[name](Job(spec, device, model, batches, clock, loss_fn))
    figures = clock.finish()
    versions = {"torch": torch.__version__, "turbotrain": __version__, **extra.pop("versions", {})}
    return {
        "recipe": CONTENDERS[name].recipe(device.type),
        **extra,
        **figures,
        "init_digest": digest,
        "device": device.type,
        "device_name": device_name(device),
        "versions": versions,
        "threads": torch.get_num_threads(),
    }


def row(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """:func:`run` as the row's result: its status and figures, or why it skipped or failed."""
    result: dict[str, Any] = {"contender": args.contender, "pid": os.getpid()}
    try:
        result.update(status="ok", **run(args.contender, spec))
    except SkipContender as exc:
        result.update(status="skipped", reason=str(exc))
    except Exception as exc:  # reported in the table as "failed (...)", with the traceback here
        traceback.print_exc()
        result.update(status="failed", reason=one_line(exc), traceback=traceback.format_exc()[-4000:])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(argv, __doc__ or "", row, "contender")


if __name__ == "__main__":
    sys.exit(main())
