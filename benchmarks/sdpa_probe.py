"""Which SDPA kernel PyTorch picks for causal attention of given shapes, and each backend's time.

For the GPT's attention (``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` in bf16), on
CUDA: the kernels the default dispatch launches (from the profiler), then forward + backward time
of each backend forced alone (flash, cuDNN, memory-efficient), median of timed repeats after
warm-up, synchronized. Tells whether cuDNN attention (often faster on H100) is the one chosen.

    python benchmarks/sdpa_probe.py --batch 16 --heads 12 --seq 1024 --head-dim 64 --out sdpa.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from turbotrain.base.version import collect_git

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def _inputs(args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    return [torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def time_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, repeats: int) -> float:
    """Median forward + backward milliseconds (synchronized: host-device sync points, timing only)."""
    for _ in range(3):
        _step(q, k, v)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(q, k, v)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def chosen_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """Names of the attention kernels the default dispatch launches (forward and backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(q, k, v)
        torch.cuda.synchronize()
    words = ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")
    names = {e.name for e in prof.events() if any(w in e.name.lower() for w in words)}
    return sorted(names)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("sdpa_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    q, k, v = _inputs(args, device)
    result: dict = {
        "shape": [args.batch, args.heads, args.seq, args.head_dim],
        "dtype": "bf16",
        "is_causal": True,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "git": collect_git(),
        "gpu": torch.cuda.get_device_name(0),
        "default_kernels": chosen_kernels(q, k, v),
        "default_ms": time_ms(q, k, v, args.repeats),
        "backends_ms": {},
    }
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                result["backends_ms"][name] = time_ms(q, k, v, args.repeats)
        except RuntimeError as exc:  # backend unavailable for these shapes/this build
            result["backends_ms"][name] = f"unavailable: {str(exc).splitlines()[0][:160]}"
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
