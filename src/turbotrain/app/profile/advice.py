"""From a profiled run's figures to the bottleneck and ranked recommendations.

Each :class:`Advice` is one exact change: config ``settings`` (a flag on the command line, a key
for Python callers; ``--verify`` can apply these) and/or a ``code`` line to change in your
workload (applied by you, so not verified), with why, the expected effect and an estimated
speedup used to rank them. The rules, in the order they are checked:

- data: the host waits on the loader for >= 20% of the step, in the timed and in the profiled
  steps -> more loader workers;
- syncs: host reads of device values every step (the Monitor logging every step, a read in
  your code, the non-finite guard of a non-fused optimizer on CUDA) -> read less often;
- overhead: forward operators so short (on CPU: half the forward's time in operators under 20 us,
  the time-weighted median, so one large matmul among tiny element-wise operators is arithmetic,
  on any CPU; on CUDA: median kernel < 10 us with the GPU idle >= 30% of the time) that
  per-operator cost, not arithmetic, sets the pace, or fewer than 8
  samples per forward accumulated over several micro-batches -> a larger micro-batch (with the
  batch finder keeping the global batch when accumulation allows);
- optimizer: the optimizer step takes >= 15% of the step with a non-fused implementation;
- compute (CUDA): fp32 -> bf16-mixed, compile off -> model, an explicit attention mask -> SDPA;
- copies (CUDA): host-to-device copies >= 10% of the step from unpinned memory -> pin_memory;
- memory and trend (:mod:`.pressure`): a step's peak memory over 80% of the budget, timed steps
  that slow down.

Estimates are rough models (stated in ``expected``); ``--verify`` measures each.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ...base.config import RunConfig, setting
from ...parts.data.loader import default_num_workers
from ...parts.models.registry import spec_for
from ..measure import Built, flat, measure_memory
from .pressure import BOTTLENECKS as PRESSURE
from .pressure import rules as pressure_rules

DATA_SHARE = 0.20
OVERHEAD_OP_US_CPU = 20.0
OVERHEAD_KERNEL_US_CUDA = 10.0
OVERHEAD_IDLE_CUDA = 0.30
OPTIMIZER_SHARE = 0.15
COPY_SHARE = 0.10
SMALL_MICRO = 8  # samples per forward below which accumulating micro-batches is itself the finding
# fixed cost of one operator (dispatch, launch): the overhead model's c
PER_OP_OVERHEAD_US = {
    "cpu": 8.0,
    "cuda": 5.0,
}

BOTTLENECKS = {
    "data": "data loading: the step waits for the next batch",
    "syncs": "host reads of device values every step",
    "overhead": "per-operator overhead: the micro-batch is too small for this machine",
    "optimizer": "the optimizer step",
    "copies": "host-to-device copies",
    "compute": "forward and backward compute",
    **PRESSURE,  # memory, trend: the monitor's rules (pressure.py)
}


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


def _flags(settings: dict[str, dict[str, Any]]) -> str:
    """The settings as the reader writes them: ``--a.b=1 --c.d=2`` on the command line, one
    ``{"a": {"b": 1}, "c": {"d": 2}}`` for a Python caller (see ``config.setting``)."""
    words = [setting(k, v) for k, v in flat(settings).items()]
    if all(w.startswith("--") for w in words):
        return " ".join(words)
    return json.dumps(settings)


def _overall(share: float, local_speedup: float) -> float:
    """Amdahl: the step's speedup when a part taking ``share`` of it gets ``local_speedup`` faster."""
    if local_speedup <= 0:
        return 1.0
    return 1.0 / max((1.0 - share) + share / local_speedup, 1e-9)


