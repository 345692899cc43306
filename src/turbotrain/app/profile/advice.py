"""From a profiled run's figures to the bottleneck and ranked recommendations: each :class:`Advice`
is config ``settings`` (``--verify`` applies these) and/or a ``code`` line to change, ranked by an
estimated speedup (a rough model, stated in ``expected``). The rules, in order: data, syncs,
overhead, optimizer, compute and copies (CUDA), memory and trend (:mod:`.pressure`); their
thresholds are the constants below."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ...base.config import flat, setting
from ...parts.data.loader import default_num_workers
from ...parts.models.registry import spec_for
from ..measure import Built, measure_memory
from .pressure import BOTTLENECKS as PRESSURE
from .pressure import memory_pressure, throughput_trend

DATA_SHARE = 0.20
OVERHEAD_OP_US_CPU = 20.0
OVERHEAD_KERNEL_US_CUDA = 10.0
OVERHEAD_IDLE_CUDA = 0.30
OPTIMIZER_SHARE = 0.15
COPY_SHARE = 0.10
SMALL_MICRO = 8  # samples per forward below which accumulating micro-batches is itself the finding
# fixed cost of one operator (dispatch, launch): the overhead model's c
PER_OP_OVERHEAD_US = {"cpu": 8.0, "cuda": 5.0}

BOTTLENECKS = {
    "data": "data loading: the step waits for the next batch",
    "syncs": "host reads of device values every step",
    "overhead": "per-operator overhead: the micro-batch is too small for this machine",
    "optimizer": "the optimizer step",
    "copies": "host-to-device copies",
    "compute": "forward and backward compute",
    **PRESSURE,  # memory, trend: the monitor's rules (pressure.py)
}
PHASE_BOTTLENECK = {"data": "data", "optimizer": "optimizer", "hooks": "syncs", "other": "overhead"}


@dataclass
class Advice:
    """One recommended change and what it should do."""

    category: str  # a BOTTLENECKS key
    change: str  # the exact change, as the reader writes it
    why: str
    expected: str
    expected_speedup: float
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # config overrides --verify applies
    code: str = ""  # a line of your code to change (not applied by --verify)
    verified: dict[str, Any] | None = None  # filled by --verify

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flags(settings: dict[str, dict[str, Any]], code: str = "") -> str:
    """The settings as the reader writes them: ``--a.b=1 --c.d=2`` on the command line, one
    ``{"a": {"b": 1}, "c": {"d": 2}}`` for a Python caller (see ``config.setting``); then the line
    of your ``code`` that sets the same when there is one."""
    words = [setting(k, v) for k, v in flat(settings).items()]
    flags = " ".join(words) if all(w.startswith("--") for w in words) else json.dumps(settings)
    return flags + (f" (in your code: {code})" if code else "")


def _overall(share: float, local_speedup: float) -> float:
    """Amdahl: the step's speedup when a part taking ``share`` of it gets ``local_speedup`` faster."""
    if local_speedup <= 0:
        return 1.0
    return 1.0 / max((1.0 - share) + share / local_speedup, 1e-9)


def diagnose(
    built: Built, figures: dict[str, Any], trace: dict[str, Any]
) -> tuple[dict[str, str], list[Advice]]:
    """The bottleneck ({"name", "text"}) and the recommendations, best expected first."""
    device = built.engine.device.type
    step_ms = figures["step_ms_median"]
    advice = [*_data(built, figures, trace, step_ms), *_syncs(built, trace, step_ms, device)]
    # bigger batches need more data
    if not any(a.category == "data" and a.expected_speedup >= 1.5 for a in advice):
        advice += _overhead(built, trace, device)
    advice += _optimizer(built, trace)
    if device == "cuda":
        advice += [*_compute_cuda(built, trace), *_copies(built, trace, step_ms)]
    pressure = memory_pressure(built, figures, lambda: measure_memory(built))  # off CUDA: one eager step
    advice += [Advice(**f) for f in [*pressure, *throughput_trend(figures.get("step_ms") or [])]]
    advice.sort(key=lambda a: -a.expected_speedup)
    if advice:
        # a step that waits on its loader is data-bound (the regime's word) whatever advice ranks first
        name = "data" if any(a.category == "data" for a in advice) else advice[0].category
    else:
        phases = trace["phases"]
        top = max(phases, key=lambda p: phases[p]["share"])
        name = PHASE_BOTTLENECK.get(top, "compute")
    return {"name": name, "text": BOTTLENECKS[name]}, advice


