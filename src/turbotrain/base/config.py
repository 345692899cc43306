"""Run configuration: one frozen dataclass per concern, composed into :class:`RunConfig`.

Why: every knob is typed, documented (with its unit) and validated once, when the config is built.
Nothing downstream reads raw strings; the engine and the loop receive resolved objects.

Sources, later wins: field defaults < a TOML preset shipped in ``turbotrain/presets`` (or a TOML
file path) < ``--section.key=value`` overrides. Errors name the field and the valid values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

from .errors import ConfigError

AUTO = "auto"

# Every valid-value list, once. Consumers import these; nothing else spells them out.
ARCHS = ("gpt", "moe")
MOE_IMPLS = ("auto", "grouped", "batched", "loop")
ATTENTIONS = ("sdpa", "masked")
LM_LOSSES = ("full", "chunked")
TOKENIZERS = ("bytes", "bpe")  # or the path of a tokenizer.json
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
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
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 scaling recipes


class Names:
    """A valid-value list that grows as plugins register: ``precision.mode``'s names come from the
    precision classes (:mod:`turbotrain.core.precision` fills it on import, which ``import turbotrain``
    does), so validation and ``--help-config`` read it live. ``first`` come before the registered."""

    def __init__(self, *first: str, then: Names | None = None) -> None:
        self._own, self._then = list(first), then

    def add(self, name: str) -> None:
        if name not in self._own:
            self._own.append(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._own
        if self._then is not None:
            yield from self._then

    def __contains__(self, name: object) -> bool:
        return any(name == n for n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(tuple(self))


PRECISION_MODES = Names()  # filled by each Precision subclass's definition (turbotrain.core.precision)
PRECISION_CHOICES = Names(AUTO, then=PRECISION_MODES)


_AUDIENCE = ["python"]  # who reads error messages: "python" (a library caller) or "cli"


@contextlib.contextmanager
def audience(who: str) -> Iterator[None]:
    """Within the block, :func:`setting` speaks to ``who``: "cli" (the ``turbotrain`` command
    wraps each subcommand in this) or "python"."""
    previous, _AUDIENCE[0] = _AUDIENCE[0], who
    try:
        yield
    finally:
        _AUDIENCE[0] = previous


def setting(field_name: str, value: Any) -> str:
    """How the reader sets ``section.key`` to ``value``: ``--run.device=cpu`` on the command line,
    ``{"run": {"device": "cpu"}}`` for a Python caller of ``Engine``/``load_config``."""
    if _AUDIENCE[0] == "cli":
        return f"--{field_name}={value}"
    section, key = field_name.split(".", 1)
    return f"{{{section!r}: {{{key!r}: {value!r}}}}}".replace("'", '"')


def choice_error(field_name: str, value: Any, choices: Iterable[Any]) -> ConfigError:
    """The one wording of "not a valid value": the field, the value and every valid value."""
    return ConfigError(
        f"{field_name} = {value!r} is not valid; choose one of: {', '.join(map(str, choices))}"
    )


# Bounds that come from what the code can do (every numeric field declares a range; validate checks it).
MAX_STEPS = 99_999_999  # checkpoint names hold the step in 8 digits (step_00000003.pt), and sort by them
MAX_TIMEOUT_S = 2_147_483  # the largest whole number of milliseconds a C int holds (2**31 - 1 ms, 24.8 days)
MAX_BATCH = 2**20  # sequences per micro-batch, per optimizer step or in a global batch
MAX_SEED = 2**32 - 1  # numpy's seeds are 32 bits


def knob(
    default: Any,
    doc: str,
    *,
    choices: Iterable[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    below: float | None = None,
) -> Any:
    """A documented config field. A numeric one declares its range: ``min`` <= value <= ``max``
    (or < ``below``, an open end). :func:`validate` checks ``choices`` and the range, and
    :func:`describe` shows them."""
    live = isinstance(choices, Names)  # read at each use: plugins may add values after this field is defined
    meta = {
        "doc": doc,
        "choices": choices if live or choices is None else tuple(choices),
        "min": min,
        "max": below if below is not None else max,
        "open": below is not None,
    }
    return field(default=default, metadata=meta)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else f"{x:g}"


def range_text(f: dataclasses.Field) -> str:
    """A numeric field's declared range, ``[1, 99999999]`` or ``[0, 1)``; "" for other fields."""
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if low is None and high is None:
        return ""
    return f"[{_number(low)}, {_number(high)}{')' if f.metadata.get('open') else ']'}"