def diagnose(
    built: Built, figures: dict[str, Any], trace: dict[str, Any]
) -> tuple[dict[str, str], list[Advice]]:
    """The bottleneck ({"name", "text"}) and the recommendations, best expected first."""
    c, device = built.config, built.engine.device.type
    step_ms = figures["step_ms_median"]
    advice: list[Advice] = []
    advice += _data(built, figures, trace, step_ms)
    advice += _syncs(built, trace, step_ms, device)
    # bigger batches need more data
    if not any(a.category == "data" and a.expected_speedup >= 1.5 for a in advice):
        advice += _overhead(built, c, trace, device)
    advice += _optimizer(built, c, trace)
    if device == "cuda":
        advice += _compute_cuda(built, c, trace)
        advice += _copies(built, trace, step_ms)
    advice += [
        Advice(**f) for f in pressure_rules(built, figures, lambda: measure_memory(built))
    ]  # memory, trend
    advice.sort(key=lambda a: -a.expected_speedup)
    if advice:
        # a step that waits on its loader is data-bound (the regime's word) whatever advice ranks first
        name = "data" if any(a.category == "data" for a in advice) else advice[0].category
    else:
        phases = trace["phases"]
        top = max(phases, key=lambda p: phases[p]["share"])
        name = {"data": "data", "optimizer": "optimizer", "hooks": "syncs", "other": "overhead"}.get(
            top, "compute"
        )
    return {"name": name, "text": BOTTLENECKS[name]}, advice


def _is_preset(built: Built) -> bool:
    return built.workload is None


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
        return [
            Advice(
                "data",
                "load batches in a torch DataLoader with workers",
                why,
                "batches prepared in parallel while the model trains",
                _overall(share, 2.0),
                code="train_loader=DataLoader(dataset, batch_size=..., num_workers=4, persistent_workers=True)",
            )
        ]
    if workers >= max(cores, 8):
        return [
            Advice(
                "data",
                "make reading a sample cheaper (decode once and cache, smaller files, a faster format)",
                why + f" with {workers} workers already",
                "as much as the read gets faster",
                _overall(share, 1.5),
                code="your Dataset.__getitem__",
            )
        ]
    n = max(2, min(8, cores)) if workers == 0 else min(2 * workers, max(cores, 8))
    compute = max(step_ms - wait, 1e-3)
    new_step = max(compute, wait * (workers or 1) / n)  # workers load ahead while the step computes
    settings = {"data": {"num_workers": n}}
    code = "" if _is_preset(built) else f"DataLoader(..., num_workers={n}, persistent_workers=True)"
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
    return [
        Advice(
            "data",
            _flags(settings) + (f" (in your code: {code})" if code else ""),
            why + f" with {workers} loader workers",
            expected,
            speedup,
            settings,
            code,
        )
    ]