def _data(built: Built, figures: dict[str, Any], trace: dict[str, Any], step_ms: float) -> list[Advice]:
    wait = figures["data_wait_ms_per_step"]
    share = wait / step_ms if step_ms else 0.0
    # seen in the timed steps and in the profiled ones: a loader that is slow is slow in both, a
    # process the OS put aside for a few ms in one window (a busy machine) is not a slow loader
    if share < DATA_SHARE or trace["phases"]["data"]["share"] < DATA_SHARE:
        return []
    cores = os.cpu_count() or 1
    workers = built.loader_info.get("num_workers")
    why = f"the step waits {wait:.1f} ms of {step_ms:.1f} ms ({share:.0%}) for the next batch"
    if workers is None:
        code = "train_loader=DataLoader(dataset, batch_size=..., num_workers=4, persistent_workers=True)"
        change = "load batches in a torch DataLoader with workers"
        expected = "batches prepared in parallel while the model trains"
        return [Advice("data", change, why, expected, _overall(share, 2.0), code=code)]
    if workers >= max(cores, 8):
        change = "make reading a sample cheaper (decode once and cache, smaller files, a faster format)"
        why += f" with {workers} workers already"
        expected = "as much as the read gets faster"
        return [Advice("data", change, why, expected, _overall(share, 1.5), code="your Dataset.__getitem__")]
    return [_more_workers(built, why, wait, step_ms, workers, cores)]


def _more_workers(built: Built, why: str, wait: float, step_ms: float, workers: int, cores: int) -> Advice:
    n = max(2, min(8, cores)) if workers == 0 else min(2 * workers, max(cores, 8))
    # workers load ahead while the step computes
    new_step = max(step_ms - wait, 1e-3, wait * (workers or 1) / n)
    settings = {"data": {"num_workers": n}}
    code = "" if built.workload is None else f"DataLoader(..., num_workers={n}, persistent_workers=True)"
    expected = (
        f"{n} workers load batches ahead while the model trains: about {step_ms / new_step:.1f}x "
        f"(step ~{new_step:.1f} ms: the larger of the compute and the loading split over {n} workers)"
    )
    speedup = step_ms / new_step
    if default_num_workers(built.engine.device, cores) == 0:
        # the loader's own rule (data.num_workers auto, doctor): on a CPU of 4 cores or fewer the
        # training threads use every core, so batches load in-process; workers pay only for a
        # loader that waits (disk, network), not for one that computes: no speedup is claimed
        expected = (
            f"against the rule for {cores} cores (data.num_workers auto and doctor load batches in the "
            "training process on a CPU with 4 cores or fewer: workers compete with the training threads); "
            "it pays only if __getitem__ waits on a disk or network rather than computing, which --verify measures"
        )
        speedup = 1.0
    why += f" with {workers} loader workers"
    return Advice("data", _flags(settings, code), why, expected, speedup, settings, code)


def _syncs(built: Built, trace: dict[str, Any], step_ms: float, device: str) -> list[Advice]:
    sources = trace["syncs"]["sources"]
    idle = trace.get("device", {}).get("idle_share", 0.0)
    # on a GPU a read drains the queue: at best the idle share of the step comes back
    gain = _overall(idle, 2.0) if device == "cuda" else 1.0
    users = [_user_read(s, device, gain) for s in sources if s["kind"] == "user" and s["per_step"] >= 1]
    monitor = _monitor_reads(built, trace, step_ms, device, idle)
    return [*monitor, *users, *_guard_reads(built, sources, device, idle)]


