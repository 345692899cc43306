"""The run config's own sections: one frozen dataclass per concern of the run itself, each field
documented with its unit and range, and the rules that span their fields (:func:`check_run`).
What a plugin owns (a model family's fields, ``precision.fp8_*``) is declared in the plugin's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config_fields import (
    AUTO,
    MAX_BATCH,
    MAX_SEED,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    PRECISION_CHOICES,
    Names,
    choice_error,
    knob,
    setting,
)
from .errors import ConfigError
from .storage import check_uri

if TYPE_CHECKING:  # the run config collects these sections; the rules below read it
    from .config import RunConfig

# The valid-value lists of these sections, once: consumers import them; nothing else spells them out.
ARCHS = Names()  # the model families, filled by turbotrain.parts.models.registry.register_family
TOKENIZERS = ("bytes", "bpe")  # or the path of a tokenizer.json
BATCH_PICKS = ("largest", "fastest")
SCHEDULES = ("cosine", "linear", "constant", "plateau")
LR_SCALINGS = ("none", "linear", "sqrt")
DATA_BATCHINGS = ("windows", "tokens")
OPTIM_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
NONFINITE_POLICIES = ("skip", "fallback", "stop")
COMPILE_SCOPES = ("off", "model", "blocks")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that turn on triton.cudagraphs
CHECKPOINTING_MODES = ("off", "full", "selective")
OOM_POLICIES = ("halve", "stop")
DIST_STRATEGIES = ("single", "ddp", "fsdp")
BEST_MODES = ("min", "max")  # best.mode: lower or higher is better
CHOOSE_MODES = (AUTO, "always", "off")


@dataclass(frozen=True)
class RunSection:
    name: str = knob("", "run directory name under out_dir; empty = '<preset>-<timestamp>'")
    out_dir: str = knob("runs", "folder that holds run directories")
    device: str = knob(AUTO, "'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'")
    seed: int = knob(1337, "seed for weights, data order and dropout", min=0, max=MAX_SEED)
    deterministic: bool = knob(
        False,
        "deterministic kernels: torch.use_deterministic_algorithms(True), cuDNN deterministic "
        "without autotuning (overrides precision.cudnn_benchmark), CUBLAS_WORKSPACE_CONFIG=:4096:8; "
        "costs speed (some kernels slower) and ops without a deterministic kernel raise an error",
    )
    remote: str = knob(
        "",
        "a store the run's checkpoints and records are mirrored to, as <remote>/<run name>/ "
        "(s3://BUCKET/PREFIX, gs://, az://, file:///PATH; credentials from the back-end's environment); "
        "'' none. pip install 'turbotrain[s3]' (or [gcs], [azure])",
    )


@dataclass(frozen=True)
class ModelConfig:
    """Which model: a registered family (``arch``, which adds its own fields here or a section of
    its own: ``[moe]``) or your own (``workload``)."""

    arch: str = knob("gpt", "model family", choices=ARCHS)
    workload: str = knob(
        "",
        "your own model and data instead: FILE.py:FUNC or package.module:FUNC returning a "
        "turbotrain.Workload (`turbotrain train --model`); the GPT fields below and [moe] are then unused",
    )


@dataclass(frozen=True)
class DataConfig:
    path: str = knob(
        "", "token .bin file, text file or folder; empty = built-in corpus (Python stdlib sources)"
    )
    val_fraction: float = knob(0.05, "share of the data held out for validation (0..0.5)", min=0.0, max=0.5)
    cache_dir: str = knob(
        "", "where tokenized text (and trained tokenizers) are cached; empty = $XDG_CACHE_HOME/turbotrain"
    )
    tokenizer: str = knob(
        "bytes",
        "text to tokens: 'bytes' (256 ids), 'bpe' (a byte-level BPE of model.vocab_size tokens, "
        "50304 when 0, trained offline on the training text and cached) or the path of a tokenizer.json; "
        "subword tokens need pip install 'turbotrain[bpe]'",
    )
    num_workers: int = knob(
        -1, "DataLoader worker processes; -1 = from the core count and device", min=-1, max=256
    )
    prefetch_factor: int = knob(4, "batches each worker keeps ready", min=1, max=256)
    pin_memory: bool = knob(True, "page-locked host batches (CUDA only) so copies can be asynchronous")
    device_prefetch: bool = knob(True, "copy the next batch to the device on a side stream (CUDA only)")
    tune_user_loader: bool = knob(
        False,
        "engine.setup replaces a torch DataLoader you pass with one like it using "
        "num_workers (persistent), pin_memory and prefetch_factor from this section",
    )
    batching: str = knob(
        "windows",
        "'windows' (batch.micro random block_size windows of the token stream) or 'tokens' "
        "(one document, or piece of one, per row; batches of at most batch.max_tokens tokens, length-bucketed)",
        choices=DATA_BATCHINGS,
    )


@dataclass(frozen=True)
class BatchConfig:
    micro: int | str = knob(
        32,
        "sequences per forward/backward, or 'auto' to search the largest that fits (on CPU: "
        "the largest whose measured step takes at most 1 s)",
        min=1,
        max=MAX_BATCH,
    )
    accumulation: int = knob(
        1, "micro-batches per optimizer step (global = micro x accumulation x world)", min=1, max=MAX_BATCH
    )
    pick: str = knob(
        "largest", "with micro='auto': 'largest' size that fits or 'fastest' measured", choices=BATCH_PICKS
    )
    headroom: float = knob(
        0.10, "with micro='auto': memory kept free, as a fraction of the measured peak", min=0.0, below=1.0
    )
    max_memory_gib: float = knob(
        0.0, "with micro='auto': memory cap in GiB (0 = the whole device)", min=0.0, max=2.0**20
    )
    max_memory_fraction: float = knob(
        0.0, "with micro='auto': memory cap as a fraction of the device's total (0 = none)", min=0.0, max=1.0
    )
    global_size: int = knob(
        0,
        "sequences per optimizer step over all ranks, kept by setting accumulation (a numeric micro: must divide by micro x world); 0 = micro x accumulation x world",
        min=0,
        max=MAX_BATCH,
    )
    max_tokens: int = knob(
        0,
        "with data.batching='tokens': input tokens per micro-batch, padding counted (>= model.block_size); "
        "0 = micro x model.block_size",
        min=0,
        max=2**30,
    )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = knob(2e-3, "peak learning rate", min=0.0, max=1000.0)
    min_lr: float = knob(2e-4, "learning rate at the end of the decay", min=0.0, max=1000.0)
    weight_decay: float = knob(
        0.1, "AdamW decoupled weight decay (not applied to norms, biases, embeddings)", min=0.0, max=100.0
    )
    beta1: float = knob(0.9, "AdamW beta1", min=0.0, below=1.0)
    beta2: float = knob(0.95, "AdamW beta2", min=0.0, below=1.0)
    eps: float = knob(1e-8, "AdamW epsilon", min=0.0, max=1.0)
    warmup_steps: int | str = knob(
        AUTO,
        "linear warmup length in optimizer steps, or 'auto': 10% of the run's steps, at most 30 "
        "(30 for a run of 300 steps or more, 2 for 20)",
        min=0,
        max=MAX_STEPS,
    )
    schedule: str = knob(
        "cosine",
        "after warmup: 'cosine' or 'linear' decay to min_lr at train.max_steps, 'constant', or "
        "'plateau' (lowered by plateau_factor when the validation loss stops improving)",
        choices=SCHEDULES,
    )
    plateau_factor: float = knob(
        0.5, "schedule 'plateau': multiplier of the LR at each lowering, in (0, 1)", min=0.0, max=1.0
    )
    plateau_patience: int = knob(
        2,
        "schedule 'plateau': evaluations after warmup without improvement (relative 1e-4) "
        "before the LR is lowered",
        min=0,
        max=MAX_STEPS,
    )
    lr_scaling: str = knob(
        "none",
        "when batch.micro='auto' changes the global batch: scale lr and min_lr by new/old "
        "('linear'), its square root ('sqrt'), or not at all ('none')",
        choices=LR_SCALINGS,
    )
    lr_batch: int = knob(
        0,
        "global batch (sequences per optimizer step) that lr was tuned for, the 'old' of lr_scaling; "
        "0 = batch.global_size",
        min=0,
        max=MAX_BATCH,
    )
    # any finite norm clips; 1e30 leaves headroom below float32 overflow
    grad_clip: float = knob(
        0.0,
        "max global gradient norm, applied after unscaling; 0 = off (the presets use 1.0)",
        min=0.0,
        max=1e30,
    )
    implementation: str = knob(
        AUTO,
        "'auto' (fused where torch has the kernel: CUDA, CPU; else foreach), 'fused', 'foreach', 'for-loop'",
        choices=(AUTO, *OPTIM_IMPLEMENTATIONS),
    )
    tune_user_optimizer: bool = knob(
        False,
        "engine.setup switches a torch.optim.Adam/AdamW you pass to the fused kernel "
        "(foreach where there is none), in place: same object, hyper-parameters and state",
    )


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = knob(
        300, "optimizer steps of the whole run; the LR schedule spans them", min=1, max=MAX_STEPS
    )
    epochs: int = knob(
        0,
        "passes over the training data instead of max_steps (steps = epochs x the data's steps per "
        "epoch at the global batch; the schedule follows); validation then runs at each epoch's end "
        "and eval_every is unused; 0 = train.max_steps",
        min=0,
        max=100_000,
    )
    stop_after_steps: int = knob(
        0,
        "end this invocation after this step (checkpointed; resume with --resume); 0 = run to max_steps",
        min=0,
        max=MAX_STEPS,
    )
    eval_every: int = knob(
        100, "optimizer steps between validation passes; 0 = only at the end", min=0, max=MAX_STEPS
    )
    eval_batches: int = knob(20, "micro-batches per validation pass", min=1, max=10_000)
    checkpoint_every: int = knob(
        100, "optimizer steps between checkpoints; 0 = only at the end", min=0, max=MAX_STEPS
    )
    keep_last: int = knob(3, "checkpoints kept on disk", min=1, max=100_000)
    async_checkpoint: bool = knob(
        True,
        "write the checkpoints of train.checkpoint_every in the background: the step "
        "waits only for a copy of the state (device -> host); the final one and a "
        "signal's wait for it",
    )


@dataclass(frozen=True)
class BestConfig:
    """The validation metric a run watches for its best evaluation: early stopping and the best
    checkpoint (:mod:`turbotrain.loop.early_stop`)."""

    metric: str = knob(
        "val_loss",
        "the validation metric watched: val_loss, or val_<name> for a metric <name> of the "
        "workload's metrics_fn (val_accuracy)",
    )
    mode: str = knob(
        "min", "min: lower is better (a loss); max: higher is better (an accuracy)", choices=BEST_MODES
    )
    min_delta: float = knob(
        0.0,
        "the smallest change of best.metric, in its own units, that counts as an improvement",
        min=0.0,
        max=1e12,
    )
    patience: int = knob(
        0,
        "early stopping: end the run after this many validation passes in a row without an "
        "improvement (the summary's stop_reason says so); 0 = never",
        min=0,
        max=100_000,
    )
    checkpoint: bool = knob(
        False,
        "keep the checkpoint of the best validation pass in checkpoints/best/ beside the last "
        "train.keep_last (never pruned); turbotrain sample --best and load_best_weights read it",
    )


@dataclass(frozen=True)
class PrecisionConfig:
    """The precision switches every mode shares; a precision's own fields join this section when
    its class registers (fp8's ``fp8_*``: :class:`turbotrain.core.precision.fp8.FP8Settings`)."""

    mode: str = knob(
        AUTO,
        "'auto' (bf16-mixed on CUDA cc>=8.0, fp16-mixed below, fp32 on CPU; never fp8) or a registered "
        "precision's name; 'fp8' (bf16 autocast + torchao float8 linears) needs pip install 'turbotrain[fp8]'",
        choices=PRECISION_CHOICES,
    )
    tf32: bool = knob(True, "TF32 tensor-core matmuls and convolutions for fp32 work (CUDA)")
    cudnn_benchmark: bool = knob(True, "let cuDNN time its kernels for fixed input shapes (CUDA)")
    flush_denormal: bool = knob(
        True, "flush fp32 denormals to zero on CPU: denormal arithmetic made the first steps ~35% slower"
    )
    nonfinite: str = knob(
        "fallback",
        "on non-finite loss/grad: 'skip' the step, skip then 'fallback' to a safer precision, or 'stop'",
        choices=NONFINITE_POLICIES,
    )
    max_nonfinite_steps: int = knob(3, "skipped steps before 'fallback' or 'stop' acts", min=1, max=MAX_STEPS)


@dataclass(frozen=True)
class CompileConfig:
    scope: str = knob(
        AUTO,
        "'auto' (model on CUDA, off on CPU), 'off', 'model' or 'blocks' (each block separately)",
        choices=(AUTO, *COMPILE_SCOPES),
    )
    mode: str = knob("default", "torch.compile mode", choices=COMPILE_MODES)
    max_recompiles: int = knob(
        2,
        "recompilations (and new graph breaks) after the first monitor.log_every steps "
        "before a warning naming the cause; 0 = never warn (they are counted in the summary anyway)",
        min=0,
        max=1_000_000,
    )
    cuda_graphs: bool = knob(
        False,
        "capture each optimizer step (forward, backward, optimizer step) as one CUDA graph and replay it: "
        "less launch overhead for small static-shape steps; refused in one line where it cannot be safe "
        "(CPU, dynamic shapes, a host sync in the step) and the run goes on without",
    )


@dataclass(frozen=True)
class MemoryConfig:
    checkpointing: str = knob("off", "activation checkpointing per block", choices=CHECKPOINTING_MODES)
    on_oom: str = knob(
        "halve",
        "on out-of-memory mid-run: 'halve' the micro-batch and retry, or 'stop'",
        choices=OOM_POLICIES,
    )
    max_fraction: float = knob(
        0.0,
        "CUDA: cap this process's GPU memory at this fraction of the device "
        "(torch.cuda.set_per_process_memory_fraction; allocations past it are out-of-memory errors, "
        "memory.on_oom applies; batch.micro='auto' searches under it); 0 = no cap; no effect on CPU",
        min=0.0,
        max=1.0,
    )


@dataclass(frozen=True)
class MonitorConfig:
    log_every: int = knob(
        10,
        "optimizer steps between metric and non-finite-guard reads (the only host-device syncs with a fused optimizer)",
        min=1,
        max=MAX_STEPS,
    )
    progress: bool = knob(True, "show a live progress bar")
    memory_every: int = knob(
        -1,
        "optimizer steps between GPU memory records (allocated, reserved, peak; allocator counters, "
        "no sync); -1 = in each metrics record (log_every), 0 = off",
        min=-1,
        max=MAX_STEPS,
    )
    memory_warn_fraction: float = knob(
        0.9,
        "warn once (log line, metrics.jsonl memory_warning, summary.json event) when the "
        "peak reserved GPU memory passes this fraction of the device, or of memory.max_fraction's "
        "cap when set; 0 = never",
        min=0.0,
        max=1.0,
    )
    grad_norm: bool = knob(
        False,
        "compute the global gradient norm every optimizer step (engine.last_grad_norm, logged as grad_norm) even without clipping: one extra reduction per step",
    )
    nvml: bool = knob(True, "sample GPU utilisation, power and temperature with NVML on a background thread")
    tensorboard: bool = knob(False, "also log to TensorBoard (needs the tensorboard package)")
    # the experiment trackers (loop/monitor/trackers.py) and the low-utilisation warning (monitor's)
    wandb: bool = knob(
        False, "also log to Weights & Biases (pip install 'turbotrain[wandb]'); offline by default"
    )
    wandb_mode: str = knob(
        "offline",
        "'offline' (written under RUN/wandb, no network; `wandb sync` uploads it) or 'online'",
        choices=("offline", "online"),
    )
    mlflow: bool = knob(False, "also log to MLflow (pip install 'turbotrain[mlflow]')")
    mlflow_uri: str = knob(
        "", "MLflow tracking URI; '' = $MLFLOW_TRACKING_URI, else sqlite:///<run.out_dir>/mlflow.db"
    )
    trackio: bool = knob(
        False, "also log to trackio (pip install 'turbotrain[trackio]'); its store is $TRACKIO_DIR"
    )
    project: str = knob("turbotrain", "the W&B project, MLflow experiment and trackio project runs log to")
    util_warn_pct: float = knob(
        80.0,
        "warn once (log line, metrics.jsonl gpu_util_warning, summary.json event) when NVML's GPU "
        "utilisation stays under this many percent for monitor.util_warn_s; 0 = never",
        min=0.0,
        max=100.0,
    )
    util_warn_s: float = knob(
        120.0, "seconds of training under monitor.util_warn_pct before the warning", min=1.0, max=86400.0
    )


@dataclass(frozen=True)
class DistributedConfig:
    strategy: str = knob(
        AUTO,
        "'auto' (ddp under torchrun with 2+ processes, else single), 'single', 'ddp' or 'fsdp' (FSDP2)",
        choices=(AUTO, *DIST_STRATEGIES),
    )
    bucket_cap_mb: int = knob(
        25, "ddp: gradient bucket size in MiB (larger: fewer, bigger all-reduces)", min=1, max=2**20
    )
    static_graph: bool = knob(
        False, "ddp: the same parameters get gradients every step (lets DDP skip bookkeeping)"
    )
    gradient_as_bucket_view: bool = knob(
        True, "ddp: gradients live in the communication buckets (no copy, less memory)"
    )
    reshard_after_forward: bool = knob(
        True, "fsdp: free gathered parameters after forward (less memory, one more all-gather in backward)"
    )
    expert_parallel: int = knob(
        1,
        "ranks each MoE block's experts are spread over (divides the world size and the experts per block: moe.n_experts, or your MoE layers'); 1 = every rank holds all",
        min=1,
        max=4096,
    )
    timeout_s: float = knob(
        300.0,
        "seconds a collective waits for the other ranks before the run stops with an error",
        min=1.0,
        max=MAX_TIMEOUT_S,
    )


@dataclass(frozen=True)
class ChooseConfig:
    """How ``turbotrain train`` measures the settings left at ``auto`` (:mod:`turbotrain.app.choose`)."""

    measure: str = knob(
        AUTO,
        "settings left at 'auto' (compile.scope, precision.mode) chosen by timing candidates on your model "
        "before a new run trains (turbotrain train): 'auto' when the planned run is long enough to pay for it, "
        "'always', or 'off' (fixed rules)",
        choices=CHOOSE_MODES,
    )
    budget: float = knob(
        0.05,
        "measuring may cost at most this fraction of the planned run's time in eager",
        min=0.001,
        max=1.0,
    )
    warmup: int = knob(3, "untimed steps per candidate (compilation happens here)", min=1, max=1000)
    steps: int = knob(10, "timed steps per candidate (the median counts)", min=2, max=10_000)
    min_speedup: float = knob(
        1.03, "a candidate must be this many times faster than plain eager to be kept", min=1.0, max=100.0
    )


def check_run(config: RunConfig) -> None:
    """The rules that span fields of the run's own sections."""
    _check_run_section(config)
    _check_schedule(config)
    _check_batching(config)
    _check_best(config)


def _check_run_section(config: RunConfig) -> None:
    device = config.run.device
    if device not in (AUTO, "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise choice_error("run.device", device, (AUTO, "cpu", "cuda", "cuda:N"))
    name = config.run.name
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ConfigError(
            f"run.name = {name!r} must be one folder name (no '/', not '..'); to group runs, "
            f"use {setting('run.out_dir', 'runs/GROUP')} with {setting('run.name', 'NAME')}"
        )
    if config.run.remote:
        check_uri(config.run.remote)  # the scheme, and its back-end installed
    for where, value, low in (
        ("optim.warmup_steps", config.optim.warmup_steps, 0),
        ("batch.micro", config.batch.micro, 1),
    ):
        if isinstance(value, str) and value != AUTO:
            raise ConfigError(f"{where} = {value!r} is not valid; use a whole number >= {low} or 'auto'")
    if config.data.tokenizer not in TOKENIZERS and not config.data.tokenizer.endswith(".json"):
        raise choice_error("data.tokenizer", config.data.tokenizer, (*TOKENIZERS, "PATH/tokenizer.json"))


def _check_schedule(config: RunConfig) -> None:
    if config.optim.min_lr > config.optim.lr:
        raise ConfigError(
            f"optim.min_lr = {config.optim.min_lr} must not exceed optim.lr = {config.optim.lr}"
        )
    if config.optim.schedule == "plateau":
        if not 0.0 < config.optim.plateau_factor < 1.0:
            raise ConfigError(
                f"optim.plateau_factor = {config.optim.plateau_factor} must be in (0, 1), "
                f"e.g. {setting('optim.plateau_factor', 0.5)}"
            )
        if config.train.eval_every == 0:
            raise ConfigError(
                "optim.schedule = 'plateau' lowers the LR from validation losses, which "
                f"train.eval_every = 0 only computes at the end; use {setting('train.eval_every', 100)}"
            )
    if (
        config.optim.lr_scaling != "none"
        and config.batch.micro == AUTO
        and not config.optim.lr_batch
        and not config.batch.global_size
    ):
        raise ConfigError(
            f"optim.lr_scaling = {config.optim.lr_scaling!r} needs the global batch optim.lr was tuned for: "
            f"set {setting('optim.lr_batch', 32)} (or {setting('batch.global_size', 32)})"
        )


def _check_batching(config: RunConfig) -> None:
    if config.data.batching == "tokens":
        if config.batch.micro == AUTO:
            raise ConfigError(
                "batch.micro = 'auto' searches a number of rows; data.batching = 'tokens' sizes batches in "
                f"tokens: set {setting('batch.max_tokens', 4096)} with a number for batch.micro, or "
                f"{setting('data.batching', 'windows')}"
            )
        if config.compile.mode in CUDA_GRAPH_MODES:
            raise ConfigError(
                f"compile.mode = {config.compile.mode!r} uses CUDA graphs, which record one graph (and its memory) "
                "per batch shape, and data.batching = 'tokens' makes a new shape for most batches; use "
                f"{setting('compile.mode', 'default')} or {setting('data.batching', 'windows')}"
            )
    if config.compile.mode == "reduce-overhead" and config.batch.accumulation > 1:
        raise ConfigError(
            "compile.mode = 'reduce-overhead' uses CUDA graphs, which re-record under gradient accumulation; "
            f"use {setting('compile.mode', 'default')} or {setting('batch.accumulation', 1)}"
        )


def _check_best(config: RunConfig) -> None:
    """The watched metric is a validation metric, and what watches it gets validation passes during the run."""
    b = config.best
    if not b.metric.startswith("val_") or b.metric == "val_":
        raise ConfigError(
            f"best.metric = {b.metric!r} is not a validation metric: use val_loss or val_<name> for a "
            f"metric of your metrics_fn, e.g. {setting('best.metric', 'val_accuracy')}"
        )
    t = config.train
    if (b.patience or b.checkpoint) and t.eval_every == 0 and not t.epochs:
        what = f"best.patience = {b.patience}" if b.patience else "best.checkpoint = true"
        raise ConfigError(
            f"{what} watches validation passes, which train.eval_every = 0 runs only at the end; "
            f"use {setting('train.eval_every', 100)}"
        )