def _syncs(built: Built, trace: dict[str, Any], step_ms: float, device: str) -> list[Advice]:
    out: list[Advice] = []
    sources = trace["syncs"]["sources"]
    hooks_ms = trace["phases"]["hooks"]["host_ms"] * step_ms / max(trace["profiled_step_ms"], 1e-9)
    log_every = built.config.monitor.log_every
    monitor = sum(s["per_step"] for s in sources if s["kind"] == "monitor")
    idle = trace.get("device", {}).get("idle_share", 0.0)
    if monitor >= 0.5 and log_every < 10:
        saved = hooks_ms * (1 - log_every / 10)
        gain = step_ms / max(step_ms - saved, 1e-9)
        if device == "cuda":
            gain = max(gain, _overall(idle, 2.0))
        settings: dict[str, dict[str, Any]] = {"monitor": {"log_every": 10}}
        out.append(
            Advice(
                "syncs",
                _flags(settings),
                f"the Monitor reads the loss on the host and writes a record every {log_every} step(s) "
                f"({monitor:.1f} read(s)/step; its hook takes {hooks_ms:.2f} ms of the {step_ms:.2f} ms step)"
                + (f"; the GPU is idle {idle:.0%} of the window" if device == "cuda" else ""),
                f"a record every 10 steps saves ~{saved:.2f} ms per step (~{gain:.2f}x)"
                + ("; on a GPU each read also drains the queue" if device != "cuda" else ""),
                gain,
                settings,
            )
        )
    for s in sources:
        if s["kind"] == "user" and s["per_step"] >= 1:
            gain = _overall(idle, 2.0) if device == "cuda" else 1.0
            shape = "data-dependent" in s.get("what", "")
            out.append(
                Advice(
                    "syncs",
                    f"{s['where']}: "
                    + (
                        "give the operation its output size"
                        if shape
                        else "keep the value on the device and read it every N steps"
                    ),
                    f"{s['where']} makes the host wait for the device {s['per_step']:.0f} time(s) per step: "
                    f"{s.get('what') or 'a read of a tensor value'}"
                    + (f" in `{s['code']}`" if s.get("code") else ""),
                    "on a GPU each read makes the host wait until the queue drains, leaving the GPU idle while the "
                    "next step is enqueued"
                    + ("" if device == "cuda" else "; on CPU there is no queue, so it costs little here"),
                    gain,
                    code=f"{s['where']}: "
                    + (
                        "give the shape up front (torch.nonzero_static(x, size=...), torch.where(mask, x, 0) "
                        "instead of x[mask], repeat_interleave(..., output_size=...))"
                        if shape
                        else "accumulate on the device (total += loss.detach()) and call .item() every 100 steps, "
                        "or let turbotrain's Monitor log the loss (monitor.log_every)"
                    ),
                )
            )
    guard = sum(s["per_step"] for s in sources if s["kind"] == "guard")
    if device == "cuda" and guard >= 1 and built.config.optim.implementation != "fused":
        settings = {"optim": {"implementation": "fused"}}
        out.append(
            Advice(
                "syncs",
                _flags(settings)
                if built.workload is None or built.workload.optimizer is None
                else "torch.optim.AdamW(..., fused=True)",
                f"the optimizer cannot skip a non-finite step on the GPU, so every step reads the finite flag on the host ({guard:.0f}/step)",
                "a fused optimizer skips inside its kernel: no per-step sync",
                max(_overall(idle, 2.0), 1.02),
                settings if built.workload is None or built.workload.optimizer is None else {},
                ""
                if built.workload is None or built.workload.optimizer is None
                else "torch.optim.AdamW(..., fused=True)",
            )
        )
    return out


def _overhead(built: Built, c: RunConfig, trace: dict[str, Any], device: str) -> list[Advice]:
    dev = trace.get("device")
    micro, acc = built.micro, built.engine.accumulation
    if device == "cuda" and dev:
        op_us, idle = dev["kernel_median_us"], dev["idle_share"]
        small = op_us < OVERHEAD_KERNEL_US_CUDA and idle >= OVERHEAD_IDLE_CUDA
    else:
        op_us = trace.get("forward_op_time_median_us")  # where the time goes, not the count of tiny operators
        small = op_us is not None and op_us < OVERHEAD_OP_US_CPU
    # Accumulating tiny micro-batches is a sign on any machine: the finder only raises it if it fits.
    if not (small or (acc > 1 and micro < SMALL_MICRO)) or op_us is None:
        return []
    phases = trace["phases"]
    share = sum(phases[p]["share"] for p in ("forward", "backward", "other"))
    overhead_us = min(PER_OP_OVERHEAD_US.get(device, 8.0), 0.9 * op_us)
    what = (
        "the median kernel takes"
        if device == "cuda" and dev
        else "half the forward's time goes to operators of at most"
    )
    why = (
        f"{micro} sample(s) per forward pass: {what} {op_us:.1f} us, "
        f"close to the ~{overhead_us:.0f} us every operator costs whatever its size"
    )
    if _is_preset(built) and acc > 1:
        k = acc
        settings = {"batch": {"micro": "auto", "global_size": micro * acc}}
        change = _flags(settings)
        effect = f"the batch finder picks the largest micro-batch that fits and keeps the global batch {micro * acc} (same math)"
    else:
        k = 4
        settings = {"batch": {"micro": micro * k}}
        change = (
            _flags(settings)
            if _is_preset(built)
            else (_flags(settings) + f" (in your code: DataLoader(..., batch_size={micro * k}))")
        )
        effect = (
            f"the global batch grows {k}x ({micro * acc} -> {micro * acc * k}): the math changes, so scale "
            "optim.lr with it (linear rule) and compare the loss"
        )
    # per-op time t = c + s*b: fewer, larger operators
    local = op_us / (overhead_us / k + (op_us - overhead_us))
    gain = _overall(share, local)
    return [
        Advice(
            "overhead",
            change,
            why,
            f"{effect}; about {gain:.1f}x samples/s if the model is overhead-bound",
            gain,
            settings if _is_preset(built) or built.loader_info.get("num_workers") is not None else {},
            "" if _is_preset(built) else f"DataLoader(..., batch_size={micro * k})",
        )
    ]