def _monitor_reads(
    built: Built, trace: dict[str, Any], step_ms: float, device: str, idle: float
) -> list[Advice]:
    log_every = built.config.monitor.log_every
    monitor = sum(s["per_step"] for s in trace["syncs"]["sources"] if s["kind"] == "monitor")
    if monitor < 0.5 or log_every >= 10:
        return []
    hooks_ms = trace["phases"]["hooks"]["host_ms"] * step_ms / max(trace["profiled_step_ms"], 1e-9)
    saved = hooks_ms * (1 - log_every / 10)
    gain = step_ms / max(step_ms - saved, 1e-9)
    if device == "cuda":
        gain = max(gain, _overall(idle, 2.0))
    settings: dict[str, dict[str, Any]] = {"monitor": {"log_every": 10}}
    why = (
        f"the Monitor reads the loss on the host and writes a record every {log_every} step(s) "
        f"({monitor:.1f} read(s)/step; its hook takes {hooks_ms:.2f} ms of the {step_ms:.2f} ms step)"
        + (f"; the GPU is idle {idle:.0%} of the window" if device == "cuda" else "")
    )
    expected = f"a record every 10 steps saves ~{saved:.2f} ms per step (~{gain:.2f}x)" + (
        "; on a GPU each read also drains the queue" if device != "cuda" else ""
    )
    return [Advice("syncs", _flags(settings), why, expected, gain, settings)]


_USER_FIX = {  # a data-dependent shape or a read of a value: (the change, the code)
    True: (
        "give the operation its output size",
        "give the shape up front (torch.nonzero_static(x, size=...), torch.where(mask, x, 0) "
        "instead of x[mask], repeat_interleave(..., output_size=...))",
    ),
    False: (
        "keep the value on the device and read it every N steps",
        "accumulate on the device (total += loss.detach()) and call .item() every 100 steps, "
        "or let turbotrain's Monitor log the loss (monitor.log_every)",
    ),
}


def _user_read(s: dict[str, Any], device: str, gain: float) -> Advice:
    change, code = _USER_FIX["data-dependent" in s.get("what", "")]
    why = (
        f"{s['where']} makes the host wait for the device {s['per_step']:.0f} time(s) per step: "
        f"{s.get('what') or 'a read of a tensor value'}" + (f" in `{s['code']}`" if s.get("code") else "")
    )
    expected = (
        "on a GPU each read makes the host wait until the queue drains, leaving the GPU idle while the "
        "next step is enqueued"
        + ("" if device == "cuda" else "; on CPU there is no queue, so it costs little here")
    )
    return Advice("syncs", f"{s['where']}: {change}", why, expected, gain, code=f"{s['where']}: {code}")


def _guard_reads(built: Built, sources: list[dict[str, Any]], device: str, idle: float) -> list[Advice]:
    guard = sum(s["per_step"] for s in sources if s["kind"] == "guard")
    if device != "cuda" or guard < 1 or built.config.optim.implementation == "fused":
        return []
    own, fused = bool(built.workload and built.workload.optimizer), "torch.optim.AdamW(..., fused=True)"
    settings = {} if own else {"optim": {"implementation": "fused"}}
    why = f"the optimizer cannot skip a non-finite step on the GPU, so every step reads the finite flag on the host ({guard:.0f}/step)"
    expected = "a fused optimizer skips inside its kernel: no per-step sync"
    change, gain = fused if own else _flags(settings), max(_overall(idle, 2.0), 1.02)
    return [Advice("syncs", change, why, expected, gain, settings, fused if own else "")]


def _overhead(built: Built, trace: dict[str, Any], device: str) -> list[Advice]:
    dev = trace.get("device")
    micro, acc = built.micro, built.engine.accumulation
    if device == "cuda" and dev:
        op_us, idle = dev["kernel_median_us"], dev["idle_share"]
        small = op_us < OVERHEAD_KERNEL_US_CUDA and idle >= OVERHEAD_IDLE_CUDA
        what = "the median kernel takes"
    else:
        op_us = trace.get("forward_op_time_median_us")  # where the time goes, not the count of tiny operators
        small = op_us is not None and op_us < OVERHEAD_OP_US_CPU
        what = "half the forward's time goes to operators of at most"
    # Accumulating tiny micro-batches is a sign on any machine: the finder only raises it if it fits.
    if not (small or (acc > 1 and micro < SMALL_MICRO)) or op_us is None:
        return []
    share = sum(trace["phases"][p]["share"] for p in ("forward", "backward", "other"))
    overhead_us = min(PER_OP_OVERHEAD_US.get(device, 8.0), 0.9 * op_us)
    why = (
        f"{micro} sample(s) per forward pass: {what} {op_us:.1f} us, "
        f"close to the ~{overhead_us:.0f} us every operator costs whatever its size"
    )
    k, settings, effect = _larger_micro(built, micro, acc)
    # per-op time t = c + s*b: fewer, larger operators
    gain = _overall(share, op_us / (overhead_us / k + (op_us - overhead_us)))
    code = "" if built.workload is None else f"DataLoader(..., batch_size={micro * k})"
    applies = built.workload is None or built.loader_info.get("num_workers") is not None
    expected = f"{effect}; about {gain:.1f}x samples/s if the model is overhead-bound"
    kept = settings if applies else {}
    return [Advice("overhead", _flags(settings, code), why, expected, gain, kept, code)]


