"""Plain PyTorch, hand-tuned the way an expert would: the "hand-tuned" contender of `turbotrain bench`.

On CUDA: bf16 autocast, torch.compile, fused AdamW, TF32 and cuDNN autotuning, SDPA with
is_causal (the GPT's default attention path), channels_last for CNNs, pinned host batches copied
with non_blocking=True, gradients set to None, no host-device sync in the loop. On CPU: fp32 (a
CPU without bf16 units runs bf16 autocast ~14x slower), eager (compiling costs ~40 s for ~6%
there; --compile on forces it), fused AdamW.

It imports only model definitions from turbotrain. The timing restates turbotrain.bench.protocol:
time to first step (one synchronize), warm-up untimed, timed steps by CUDA events (host clock on
CPU), per-step losses kept on the device and read once at the end.

    python benchmarks/handtuned.py --spec SPEC.json --result OUT.json [--compile auto|on|off] [--bf16 auto|on|off]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import time
import traceback

import torch
import torch._dynamo  # noqa: F401  (imported up front: imports are not part of the time to first step)

from turbotrain.models.classifier import CifarResNet, ResNet
from turbotrain.models.gpt import GPT, GPTConfig
from turbotrain.models.mlp import TinyMLP


def build(kind: str, kw: dict) -> torch.nn.Module:
    if kind == "gpt":
        return GPT(GPTConfig(**kw))
    if kind == "mlp":
        return TinyMLP(**kw)
    if kind == "resnet":
        return ResNet(**{**kw, "layers": tuple(kw["layers"])})
    return CifarResNet(**kw)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, v in model.state_dict().items():
        h.update(name.encode())
        h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(spec: dict, compile_flag: str, bf16_flag: str) -> dict:
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    use_bf16 = cuda if bf16_flag == "auto" else bf16_flag == "on"
    use_compile = cuda if compile_flag == "auto" else compile_flag == "on"
    warmup, timed, o = spec["warmup_steps"], spec["timed_steps"], spec["optim"]
    total = warmup + timed

    torch.manual_seed(spec["seed"])
    model = build(spec["model"]["kind"], spec["model"]["kwargs"])
    init = digest(model)
    data = torch.load(spec["data_file"], weights_only=True)
    xs, ys = data["x"], data["y"]
    resident = cuda and spec.get("resident", False)
    if resident:
        xs, ys = xs.to(dev), ys.to(dev)
    conv = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_flush_denormal(True)  # CPU: no slow denormal arithmetic
    fmt = torch.channels_last if (cuda and conv) else torch.preserve_format
    model = model.to(dev, memory_format=fmt)
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in emb]
    rest = [p for p in model.parameters() if not (p.ndim >= 2 and id(p) not in emb)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
                            lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, o["lr_warmup_steps"])))
    step_fn = torch.compile(model) if use_compile else model
    loader = torch.utils.data.DataLoader(
        [(xs[i % len(xs)], ys[i % len(ys)]) for i in range(total)], batch_size=None, pin_memory=cuda and not resident
    )
    params = list(model.parameters())

    losses, events, marks = [], [], []
    first_step_s = t_warm = 0.0
    model.train()
    for n, (x, y) in enumerate(loader, start=1):
        x = x.to(dev, non_blocking=True, memory_format=fmt) if x.ndim == 4 else x.to(dev, non_blocking=True)
        y = y.to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o["grad_clip"], foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if n == 1:
            if cuda:
                torch.cuda.synchronize(dev)  # host-device sync point: once, for time to first step
            first_step_s = time.perf_counter() - t0
        if n >= warmup:
            if n == warmup:
                if cuda:
                    torch.cuda.synchronize(dev)  # host-device sync point: start of the timed window
                t_warm = time.perf_counter()
            if cuda:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
            else:
                marks.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize(dev)  # host-device sync point: end of the timed window
    timed_s = time.perf_counter() - t_warm
    step_ms = ([a.elapsed_time(b) for a, b in zip(events, events[1:])] if cuda
               else [1000 * (b - a) for a, b in zip(marks, marks[1:])])
    loss_values = torch.stack([v.float() for v in losses]).tolist()
    memory = ({"peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
               "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30} if cuda
              else {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30})
    if use_bf16:
        math = "bf16"
    else:
        math = "tf32" if cuda else "fp32"
    recipe = ", ".join([
        "bf16 autocast" if use_bf16 else "fp32",
        "torch.compile" if use_compile else "eager",
        "fused AdamW",
        *(["TF32", "cuDNN benchmark"] if cuda else []),
        *(["channels_last"] if cuda and conv else []),
        *(["pinned non_blocking copies"] if cuda and not resident else []),
    ])
    if cuda:
        name = torch.cuda.get_device_name(dev)
    else:
        name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "cpu")
    return {
        "recipe": recipe, "precision": "bf16-mixed" if use_bf16 else "fp32", "math_precision": math,
        "compiled": use_compile, "steps": len(losses), "time_to_first_step_s": first_step_s, "timed_s": timed_s,
        "step_ms": step_ms, "step_ms_median": statistics.median(step_ms), "losses": loss_values,
        "first_loss": loss_values[0], "final_loss": loss_values[-1], **memory, "init_digest": init,
        "device": dev.type, "device_name": name, "versions": {"torch": torch.__version__},
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    p = argparse.ArgumentParser(description="hand-tuned plain PyTorch contender")
    p.add_argument("--spec", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="auto: on for CUDA, off for CPU")
    p.add_argument("--bf16", choices=("auto", "on", "off"), default="auto", help="auto: on for CUDA, off for CPU")
    args = p.parse_args()
    spec = json.load(open(args.spec))
    start = time.perf_counter()
    result: dict = {"contender": "handtuned", "pid": os.getpid()}
    code = 0
    try:
        result.update(status="ok", **train(spec, args.compile, args.bf16))
    except Exception as exc:
        traceback.print_exc()
        result.update(status="failed", reason=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        code = 1
    result["process_s"] = time.perf_counter() - start
    with open(args.result + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.result + ".tmp", args.result)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