def _optimizer(built: Built, c: RunConfig, trace: dict[str, Any]) -> list[Advice]:
    share = trace["phases"]["optimizer"]["share"]
    own = built.workload is not None and built.workload.optimizer is not None
    impl = c.optim.implementation
    if share < OPTIMIZER_SHARE or (not own and impl == "fused"):
        return []
    why = f"the optimizer step takes {share:.0%} of the step"
    expected = "one fused kernel over all parameters instead of one (or a few) per tensor: about half the optimizer's time"
    gain = _overall(share, 2.0)
    if own:
        return [
            Advice(
                "optimizer",
                "torch.optim.AdamW(..., fused=True) in your workload",
                why,
                expected,
                gain,
                code="optimizer=torch.optim.AdamW(model.parameters(), ..., fused=True)",
            )
        ]
    settings = {"optim": {"implementation": "fused"}}
    return [
        Advice(
            "optimizer",
            _flags(settings),
            why + f" ({setting('optim.implementation', impl)})",
            expected,
            gain,
            settings,
        )
    ]


def _compute_cuda(built: Built, c: RunConfig, trace: dict[str, Any]) -> list[Advice]:
    phases = trace["phases"]
    share = phases["forward"]["share"] + phases["backward"]["share"]
    out: list[Advice] = []
    if share < 0.4:
        return out
    if built.engine.precision.name == "fp32":
        settings = {"precision": {"mode": "bf16-mixed"}}
        out.append(
            Advice(
                "compute",
                _flags(settings),
                f"forward and backward take {share:.0%} of the step in fp32",
                "bf16 tensor-core matmuls: up to ~2x on the matmul-bound part (the loss changes within rounding)",
                _overall(share, 1.8),
                settings,
            )
        )
    if built.engine.options.compile_scope == "off":
        settings = {"compile": {"scope": "model"}}
        out.append(
            Advice(
                "compute",
                _flags(settings),
                "the model runs eagerly: one kernel per operator",
                "fused kernels, fewer launches: typically 1.1-1.3x after a one-time compilation",
                _overall(share, 1.2),
                settings,
            )
        )
    hints = spec_for(c).speed_hints(c) if _is_preset(built) else []  # the family's own slow settings
    out += [
        Advice("compute", _flags(h.settings), h.why, h.gain, _overall(share, h.speedup), h.settings)
        for h in hints
    ]
    return out


def _copies(built: Built, trace: dict[str, Any], step_ms: float) -> list[Advice]:
    dev = trace.get("device") or {}
    copy_ms = dev.get("h2d_copy_ms", 0.0)
    if not step_ms or copy_ms / step_ms < COPY_SHARE or built.loader_info.get("pin_memory"):
        return []
    settings = {"data": {"pin_memory": True}}
    code = "" if _is_preset(built) else "DataLoader(..., pin_memory=True)"
    return [
        Advice(
            "copies",
            _flags(settings) + (f" (in your code: {code})" if code else ""),
            f"host-to-device copies take {copy_ms:.2f} ms per step from pageable memory",
            "pinned batches copy asynchronously on a side stream, overlapping compute",
            _overall(copy_ms / step_ms, 3.0),
            settings if _is_preset(built) else {},
            code,
        )
    ]
