"""fp8 per layer by timing on a preset's model: the table (layer, M x K x N, ms in bf16 / fp8
tensorwise / fp8 rowwise, choice) that core/precision/fp8_choice.py decides from, as JSON and
markdown.

    python benchmarks/fp8_layers.py --preset gpt2-small --micro 16 --out DIR        # a float8 GPU
    python benchmarks/fp8_layers.py --preset gpt-tiny --micro 2 --emulate --out DIR # CPU: runs, times mean nothing

Each distinct shape is timed forward + backward under bf16 autocast, compiled (``--no-compile``:
eager), median of ``--repeats``; M is the rows each linear sees in one forward of ``--micro``
sequences of random tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from turbotrain.base.config import load_config
from turbotrain.core.precision.fp8 import FP8
from turbotrain.core.precision.fp8_choice import linear_timer, time_fp8_layers
from turbotrain.parts.models.registry import build_model
from turbotrain.tools.memory import token_batches
from turbotrain.tools.memory.stats import default_vocab_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--micro", type=int, default=16, help="sequences per micro-batch (M = micro x block_size)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--emulate", action="store_true", help="torchao's emulation (CPU: the path runs, times mean nothing)"
    )
    p.add_argument("--lm-head", action="store_true", help="time the output layer too")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_config(args.preset)
    vocab = default_vocab_size(config)
    model = build_model(config, vocab).to(device)
    idx, _ = token_batches(vocab, config.model.block_size, device)(args.micro)
    fp8 = FP8(device, emulate=args.emulate, lm_head=args.lm_head)
    timer = linear_timer(device, compile=not args.no_compile, emulate=args.emulate, repeats=args.repeats)
    choice = time_fp8_layers(model, lambda: model(idx), device, fp8, compile=not args.no_compile, timer=timer)
    args.out.mkdir(parents=True, exist_ok=True)
    choice.write(args.out)
    doc = {
        **choice.to_dict(),
        "preset": args.preset,
        "micro": args.micro,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    (args.out / "fp8_layers.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(choice.line)
    print(choice.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