def in_range(f: dataclasses.Field, value: float) -> bool:
    """Whether ``value`` lies in field ``f``'s declared range (NaN never does)."""
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if low is not None and not value >= low:
        return False
    if high is not None and not (value < high if f.metadata.get("open") else value <= high):
        return False
    return True


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


@dataclass(frozen=True)
class ModelConfig:
    arch: str = knob("gpt", "model family", choices=ARCHS)
    workload: str = knob(
        "",
        "your own model and data instead: FILE.py:FUNC or package.module:FUNC returning a "
        "turbotrain.Workload (`turbotrain train --model`); the GPT fields below and [moe] are then unused",
    )
    n_layer: int = knob(4, "transformer blocks", min=1, max=1024)
    n_head: int = knob(4, "attention heads per block", min=1, max=1024)
    d_model: int = knob(128, "embedding width (must divide by n_head)", min=1, max=65536)
    block_size: int = knob(128, "sequence length T in tokens", min=2, max=2**20)
    vocab_size: int = knob(
        0,
        "vocabulary size; 0 = follow the data (256 for bytes, 50304 for bpe, a tokenizer.json's "
        "rounded up to a multiple of 64, the .bin's own or 50304)",
        min=0,
        max=2**24,
    )
    dropout: float = knob(0.0, "dropout probability", min=0.0, below=1.0)
    attention: str = knob(
        "sdpa", "'sdpa' (is_causal, flash kernels) or 'masked' (explicit cached mask)", choices=ATTENTIONS
    )
    loss: str = knob(
        "full",
        "'full' (logits, then cross-entropy) or 'chunked' (fused linear + cross-entropy by chunks: "
        "no full logits in memory, same math)",
        choices=LM_LOSSES,
    )
    sdpa_backend: str = knob(
        "auto",
        "SDPA kernel to prefer (falling back to the others): 'auto' = PyTorch's choice, "
        "'cudnn', 'flash', 'efficient' or 'math'",
        choices=SDPA_BACKENDS,
    )


@dataclass(frozen=True)
class MoESection:
    """The mixture-of-experts family's own settings (``model.arch = 'moe'``): the GPT backbone comes
    from ``[model]``, the experts from here. Unused by other families (a ``--moe.*`` flag given for
    one is refused: it would silently do nothing)."""

    n_experts: int = knob(8, "experts per MoE block", min=1, max=4096)
    top_k: int = knob(2, "experts each token is routed to (at most n_experts)", min=1, max=4096)
    every: int = knob(
        1,
        "every k-th block is a MoE block (1 = all, 2 = blocks 2, 4, ...; at most model.n_layer)",
        min=1,
        max=1024,
    )
    expert_hidden: int = knob(0, "hidden width of each expert's MLP; 0 = 4 x model.d_model", min=0, max=2**20)
    aux_loss_coef: float = knob(
        0.01, "weight of the load-balancing loss added to the training loss; 0 = off", min=0.0, max=100.0
    )
    capacity_factor: float = knob(
        0.0,
        "expert slots = factor x tokens x top_k / n_experts, overflow dropped; 0 = dropless",
        min=0.0,
        max=4096.0,
    )
    router_bias_update: float = knob(
        0.0,
        "DeepSeek-V3 aux-loss-free balancing, the expert-bias step per optimizer step; 0 = off",
        min=0.0,
        max=1.0,
    )
    impl: str = knob(
        "auto",
        "expert compute, 'auto' (grouped GEMM on CPU and on CUDA with bf16, else batched), "
        "'grouped', 'batched' or 'loop' (one matmul per expert: the reference)",
        choices=MOE_IMPLS,
    )


MODEL_SECTIONS = ("model", "moe")  # the sections that decide the model's tensors (a checkpoint fits or not)

