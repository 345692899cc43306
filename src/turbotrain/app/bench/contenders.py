"""The contenders: what each one is (:data:`CONTENDERS`, read by the parent process) and how each
trains (:data:`TRAINERS`, run in its own process by :mod:`.worker`). Every contender gets the same
:class:`~.protocol.Job` and does what its documentation or its users would do, and nothing more."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...base.batch import move_to
from ...base.config import RunConfig, load_config
from ...base.errors import ConfigError
from ...core.assembly import build_trainable
from ...core.engine import Engine
from ...core.graphs import unavailable as graphs_unavailable
from ...core.optim import resolve_implementation
from ...loop.fit import fit
from ...loop.hooks import FitContext, Hook
from ..measure import merge
from ..prepare import prepare_process
from .handtuned import train_handtuned
from .protocol import Job, make_loader, math_precision
from .workloads import LANGUAGE_MODELS


class SkipContender(Exception):
    """Raised inside a contender process when it cannot run here (the reason is reported)."""


@dataclass(frozen=True)
class Contender:
    """A contender as the parent sees it: name, the packages it needs, its recipe per device."""

    name: str
    title: str
    recipe_cuda: str
    recipe_cpu: str
    requires: tuple[str, ...] = ()
    cuda_only: bool = False
    refused: Callable[[str], str] | None = None  # device type -> why it cannot run there ("" when it can)
    workloads: tuple[str, ...] = ()  # in the default list only for these workload models (all when empty)

    def recipe(self, device_type: str) -> str:
        return self.recipe_cuda if device_type == "cuda" else self.recipe_cpu

    def unavailable(self, device_type: str) -> str | None:
        """Why this contender cannot run here (None when it can)."""
        if self.cuda_only and device_type != "cuda":
            return "CUDA only"
        refused = self.refused(device_type) if self.refused is not None else ""
        if refused:
            return refused
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install {module})"
        return None


CPU_FP32 = "CPU: fp32 like every CPU contender (turbotrain's auto precision is fp32 on CPU)"

PLAIN = "fp32, eager, AdamW (torch default implementation)"
CHOSEN = "Engine + fit, compile and precision as choose decides them for a long run (table in the row)"
# fmt: off
CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender("eager", "plain PyTorch eager fp32", f"{PLAIN}, batch.to(device)", PLAIN),
    Contender("eager-bf16", "plain PyTorch eager bf16",
              "bf16 autocast, eager, AdamW (torch default implementation), batch.to(device)", "", cuda_only=True),
    Contender("handtuned", "hand-tuned plain PyTorch (turbotrain.app.bench.handtuned)",
              "bf16 autocast, torch.compile, fused AdamW, TF32, cuDNN benchmark, SDPA is_causal, "
              "channels_last (CNNs), pinned non_blocking copies",
              "fp32 (auto: bf16 on CUDA only), eager (auto: compile on CUDA only), fused AdamW"),
    Contender("accelerate", "Hugging Face Accelerate",
              'Accelerator(mixed_precision="bf16"); prepare(model, optimizer, dataloader, scheduler)',
              f'Accelerator(mixed_precision="no") - {CPU_FP32}; prepare(...)', requires=("accelerate",)),
    Contender("lightning", "PyTorch Lightning",
              'Trainer(precision="bf16-mixed", gradient_clip_val=1.0); logger, checkpoints, progress bar off',
              f'Trainer(precision="32-true", gradient_clip_val=1.0) - {CPU_FP32}; logger, checkpoints, progress bar off',
              requires=("lightning",)),
    Contender("turbotrain", "turbotrain (defaults)",
              "Engine + fit, defaults: auto precision (bf16-mixed), TF32, compile, fused AdamW, side-stream prefetch",
              "Engine + fit, defaults: auto precision (fp32 on CPU), no compile on CPU, fused AdamW"),
    Contender("turbotrain-auto", "turbotrain, settings chosen by measurement (choose, turbotrain.app.bench.auto)",
              CHOSEN, CHOSEN),
    Contender("turbotrain-graphs", "turbotrain with whole-step CUDA graphs (compile.cuda_graphs)",
              "Engine + fit, defaults + compile.cuda_graphs (each optimizer step captured once, replayed)", "",
              refused=graphs_unavailable, workloads=("cifar",)),
)}
# fmt: on
DEFAULT_ORDER = tuple(CONTENDERS)


def train_eager(job: Job, autocast_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Plain PyTorch: the loop everyone starts from."""
    device, clock = job.device, job.clock
    clock.start()
    model = job.model.to(device)
    opt, sched = job.plain_optimizer(model)
    amp = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype else nullcontext
    clip = job.optim["grad_clip"]
    model.train()
    for batch in make_loader(job.batches):
        batch = move_to(batch, device)
        with amp():
            loss = job.loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        clock.mark(loss)
    return job.plain_result(autocast_dtype)


