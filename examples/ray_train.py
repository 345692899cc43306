"""turbotrain under Ray Train's TorchTrainer (``pip install 'turbotrain[ray]'``): ``turbotrain train``'s
arguments, run by Ray's workers, restarted by Ray after a failure and resumed exactly.

    python examples/ray_train.py --workers 2 --preset gpt-tiny --train.max_steps=20 --distributed.strategy=ddp
    python examples/ray_train.py --workers 2 --model examples/workload_cnn.py:make --train.max_steps=64
    python examples/ray_train.py --address auto --workers 8 --gpu --storage-path s3://bucket/ray ...

Without ``--address`` it starts a local Ray cluster with one CPU per worker (gloo on CPU). The
checkpoints go to ``run.remote`` when given (``--run.remote=s3://...``), else to turbotrain's store
in Ray's experiment folder (``<storage-path>/<name>/turbotrain``); Ray keeps a small checkpoint
naming the run (``turbotrain.json``), which ``turbotrain train --resume`` takes too.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import ray
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from turbotrain.base.config import parse_overrides
from turbotrain.integrations.ray import POINTER, loop_config, train_loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="Ray workers, one process each (default 2)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL); default CPU (gloo)")
    p.add_argument(
        "--address", help="a running Ray cluster (auto: the one on this node); default a local one"
    )
    p.add_argument(
        "--storage-path", default=str(Path("runs/ray").resolve()), help="Ray's RunConfig storage_path"
    )
    p.add_argument(
        "--name", default="turbotrain", help="Ray's experiment name (and the run's, unless --run.name)"
    )
    p.add_argument("--max-failures", type=int, default=2, help="Ray's FailureConfig(max_failures)")
    p.add_argument("--preset")
    p.add_argument("--model", help="a workload FILE.py:FUNC, as turbotrain train --model")
    p.add_argument("--data", help="a text file or folder, as turbotrain train --data")
    args, rest = p.parse_known_args()
    settings = parse_overrides(rest)  # --section.key=value, as turbotrain train takes them
    if args.data:
        settings.setdefault("data", {})["path"] = args.data
    config = loop_config(args.model, preset=args.preset, **settings)  # a mistake: one line, before Ray starts

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the workers' torch threads: one per CPU Ray gives them
    ray.init(address=args.address, num_cpus=None if args.address else args.workers)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            failure_config=FailureConfig(max_failures=args.max_failures),
            # what Ray keeps are pointers: the weights are in turbotrain's store
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as folder:
            print(f"{POINTER}: {(Path(folder) / POINTER).read_text()}")
    print(f"last metrics: {result.metrics}")
    ray.shutdown()


if __name__ == "__main__":
    main()