# Settings that moved out of [model] into their family's section: a file written before the move (a saved
# run's config.toml, a preset) is read with them moved; a new command line or dict that still names the old
# place gets one line naming the new one.
MOVED: dict[str, str] = {
    "model.n_experts": "moe.n_experts",
    "model.top_k": "moe.top_k",
    "model.moe_every": "moe.every",
    "model.expert_hidden": "moe.expert_hidden",
    "model.aux_loss_coef": "moe.aux_loss_coef",
    "model.capacity_factor": "moe.capacity_factor",
    "model.router_bias_update": "moe.router_bias_update",
    "model.moe_impl": "moe.impl",
}


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
    warmup_steps: int = knob(30, "linear warmup length in optimizer steps", min=0, max=MAX_STEPS)
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
class PrecisionConfig:
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
    fp8_emulate: bool = knob(
        False,
        "mode 'fp8': emulate the float8 matmuls (CPU, or a GPU below compute capability 8.9): "
        "for correctness tests only, slower than bf16",
    )
    fp8_recipe: str = knob(
        "tensorwise",
        "mode 'fp8': torchao's scaling recipe, 'tensorwise' (fastest; FSDP2 float8 all-gather) "
        "or 'rowwise' (more accurate)",
        choices=FP8_RECIPES,
    )
    fp8_min_size: int = knob(
        0,
        "mode 'fp8': convert a linear layer (both dims divisible by 16) only if in x out features >= this; "
        "0 = torchao's per-recipe thresholds (measured on H100: small matmuls are slower in fp8)",
        min=0,
        max=2**40,
    )
    fp8_lm_head: bool = knob(False, "mode 'fp8': convert the output layer (lm_head) too")
    fp8_skip: str = knob(
        "",
        "mode 'fp8': comma-separated module-name prefixes kept in bf16, e.g. 'blocks.0.,blocks.11.' "
        "for the first and last block",
    )
    fp8_all_gather: bool = knob(
        False,
        "mode 'fp8' under FSDP2 (distributed.strategy = fsdp): all-gather the float8 layers' "
        "weights in float8 (torchao's enable_fsdp_float8_all_gather: half bf16's bytes, the scales "
        "precomputed in one all-reduce per step); tensorwise recipe only. Off by default, as in "
        "torchtitan: it only pays where the all-gather is exposed (many ranks, large layers) and its "
        "GPU speed is not measured here yet; no effect without FSDP2",
    )


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


@dataclass(frozen=True)
class MemoryConfig:
    checkpointing: str = knob("off", "activation checkpointing per block", choices=CHECKPOINTING_MODES)
    on_oom: str = knob(
        "halve",
        "on out-of-memory mid-run: 'halve' the micro-batch and retry, or 'stop'",
        choices=OOM_POLICIES,
    )
    inject_oom_at_step: int = knob(
        0, "debug: raise an out-of-memory error once at this optimizer step; 0 = never", min=0, max=MAX_STEPS
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
class RunConfig:
    """The whole run. Each attribute is one concern's config; see ``turbotrain train --help-config``."""

    preset: str = knob("gpt-tiny", "the preset this config started from")
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoESection = field(default_factory=MoESection)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with whole sections or ``section={"key": value}`` dicts replaced (validated)."""
        data = self.to_dict()
        for name, value in sections.items():
            if isinstance(value, Mapping) and isinstance(data.get(name), dict):
                data[name].update(value)
            else:
                data[name] = dataclasses.asdict(value) if is_dataclass(value) else value
        return from_dict(data)


SECTIONS: dict[str, type] = {
    f.name: f.default_factory
    for f in fields(RunConfig)
    if f.default_factory is not dataclasses.MISSING  # type: ignore[misc]
}


# ----------------------------------------------------------------------------- presets


def preset_names() -> list[str]:
    """Names of the TOML presets shipped inside the package."""
    folder = resources.files("turbotrain") / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def read_preset(name_or_path: str) -> dict[str, Any]:
    """A preset's raw table: a shipped preset name, or a path to a TOML file."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"preset {name_or_path!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
            ) from None
    else:
        resource = resources.files("turbotrain") / "presets" / f"{name_or_path}.toml"
        if not resource.is_file():
            raise ConfigError(
                f"unknown preset {name_or_path!r}; valid presets: {', '.join(preset_names())} "
                "(or a path to a .toml file)"
            )
        text = resource.read_text()
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"preset {name_or_path!r} is not valid TOML: {exc}") from None
    table.setdefault("preset", path.stem if path.suffix == ".toml" else name_or_path)
    return migrate(table)