def _larger_micro(built: Built, micro: int, acc: int) -> tuple[int, dict[str, dict[str, Any]], str]:
    """(how many times larger, the settings, their effect): the batch finder keeps a preset's global
    batch when it accumulates; otherwise the batch grows, and with it the math."""
    if built.workload is None and acc > 1:
        same = f"the batch finder picks the largest micro-batch that fits and keeps the global batch {micro * acc} (same math)"
        return acc, {"batch": {"micro": "auto", "global_size": micro * acc}}, same
    grows = (
        f"the global batch grows 4x ({micro * acc} -> {micro * acc * 4}): the math changes, so scale "
        "optim.lr with it (linear rule) and compare the loss"
    )
    return 4, {"batch": {"micro": micro * 4}}, grows


def _optimizer(built: Built, trace: dict[str, Any]) -> list[Advice]:
    share = trace["phases"]["optimizer"]["share"]
    own, impl = bool(built.workload and built.workload.optimizer), built.config.optim.implementation
    if share < OPTIMIZER_SHARE or (not own and impl == "fused"):
        return []
    why = f"the optimizer step takes {share:.0%} of the step"
    expected = "one fused kernel over all parameters instead of one (or a few) per tensor: about half the optimizer's time"
    if own:
        code = "optimizer=torch.optim.AdamW(model.parameters(), ..., fused=True)"
        change = "torch.optim.AdamW(..., fused=True) in your workload"
        return [Advice("optimizer", change, why, expected, _overall(share, 2.0), code=code)]
    settings = {"optim": {"implementation": "fused"}}
    why += f" ({setting('optim.implementation', impl)})"
    return [Advice("optimizer", _flags(settings), why, expected, _overall(share, 2.0), settings)]


def _compute_cuda(built: Built, trace: dict[str, Any]) -> list[Advice]:
    phases, c = trace["phases"], built.config
    share = phases["forward"]["share"] + phases["backward"]["share"]
    if share < 0.4:
        return []
    # settings, why, expected, local speedup
    rules: list[tuple[dict[str, dict[str, Any]], str, str, float]] = []
    if built.engine.precision.name == "fp32":
        why = f"forward and backward take {share:.0%} of the step in fp32"
        expected = (
            "bf16 tensor-core matmuls: up to ~2x on the matmul-bound part (the loss changes within rounding)"
        )
        rules.append(({"precision": {"mode": "bf16-mixed"}}, why, expected, 1.8))
    if built.engine.options.compile_scope == "off":
        why = "the model runs eagerly: one kernel per operator"
        expected = "fused kernels, fewer launches: typically 1.1-1.3x after a one-time compilation"
        rules.append(({"compile": {"scope": "model"}}, why, expected, 1.2))
    hints = spec_for(c).speed_hints(c) if built.workload is None else []  # the family's own slow settings
    rules += [(h.settings, h.why, h.gain, h.speedup) for h in hints]
    return [Advice("compute", _flags(s), why, exp, _overall(share, k), s) for s, why, exp, k in rules]


def _copies(built: Built, trace: dict[str, Any], step_ms: float) -> list[Advice]:
    copy_ms = (trace.get("device") or {}).get("h2d_copy_ms", 0.0)
    if not step_ms or copy_ms / step_ms < COPY_SHARE or built.loader_info.get("pin_memory"):
        return []
    settings = {"data": {"pin_memory": True}}
    code = "" if built.workload is None else "DataLoader(..., pin_memory=True)"
    why = f"host-to-device copies take {copy_ms:.2f} ms per step from pageable memory"
    expected = "pinned batches copy asynchronously on a side stream, overlapping compute"
    gain, kept = _overall(copy_ms / step_ms, 3.0), settings if built.workload is None else {}
    return [Advice("copies", _flags(settings, code), why, expected, gain, kept, code)]
