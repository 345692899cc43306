"""Benchmark workloads: plain data that turns into the JSON spec every contender process reads, so
all build the same model from the same seed, train on the same batches (written once by the parent)
with the same recipe; sized down on a CPU (``scaled_for = "cpu"``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...base.batch import batch_size as _batch_size
from ...base.errors import TurbotrainError
from ...base.failure import workload_failed
from ...base.rundir import workload_label
from ...core.engine import LossFn, default_loss
from ...loop.monitor import count_flops_per_sample
from ...parts.data.sources import stdlib_files
from ...parts.models.build import build_named
from ...parts.models.classifier import synthetic_images
from ...parts.models.mlp import synthetic_batches
from ...parts.workload import load_workload, rebuild_loader

CUSTOM = "custom"  # BenchWorkload.model of a --model FILE.py:FUNC workload
Size = int | None  # a --batch, --warmup or --steps given on the command line (None: the workload's)


@dataclass(frozen=True)
class BenchWorkload:
    """One benchmark workload on one device type.

    ``batch_size`` is the global batch in samples (sequences or images), ``seq_len`` the tokens per
    sequence for language models (None for classifiers). ``pool`` distinct batches are cycled
    (0 = a fresh batch every step). ``resident``: on CUDA the batches are moved to the device
    before timing, so no host-to-device copy is in the step (the overhead-bound CIFAR case).
    """

    name: str
    title: str
    task: str  # "lm" (model(tokens, targets) -> loss) or "classify" (model(inputs, labels) -> loss)
    model: str  # a parts.models.build kind: "gpt" | "moe" | "llama" | "mlp" | "resnet" | "cifar"
    model_kwargs: dict[str, Any]
    batch_size: int
    warmup_steps: int  # excluded from throughput; step 1 includes compilation
    timed_steps: int
    lr: float
    seq_len: int | None = None
    image_size: int | None = None
    classes: int | None = None
    pool: int = 0
    resident: bool = False
    lr_warmup_steps: int = 5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    scaled_for: str = ""  # "cpu" when the sizes were reduced for a CPU
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.timed_steps

    @property
    def pool_size(self) -> int:
        return self.pool or self.total_steps

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len if self.task == "lm" else None

    def describe(self) -> str:
        """One line: the model and batch as they will run."""
        kw = ", ".join(f"{k}={v}" for k, v in self.model_kwargs.items())
        side = self.image_size
        shape = f"T={self.seq_len}" if self.seq_len else f"{side}x{side}" if side else ""
        scaled = " (scaled down for CPU)" if self.scaled_for else ""
        model = "" if self.model == CUSTOM else f"; {self.model}({kw})"
        return (
            f"{self.name}: {self.title}{scaled}{model}; batch {self.batch_size}"
            f"{' x ' + shape if shape else ''}; {self.warmup_steps} warm-up + {self.timed_steps} timed steps"
        )

    def replace(self, **changes: Any) -> BenchWorkload:
        return dataclasses.replace(self, **changes)


GPT2_SMALL = dict(vocab_size=50304, n_layer=12, n_head=12, d_model=768, block_size=1024)
LLAMA_121M = dict(
    vocab_size=50304, n_layer=12, n_head=12, n_kv_head=4, d_model=768, ffn_hidden=2304, block_size=1024
)
BYTES_2L = dict(vocab_size=256, n_layer=2, n_head=4, d_model=128, block_size=64)  # the MoE's CPU backbone

# Each workload as it runs on CUDA, and what changes on a CPU (there scaled_for = "cpu"; None: the
# same workload), where CUDA's sizes of gpt2-small and cnn-224 would take minutes per step.
# fmt: off
_TABLE: dict[str, tuple[BenchWorkload, dict[str, Any] | None]] = {
    "gpt2-small": (
        BenchWorkload("gpt2-small", "W1 GPT-2 small", "lm", "gpt", GPT2_SMALL, 16, 8, 20, 6e-4, seq_len=1024),
        dict(model_kwargs=dict(GPT2_SMALL, n_layer=2, n_head=4, d_model=256, block_size=128), batch_size=4,
             seq_len=128, warmup_steps=2, timed_steps=10, notes=(
             "CPU: 2 layers, d=256, T=128 instead of 12 layers, d=768, T=1024; the 50304-token vocabulary is kept",)),
    ),
    "moe": (
        BenchWorkload("moe", "W3 MoE: GPT-2 small backbone, 8 experts top-2", "lm", "moe",
                      dict(GPT2_SMALL, n_experts=8, top_k=2), 8, 8, 20, 6e-4, seq_len=1024),
        dict(title="W3 MoE: GPT backbone, 8 experts top-2", batch_size=16, seq_len=64, warmup_steps=3,
             timed_steps=20, lr=2e-3, model_kwargs=dict(BYTES_2L, n_experts=8, top_k=2, expert_hidden=256),
             notes=("CPU: 2 layers, d=128, T=64, byte vocabulary, experts of half the dense MLP's width "
                    "instead of the GPT-2 small backbone",)),
    ),
    "cnn-224": (
        BenchWorkload("cnn-224", "W2 ResNet-18-style CNN, 224x224", "classify", "resnet",
                      dict(layers=(2, 2, 2, 2), width=64, classes=1000), 128, 8, 20, 1e-3,
                      image_size=224, classes=1000, pool=4),
        dict(title="W2 ResNet-style CNN", model_kwargs=dict(layers=(1, 1, 1, 1), width=16, classes=100),
             batch_size=8, image_size=64, classes=100, warmup_steps=2, timed_steps=10, notes=(
             "CPU: 64x64 images, width 16, one block per stage, 100 classes instead of ResNet-18 on 224x224",)),
    ),
    "cnn-cifar": (
        BenchWorkload("cnn-cifar", "W2 CIFAR-sized ResNet-9-style CNN, data on the GPU", "classify", "cifar",
                      dict(width=32, classes=10), 256, 10, 50, 2e-3, image_size=32, classes=10, pool=16,
                      resident=True),
        dict(title="W2 CIFAR-sized ResNet-9-style CNN", model_kwargs=dict(width=8, classes=10), batch_size=32,
             warmup_steps=3, timed_steps=20, resident=False,
             notes=("CPU: width 8 instead of 32, batch 32 instead of 256; 'data on the device' is moot on CPU",)),
    ),
    "gpt-tiny": (
        BenchWorkload("gpt-tiny", "tiny GPT (CPU workload)", "lm", "gpt",
                      dict(BYTES_2L, n_layer=4), 16, 5, 40, 2e-3, seq_len=64),
        None,
    ),
    "mlp-tiny": (
        BenchWorkload("mlp-tiny", "tiny MLP, overhead-bound (CPU workload)", "classify", "mlp",
                      dict(d_in=256, width=256, depth=3, classes=10), 64, 10, 100, 1e-3, classes=10, pool=20),
        None,
    ),
    # the Llama-style family (presets llama-125m, llama-tiny) in W1's shape and steps on CUDA, the tiny GPT's on a CPU
    "llama": (
        BenchWorkload("llama", "Llama-style 121M beside W1 (12 layers, d=768, 12 query / 4 key-value heads, "
                      "SwiGLU 2304)", "lm", "llama", LLAMA_121M, 16, 8, 20, 6e-4, seq_len=1024),
        dict(title="tiny Llama-style model (CPU workload)", warmup_steps=5, timed_steps=40, lr=2e-3, seq_len=64,
             model_kwargs=dict(vocab_size=256, n_layer=4, n_head=4, n_kv_head=2, d_model=128, ffn_hidden=384,
                               block_size=64),
             notes=("CPU: llama-tiny's shape (4 layers, d=128) at T=64 instead of the 121M model",)),
    ),
}
# fmt: on


def _sized(name: str, device_type: str) -> BenchWorkload:
    cuda, cpu = _TABLE[name]
    return cuda if device_type == "cuda" or cpu is None else cuda.replace(scaled_for="cpu", **cpu)


LANGUAGE_MODELS = ("gpt", "moe", "llama")  # build kinds whose model has flops_per_token and SDPA attention
WORKLOADS: dict[str, Callable[[str], BenchWorkload]] = {name: partial(_sized, name) for name in _TABLE}
GROUPS: dict[str, tuple[str, ...]] = {"cnn": ("cnn-224", "cnn-cifar")}


def workload_names() -> list[str]:
    """Every name ``--workload`` accepts (groups such as 'cnn' expand to several workloads)."""
    return [*WORKLOADS, *GROUPS]


def expand(name: str) -> list[str]:
    """'cnn' -> ['cnn-224', 'cnn-cifar']; a single workload -> [name]; unknown -> error."""
    if name in GROUPS:
        return list(GROUPS[name])
    if name not in WORKLOADS:
        raise TurbotrainError(f"unknown workload {name!r}; choose one of: {', '.join(workload_names())}")
    return [name]


def resolve_workload(
    name: str,
    device_type: str,
    *,
    batch_size: Size = None,
    warmup_steps: Size = None,
    timed_steps: Size = None,
    model_overrides: dict[str, Any] | None = None,
) -> BenchWorkload:
    """The workload ``name`` sized for ``device_type`` ("cuda" or "cpu"), with optional overrides."""
    if name in GROUPS:
        raise TurbotrainError(f"{name!r} is a group of workloads ({', '.join(GROUPS[name])}); resolve each")
    (only,) = expand(name)
    w = WORKLOADS[only](device_type)
    changes: dict[str, Any] = {} if batch_size is None else {"batch_size": batch_size}
    if model_overrides:
        kwargs = {**w.model_kwargs, **model_overrides}
        changes["model_kwargs"] = kwargs
        if w.model in LANGUAGE_MODELS and "block_size" in model_overrides:
            changes["seq_len"] = kwargs["block_size"]
    return resolve_bench(w.replace(**changes), warmup_steps, timed_steps)


def resolve_bench(w: BenchWorkload, warmup_steps: Size = None, timed_steps: Size = None) -> BenchWorkload:
    """``w`` with the given step counts, checked: a warm-up step, two timed steps, one sample."""
    steps = {"warmup_steps": warmup_steps, "timed_steps": timed_steps}
    w = w.replace(**{k: v for k, v in steps.items() if v is not None})
    if w.warmup_steps < 1:
        raise TurbotrainError(
            f"--warmup = {w.warmup_steps}: at least 1 warm-up step is needed (step 1 includes compilation)"
        )
    if w.timed_steps < 2:
        raise TurbotrainError(f"--steps = {w.timed_steps}: at least 2 timed steps are needed for a median")
    if w.batch_size < 1:
        raise TurbotrainError(f"--batch = {w.batch_size} must be at least 1")
    return w


def seeded_model(kind: str, kwargs: dict[str, Any], seed: int) -> nn.Module:
    return seeded_workload(kind, kwargs, seed)[0]


def seeded_workload(kind: str, kwargs: dict[str, Any], seed: int) -> tuple[nn.Module, LossFn]:
    """The model, seeded (the same weights in every process), and its loss function (a ``--model``
    workload's own: its FUNC is called again)."""
    if kind == CUSTOM:
        w = load_workload(kwargs["ref"], seed=seed)
        return w.model, w.loss_fn or default_loss
    torch.manual_seed(seed)
    return build_named(kind, kwargs), default_loss


def sample_shape(w: BenchWorkload) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape (without the batch dimension) and dtype of one input sample."""
    if w.task == "lm":
        return (w.seq_len or 0,), torch.int64
    if w.model == "mlp":
        return (int(w.model_kwargs.get("d_in", 256)),), torch.float32
    return (3, w.image_size or 0, w.image_size or 0), torch.uint8


def flops_per_step(w: BenchWorkload) -> tuple[float, str]:
    """Training FLOPs of one optimizer step, and how they were obtained: language models by the
    PaLM convention (as the design's protocol states), others counted on the meta device."""
    if w.model == CUSTOM:
        model, loss_fn = seeded_workload(CUSTOM, w.model_kwargs, 0)
        batch = custom_batches(w, 0, count=1)[0]
        try:
            per_sample = count_flops_per_sample(model, batch, loss_fn)
        except Exception as exc:  # the user's forward/backward, before any row: one line, not a traceback
            failed = workload_failed(
                "bench --model (counting its FLOPs on one batch)", exc, in_user_code=False
            )
            if failed is None:
                raise
            raise failed from None
        how = "counted on one batch (torch.utils.flop_counter, forward + backward)"
        return per_sample * _batch_size(batch), how
    if w.model in LANGUAGE_MODELS:
        with torch.device("meta"):
            gpt = build_named(w.model, w.model_kwargs)
        per_token = gpt.flops_per_token(w.seq_len)  # type: ignore[operator]
        active = (
            " (N = active parameters: the top-k experts a token is routed to)" if w.model == "moe" else ""
        )
        return float(per_token * w.batch_size * (w.seq_len or 0)), "PaLM 6N + 12·L·H·Q·T per token" + active
    shape, dtype = sample_shape(w)
    with torch.device("meta"):
        model = build_named(w.model, w.model_kwargs)
        x = torch.zeros((w.batch_size, *shape), dtype=dtype)
        y = torch.zeros((w.batch_size,), dtype=torch.int64)
    with FlopCounterMode(display=False) as counter:
        model(x, y).backward()
    return float(counter.get_total_flops()), "counted (torch.utils.flop_counter, forward + backward)"


def corpus_windows(count: int, seq_len: int, seed: int) -> torch.Tensor:
    """(count, seq_len + 1) byte tokens at seeded offsets of the built-in corpus (the standard
    library's sources, in a fixed order, only as much as needed)."""
    need = max(4 * count * (seq_len + 1), 1 << 20)
    chunks, size = [], 0
    for path in stdlib_files():
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= need:
            break
    tokens = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.int64)
    if tokens.numel() < seq_len + 2:
        raise TurbotrainError(
            "the built-in corpus is too small for one window; is the Python standard library present?"
        )
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randint(tokens.numel() - seq_len - 1, (count,), generator=g)
    return tokens[offsets[:, None] + torch.arange(seq_len + 1)]


def make_data(w: BenchWorkload, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The workload's ``pool_size`` batches on the host: inputs (P, B, ...) and targets (P, B, ...)."""
    P, B = w.pool_size, w.batch_size
    if w.task == "lm":
        seq_len = w.seq_len or 0
        windows = corpus_windows(P * B, seq_len, seed).view(P, B, seq_len + 1)
        return windows[..., :-1].contiguous(), windows[..., 1:].contiguous()
    if w.model == "mlp":
        kw = w.model_kwargs
        batches = synthetic_batches(P, B, int(kw.get("d_in", 256)), int(kw.get("classes", 10)), seed=seed)
        return torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches])
    return synthetic_images(P, B, w.image_size or 32, w.classes or 10, seed=seed)