def migrate(table: dict[str, Any]) -> dict[str, Any]:
    """A config table written before settings moved (:data:`MOVED`), with them in their new place
    (a value already there wins). Files only: a saved run's config.toml, a preset, a checkpoint's."""
    for old, new in MOVED.items():
        (section, key), (to_section, to_key) = old.split("."), new.split(".")
        if isinstance(table.get(section), dict) and key in table[section]:
            value = table[section].pop(key)
            if isinstance(table.setdefault(to_section, {}), dict):
                table[to_section].setdefault(to_key, value)
    return table


# ----------------------------------------------------------------------------- parsing


def _coerce(section: str, key: str, hint: Any, value: Any) -> Any:
    """Turn ``value`` (from TOML or a command-line string) into the field's type, or raise."""
    where = f"{section}.{key}" if section else key
    allowed = hint.__args__ if hasattr(hint, "__args__") else (hint,)
    if isinstance(value, str):
        text = value.strip()
        if bool in allowed:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        for kind in (int, float):
            if kind in allowed:
                try:
                    return kind(text)
                except ValueError:
                    pass
        if str in allowed:
            return value
    else:
        if bool in allowed and isinstance(value, bool):
            return value
        if isinstance(value, bool):
            pass  # a bool is not an int here
        elif int in allowed and isinstance(value, int):
            return value
        elif float in allowed and isinstance(value, (int, float)):
            return float(value)
        elif str in allowed and isinstance(value, str):
            return value
    names = " or ".join(t.__name__ for t in allowed)
    raise ConfigError(f"{where} must be {names}, got {value!r}")


def _build_section(name: str, cls: type, table: Mapping[str, Any]) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - known)
    moved = [k for k in unknown if f"{name}.{k}" in MOVED]
    if moved:
        new = MOVED[f"{name}.{moved[0]}"]
        raise ConfigError(
            f"{name}.{moved[0]} is now {new} (the family's own section); use {setting(new, table[moved[0]])}"
        )
    if unknown:
        raise ConfigError(
            f"unknown key {name}.{unknown[0]}; valid keys in [{name}]: {', '.join(sorted(known))}"
        )
    values = {k: _coerce(name, k, hints[k], v) for k, v in table.items()}
    return cls(**values)