def train_eager_bf16(job: Job) -> dict[str, Any]:
    if job.device.type != "cuda":
        raise SkipContender("CUDA only")
    return train_eager(job, torch.bfloat16)


def _require(package: str) -> Any:
    """Import an optional package in its contender process (a SkipContender when missing)."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise SkipContender(f"{package} is not installed ({exc})") from None


def train_accelerate(job: Job) -> dict[str, Any]:
    """Accelerate's documented loop: Accelerator(mixed_precision=...), prepare, accelerator.backward."""
    accelerate = _require("accelerate")
    device, clock = job.device, job.clock
    mixed = "bf16" if device.type == "cuda" else "no"
    clock.start()
    accelerator = accelerate.Accelerator(mixed_precision=mixed, cpu=device.type == "cpu")
    opt, sched = job.plain_optimizer(job.model)
    model, opt, loader, sched = accelerator.prepare(job.model, opt, make_loader(job.batches), sched)
    clip = job.optim["grad_clip"]
    model.train()
    for batch in loader:
        loss = job.loss(model, batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        clock.mark(loss)
    return job.plain_result(
        torch.bfloat16 if mixed == "bf16" else None,
        recipe=f'Accelerator(mixed_precision="{mixed}"); prepare(model, optimizer, dataloader, scheduler)'
        + ("" if device.type == "cuda" else f" - {CPU_FP32}"),
        versions={"accelerate": accelerate.__version__},
    )


def train_lightning(job: Job) -> dict[str, Any]:
    """Lightning's documented recipe: a LightningModule and Trainer(precision=...).fit()."""
    L = _require("lightning")
    device, clock = job.device, job.clock
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    lightning_module: Any = L.LightningModule  # imported here: its classes are known at run time only
    lightning_callback: Any = L.Callback

    class Module(lightning_module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return job.loss(self.model, batch)

        def configure_optimizers(self) -> Any:
            opt, sched = job.plain_optimizer(self.model)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Clock(lightning_callback):
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            clock.mark(outputs["loss"] if isinstance(outputs, dict) else outputs)

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*(LeafSpec|tensorboardX|litlogger).*")
    clock.start()
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_steps=job.total_steps,
        gradient_clip_val=job.optim["grad_clip"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
        default_root_dir=str(Path(job.spec["data_file"]).parent / "lightning"),
    )
    trainer.fit(Module(job.model), train_dataloaders=make_loader(job.batches))
    return job.plain_result(
        torch.bfloat16 if precision == "bf16-mixed" else None,
        recipe=f'Trainer(precision="{precision}", gradient_clip_val={job.optim["grad_clip"]}); '
        "logger, checkpoints, progress bar off" + ("" if device.type == "cuda" else f" - {CPU_FP32}"),
        versions={"lightning": L.__version__},
    )


def turbotrain_overrides(
    spec: dict[str, Any], device: torch.device, total_steps: int
) -> dict[str, dict[str, Any]]:
    """turbotrain's config overrides for the workload's recipe on ``device`` (plus a matrix row's)."""
    o = spec["optim"]
    overrides = {
        "run": {"device": device.type, "seed": spec["seed"]},
        "optim": {
            "lr": o["lr"],
            "min_lr": o["lr"],
            "beta1": o["betas"][0],
            "beta2": o["betas"][1],
            "eps": o["eps"],
            "weight_decay": o["weight_decay"],
            "warmup_steps": o["lr_warmup_steps"],
            "schedule": "constant",
            "grad_clip": o["grad_clip"],
        },
        "train": {"max_steps": total_steps},
        "monitor": {"progress": False, "nvml": False},
    }
    return merge(overrides, spec.get("turbotrain_overrides"))


def train_turbotrain(job: Job) -> dict[str, Any]:
    """turbotrain's Engine and reference loop with its defaults (plus a matrix row's overrides)."""
    device, clock, total = job.device, job.clock, job.total_steps
    profiler = Profiler(job, device) if job.spec.get("profile_dir") else None

    class Clock(Hook):
        def on_step_end(self, ctx: FitContext) -> None:
            step = ctx.engine.state.step
            if step <= total:
                clock.mark(ctx.engine.last_loss)
            if step == total and profiler is not None:
                clock.finish()  # the timed window ends here; the profiled steps come after it
                profiler.prof.start()

    try:
        # prepared as every run is: its settings, its plan joined (the model is the bench's own)
        config, plan, _ = prepare_process(
            load_config(overrides=turbotrain_overrides(job.spec, device, total))
        )
        clock.start()
        pin = device.type == "cuda" and config.data.pin_memory and not job.spec.get("resident")
        t = build_trainable(
            config, job.model, max_steps=total, loader=make_loader(job.batches, pin_memory=pin), plan=plan
        )
    except ConfigError as exc:  # e.g. fp16-mixed on CPU, bf16 on a GPU without it
        raise SkipContender(str(exc)) from None
    engine = t.engine
    assert t.loader is not None  # build_trainable was given one
    steps = total + (profiler.steps if profiler else 0)
    fit(engine, t.model, t.optimizer, t.loader, max_steps=steps, hooks=[Clock()], loss_fn=job.loss_fn)
    return _turbotrain_result(job, engine, config, profiler.stop() if profiler else None)


def _turbotrain_result(
    job: Job, engine: Engine, config: RunConfig, profile: dict[str, Any] | None
) -> dict[str, Any]:
    """What the turbotrain row resolved to (precision, compile, optimizer, prefetch), as its recipe."""
    device, p = job.device, engine.precision
    impl = resolve_implementation(config.optim.implementation, engine.device)
    autocast_dtype = getattr(p, "dtype", None)
    compile_desc = engine.options.compile_scope
    if compile_desc != "off" and config.compile.mode != "default":
        compile_desc += f" ({config.compile.mode})"
    cuda = device.type == "cuda"
    prefetch = "side-stream prefetch" if cuda and config.data.device_prefetch else "no prefetch"
    tf32 = ", TF32" if cuda and config.precision.tf32 else ""
    return {
        "precision": p.name,
        "compiled": engine.options.compile_scope != "off",
        "math_precision": math_precision(device, autocast_dtype, p.param_dtype, job.has_conv),
        "recipe": f"Engine + fit: {p.name}{tf32}, compile {compile_desc}, AdamW {impl}, "
        f"attention {job.spec['model']['kwargs'].get('attention', 'sdpa') if job.spec['model']['kind'] in LANGUAGE_MODELS else 'n/a'}, "
        f"{prefetch}",
        "resolved": {"precision": p.name, "compile": compile_desc, "optimizer": impl, "prefetch": prefetch},
        "events": [e.__dict__ for e in engine.events],
        **({"profile": profile} if profile else {}),
    }


class Profiler:
    """``torch.profiler`` over a few steps after the timed window: a gzipped Chrome trace and an op table."""

    def __init__(self, job: Job, device: torch.device) -> None:
        self.steps = int(job.spec.get("profile_steps", 3))
        self.dir = Path(job.spec["profile_dir"])
        self.stem = f"{job.spec['workload']}-turbotrain"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        self.prof = torch.profiler.profile(activities=activities)

    def stop(self) -> dict[str, Any]:
        self.prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace, table = self.dir / f"{self.stem}-trace.json.gz", self.dir / f"{self.stem}-ops.txt"
        self.prof.export_chrome_trace(str(trace))
        table.write_text(self.prof.key_averages().table(sort_by=self.sort, row_limit=40))
        return {"steps": self.steps, "trace": str(trace), "ops_table": str(table)}


TRAINERS: dict[str, Callable[[Job], dict[str, Any]]] = {
    "eager": train_eager,
    "eager-bf16": train_eager_bf16,
    "handtuned": train_handtuned,
    "accelerate": train_accelerate,
    "lightning": train_lightning,
    "turbotrain": train_turbotrain,
}