def write_data(w: BenchWorkload, seed: int, path: Path) -> Path:
    """Write the batches once, for every contender to read (``torch.load(weights_only=True)``)."""
    if w.model == CUSTOM:
        torch.save({"batches": custom_batches(w, seed)}, path)
    else:
        xs, ys = make_data(w, seed)
        torch.save({"x": xs, "y": ys}, path)
    return path


def custom_workload(
    ref: str, device: str, *, batch_size: Size = None, warmup_steps: Size = None, timed_steps: Size = None
) -> BenchWorkload:
    """A benchmark workload from ``--model FILE.py:FUNC`` (see :mod:`turbotrain.parts.workload`): its
    model, loss and batches (``batch_size`` rebuilds its DataLoader with that many samples per
    batch). Every row trains with the bench recipe's AdamW (lr 1e-3), so rows compare; the
    workload's own optimizer is left out."""
    w = load_workload(ref, seed=0)  # here: a wrong --model is one error before any row starts
    loader = rebuild_loader(w.train_loader, batch_size=batch_size) if batch_size else w.train_loader
    first = next(iter(loader), None)
    if first is None:
        raise TurbotrainError(f"--model {ref}: train_loader yielded no batch")
    cuda, conv = device == "cuda", any(isinstance(m, nn.Conv2d) for m in w.model.modules())
    bench = BenchWorkload(
        workload_label(ref),  # the file's name, as train names its runs
        f"your model ({ref}): {type(w.model).__name__}",
        "custom",
        CUSTOM,
        {"ref": ref, "batch_size": batch_size, "conv": conv},
        batch_size=_batch_size(first),
        warmup_steps=5 if cuda else 3,
        timed_steps=20,
        lr=1e-3,
        pool=8,
        notes=(
            f"{w.describe()}; every row trains it with the bench recipe (AdamW lr 1e-3, linear warm-up, "
            "clipping 1.0), not its own optimizer",
        ),
    )
    return resolve_bench(bench, warmup_steps, timed_steps)