def from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from nested tables (as TOML gives them)."""
    unknown = sorted(set(data) - set(SECTIONS) - {"preset"})
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}; valid sections: {', '.join(SECTIONS)}")
    built: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        table = data.get(name, {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[{name}] must be a table of keys, got {table!r}")
        built[name] = _build_section(name, cls, table)
    config = RunConfig(preset=str(data.get("preset", "custom")), **built)
    validate(config)
    return config


def parse_overrides(args: Iterable[str]) -> dict[str, dict[str, str]]:
    """``["--optim.lr=1e-3", "--train.max_steps", "50"]`` -> ``{"optim": {"lr": "1e-3"}, ...}``."""
    out: dict[str, dict[str, str]] = {}
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"cannot read argument {arg!r}; overrides look like --section.key=value")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(items):
                raise ConfigError(f"--{key} needs a value, for example --{key}=VALUE")
            value = items[i + 1]
            i += 1
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
        i += 1
    return out


def load_config(
    preset: str | None = None, overrides: Iterable[str] | Mapping[str, Mapping[str, Any]] = ()
) -> RunConfig:
    """The config for a run: ``preset`` (a name or a .toml path) with ``overrides`` applied."""
    table: dict[str, Any] = read_preset(preset) if preset else {}
    extra = overrides if isinstance(overrides, Mapping) else parse_overrides(overrides)
    for section, values in extra.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
        table.setdefault(section, {}).update(values)
    config = from_dict(table)
    check_given_moe(config, extra.get("moe", {}))
    check_given_fp8(config, extra.get("precision", {}))
    return config


# ----------------------------------------------------------------------------- validation


def check_precision(p: PrecisionConfig) -> None:
    """The rules that span fields of the precision section (also run on an fp8 plugin object's own
    fields, which no config load validates)."""
    if p.fp8_all_gather and p.fp8_recipe != "tensorwise":
        raise ConfigError(
            f"precision.fp8_all_gather = true needs precision.fp8_recipe = 'tensorwise' (torchao all-gathers "
            f"float8 weights with one scale per tensor), not {p.fp8_recipe!r}; use "
            f"{setting('precision.fp8_recipe', 'tensorwise')} or {setting('precision.fp8_all_gather', False)}"
        )


def check_given_moe(config: RunConfig, given: Mapping[str, Any]) -> None:
    """[moe] settings the caller gave (``--moe.*`` flags, an override dict) for a run of another family
    would do nothing: one line. Files are not held to this (a preset switched to another arch, a run
    saved with a setting that never applied): there the section is unused."""
    m = config.model
    if given and (m.arch != "moe" or m.workload):
        names = ", ".join(f"moe.{k}" for k in given)
        fix = (
            "a workload's MoE layers take their own arguments (turbotrain.MoE(...)) in your FUNC"
            if m.workload
            else f"use {setting('model.arch', 'moe')}"
        )
        raise ConfigError(
            f"{names} configure model.arch = 'moe' and this run is "
            f"{'your model (model.workload)' if m.workload else f'model.arch = {m.arch!r}'}: they would do "
            f"nothing; drop them, or {fix}"
        )


def check_given_fp8(config: RunConfig, given: Mapping[str, Any]) -> None:
    """``precision.fp8_*`` settings the caller gave for a run whose precision.mode is not fp8 would do
    nothing: one line, as for [moe] settings on another family. Files are not held to this (a run
    saved with them, then resumed in another mode)."""
    named = [f"precision.{k}" for k in given if k.startswith("fp8_")]
    if named and config.precision.mode != "fp8":
        raise ConfigError(
            f"{', '.join(named)} configure{'s' if len(named) == 1 else ''} precision.mode = 'fp8' and this "
            f"run is precision.mode = {config.precision.mode!r}: {'it' if len(named) == 1 else 'they'} "
            f"would do nothing; drop {'it' if len(named) == 1 else 'them'}, or add "
            f"{setting('precision.mode', 'fp8')}"
        )


def check_moe(config: RunConfig) -> None:
    """The [moe] rules that span fields (for the family that uses them)."""
    m, e = config.model, config.moe
    if m.arch != "moe" or m.workload:
        return
    if e.top_k > e.n_experts:
        raise ConfigError(
            f"moe.top_k = {e.top_k} must be at most moe.n_experts = {e.n_experts}, "
            f"e.g. {setting('moe.top_k', min(2, e.n_experts))}"
        )
    if e.every > m.n_layer:
        raise ConfigError(
            f"moe.every = {e.every} must be at most model.n_layer = {m.n_layer}: every "
            f"moe.every-th block is a MoE block, so there would be none; e.g. {setting('moe.every', 1)}"
        )
    if e.capacity_factor > e.n_experts / e.top_k:
        raise ConfigError(
            f"moe.capacity_factor = {e.capacity_factor:g} must be at most moe.n_experts / moe.top_k = "
            f"{e.n_experts / e.top_k:g} (there every expert has a slot for every token); 0 = dropless, e.g. "
            f"{setting('moe.capacity_factor', 0)}"
        )
    # a dense model with expert_parallel > 1 is refused by the run's plan (its spec says 0 experts): an
    # own loop's Engine takes this config's distributed section for its own MoE model
    degree = config.distributed.expert_parallel
    if degree > 1 and e.n_experts % degree:
        raise ConfigError(f"distributed.expert_parallel = {degree} must divide moe.n_experts = {e.n_experts}")


def validate(config: RunConfig) -> None:
    """Check every field against its choices and bounds, then the rules that span fields.

    Every float must be finite (a NaN passes every ``<`` check and an inf learning rate only
    fails after steps have run), every whole number must fit a 64-bit integer, every number lie in
    its field's declared range (``knob(min=, max=)``: what the code can really do); the run name is one folder name (inside out_dir), the device one
    turbotrain knows (auto, cpu, cuda, cuda:N)."""
    for name in SECTIONS:
        section = getattr(config, name)
        for f in fields(section):
            value = getattr(section, f.name)
            choices = f.metadata.get("choices")
            where = f"{name}.{f.name}"
            if choices and value not in choices:
                raise choice_error(where, value, choices)
            if isinstance(value, float) and not abs(value) < float("inf"):  # NaN or +-inf
                raise ConfigError(
                    f"{where} = {value!r} must be a finite number, e.g. {setting(where, f.default)}"
                )
            if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
                raise ConfigError(
                    f"{where} = {value} does not fit a 64-bit integer; e.g. {setting(where, f.default)}"
                )
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not in_range(f, value):
                raise ConfigError(
                    f"{where} = {value!r} is outside its range {range_text(f)}, e.g. {setting(where, f.default)}"
                )
    check_precision(config.precision)
    device = config.run.device
    if device not in (AUTO, "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise choice_error("run.device", device, (AUTO, "cpu", "cuda", "cuda:N"))
    name = config.run.name
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ConfigError(
            f"run.name = {name!r} must be one folder name (no '/', not '..'); to group runs, "
            f"use {setting('run.out_dir', 'runs/GROUP')} with {setting('run.name', 'NAME')}"
        )
    if isinstance(config.batch.micro, str) and config.batch.micro != AUTO:
        raise ConfigError(
            f"batch.micro = {config.batch.micro!r} is not valid; use a whole number >= 1 or 'auto'"
        )
    if config.model.d_model % config.model.n_head:
        raise ConfigError(
            f"model.d_model = {config.model.d_model} must be divisible by model.n_head = {config.model.n_head}"
        )
    if config.data.tokenizer not in TOKENIZERS and not config.data.tokenizer.endswith(".json"):
        raise choice_error("data.tokenizer", config.data.tokenizer, (*TOKENIZERS, "PATH/tokenizer.json"))
    check_moe(config)
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
    if config.data.batching == "tokens":
        if config.batch.micro == AUTO:
            raise ConfigError(
                "batch.micro = 'auto' searches a number of rows; data.batching = 'tokens' sizes batches in "
                f"tokens: set {setting('batch.max_tokens', 4096)} with a number for batch.micro, or "
                f"{setting('data.batching', 'windows')}"
            )
        if config.model.loss == "chunked":
            raise ConfigError(
                "data.batching = 'tokens' pads targets with -100, which model.loss = 'chunked' does not skip; "
                f"use {setting('model.loss', 'full')}"
            )
        if config.compile.mode in CUDA_GRAPH_MODES:
            raise ConfigError(
                f"compile.mode = {config.compile.mode!r} uses CUDA graphs, which record one graph (and its memory) "
                "per batch shape, and data.batching = 'tokens' makes a new shape for most batches; use "
                f"{setting('compile.mode', 'default')} or {setting('data.batching', 'windows')}"
            )
        if 0 < config.batch.max_tokens < config.model.block_size:
            raise ConfigError(
                f"batch.max_tokens = {config.batch.max_tokens} must hold one row of model.block_size = "
                f"{config.model.block_size} tokens; e.g. {setting('batch.max_tokens', 32 * config.model.block_size)}"
            )
    if config.compile.mode == "reduce-overhead" and config.batch.accumulation > 1:
        raise ConfigError(
            "compile.mode = 'reduce-overhead' uses CUDA graphs, which re-record under gradient accumulation; "
            f"use {setting('compile.mode', 'default')} or {setting('batch.accumulation', 1)}"
        )


# ----------------------------------------------------------------------------- writing


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(config: RunConfig) -> str:
    """The resolved config as TOML, readable back with ``load_config(path)``."""
    lines = [f"preset = {_toml_value(config.preset)}"]
    for name in SECTIONS:
        lines.append(f"\n[{name}]")
        section = getattr(config, name)
        for f in fields(section):
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}  # {f.metadata['doc']}")
    return "\n".join(lines) + "\n"


def describe() -> str:
    """Every field with its default and documentation, for ``--help-config``."""
    out = []
    for name, cls in SECTIONS.items():
        out.append(f"[{name}]")
        for f in fields(cls):
            choices = f.metadata.get("choices")
            extra = f" (one of: {', '.join(map(str, choices))})" if choices else ""
            if range_text(f):
                extra += f" (range {range_text(f)})"
            out.append(f"  --{name}.{f.name}={f.default!r}: {f.metadata['doc']}{extra}")
    return "\n".join(out)