def custom_batches(w: BenchWorkload, seed: int, count: int | None = None) -> list[Any]:
    """``count`` (default: the pool) batches of a ``--model`` workload's loader, cycled, as plain
    containers of tensors (what ``torch.load(weights_only=True)`` reads back)."""
    wl = load_workload(w.model_kwargs["ref"], seed=seed)
    size = w.model_kwargs.get("batch_size")
    loader = rebuild_loader(wl.train_loader, batch_size=size) if size else wl.train_loader
    out: list[Any] = []
    want = count or w.pool_size
    while len(out) < want:
        before = len(out)
        out.extend(_plain(b) for b, _ in zip(loader, range(want - len(out))))
        if len(out) == before:
            break
    return out


def _plain(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.detach().contiguous()
    if isinstance(batch, Mapping):
        return {k: _plain(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return (list if isinstance(batch, list) else tuple)(_plain(b) for b in batch)
    return batch


def to_spec(w: BenchWorkload, *, device: str, seed: int, data_file: Path) -> dict[str, Any]:
    """The JSON spec a contender process reads: model, data, steps and the training recipe."""
    return {
        "workload": w.name,
        "task": w.task,
        "model": {"kind": w.model, "kwargs": dict(w.model_kwargs)},
        "batch_size": w.batch_size,
        "seq_len": w.seq_len,
        "warmup_steps": w.warmup_steps,
        "timed_steps": w.timed_steps,
        "resident": w.resident,
        "data_file": str(data_file),
        "device": device,
        "seed": seed,
        "optim": {
            "lr": w.lr,
            "betas": list(w.betas),
            "eps": w.eps,
            "weight_decay": w.weight_decay,
            "lr_warmup_steps": w.lr_warmup_steps,
            "grad_clip": w.grad_clip,
        },
    }
