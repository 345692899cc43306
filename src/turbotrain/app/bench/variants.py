"""The rows of ``turbotrain bench``'s precision matrix and ablation (two ladders, :data:`LADDERS`,
each a base and one change at a time), and why a row does not apply here, asked of what owns the
fact (the fp8 plugin for float8, cuDNN for its attention kernel)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ...core.precision import DeviceCaps
from ...core.precision.fp8 import FP8
from ..measure import merge
from .workloads import CUSTOM, LANGUAGE_MODELS, BenchWorkload


@dataclass(frozen=True)
class Variant:
    """One row of a matrix: turbotrain config overrides (+ model overrides) on a base."""

    name: str
    change: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    skip: str = ""  # why this row does not apply here (reported, not run)
    ladder: str = ""  # ablation: which base this row changes one thing of (LADDERS)


def fp8_unavailable(device: str) -> str:
    """Why an fp8 row cannot run here ("" when it can), in the fp8 plugin's own words; emulation
    (precision.fp8_emulate) is for tests and measures nothing, so it is never asked for here."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device visible"
    return FP8.unavailable(DeviceCaps.of(torch.device(device)))


def precision_variants(device: str) -> list[Variant]:
    """fp32 (TF32 off), TF32, fp16-mixed, bf16-mixed, bf16-true, fp8; compile off so each row isolates
    precision (the ablation measures compile, and fp8 with it) and the matrix fits a device session."""
    cuda_only = "" if device == "cuda" else "TF32 is a CUDA tensor-core mode; no effect on CPU"

    def row(mode: str, tf32: bool = False) -> dict[str, dict[str, Any]]:
        # compile's default scope is auto (model on CUDA): say off, or every row compiles.
        return {"precision": {"mode": mode, "tf32": tf32}, "compile": {"scope": "off"}}

    return [
        Variant("fp32", "fp32 weights and math, TF32 off", row("fp32")),
        Variant("tf32", "fp32 weights, TF32 matmuls/convolutions", row("fp32", tf32=True), skip=cuda_only),
        Variant("fp16-mixed", "fp16 autocast + GradScaler", row("fp16-mixed")),
        Variant("bf16-mixed", "bf16 autocast, fp32 weights", row("bf16-mixed")),
        Variant("bf16-true", "bf16 weights, gradients and optimizer state", row("bf16-true")),
        Variant(
            "fp8",
            "bf16 autocast + torchao float8 linears (tensorwise, torchao's size filter), eager: "
            "the float8 speed needs torch.compile (ablation row bf16-compile+fp8)",
            row("fp8"),
            skip=fp8_unavailable(device),
        ),
    ]


CUDNN_ATTENTION_MIN = (90000, (8, 0))  # cuDNN version, compute capability: cuDNN SDPA's floor in PyTorch


def cudnn_attention_unavailable(device: str) -> str:
    """Why SDPA's cuDNN kernel cannot run here ("" when it can): a CUDA kernel, cuDNN 9 or later,
    compute capability 8.0 or later. (Shapes it refuses still run: the model falls back.)"""
    if device != "cuda":
        return "cuDNN attention is a CUDA kernel"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    capability = torch.cuda.get_device_capability()
    if version is None or version < CUDNN_ATTENTION_MIN[0] or capability < CUDNN_ATTENTION_MIN[1]:
        return (
            f"cuDNN attention needs cuDNN >= 9 and compute capability >= 8.0 "
            f"(here cuDNN {version or 'none'}, {capability[0]}.{capability[1]})"
        )
    return ""


# The ablation's two ladders, each a base and one change at a time on top of it. bf16 + compile
# comes first: it is what turbotrain trains with on a GPU, so its rows answer which step change
# still pays there (flash and cuDNN attention do not take fp32, so the fp32 ladder cannot say),
# and a bench stopped at a time limit has measured them first.
LADDERS = {
    "bf16-compile": {
        "reference": "bf16-compile",
        "title": "bf16 + compile ladder: each change alone on bf16 autocast + torch.compile",
    },
    "fp32-eager": {
        "reference": "baseline",
        "title": "fp32 eager ladder: each change alone on plain fp32 eager",
    },
}


def ablation_variants(w: BenchWorkload, device: str) -> list[Variant]:
    """The two ladders (LADDERS); the fp32 one ends with every optimization together, then the defaults."""
    cuda = device == "cuda"
    gpt = w.model in LANGUAGE_MODELS
    baseline: dict[str, dict[str, Any]] = {
        "precision": {"mode": "fp32", "tf32": False, "cudnn_benchmark": False},
        "compile": {"scope": "off", "mode": "default"},
        "optim": {"implementation": "foreach" if cuda else "for-loop"},  # torch's own default per device
        "data": {"device_prefetch": False, "pin_memory": False},
    }

    def on(**sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return merge(baseline, sections)

    rows = _one_change_rows(w, device, on)
    everything = on(
        precision={"mode": "bf16-mixed", "tf32": cuda, "cudnn_benchmark": cuda},
        compile={"scope": "model", "mode": "reduce-overhead" if cuda else "default"},
        optim={"implementation": "fused"},
        data={"device_prefetch": cuda, "pin_memory": cuda},
    )
    cudnn_attention = not cudnn_attention_unavailable(device)
    together = {"loss": "chunked", **({"sdpa_backend": "cudnn"} if cudnn_attention else {})} if gpt else {}
    rows.append(Variant("all", "every optimization above together", everything, together))
    rows.append(Variant("turbotrain-defaults", "Engine defaults (auto)", {}, {}))
    return bf16_ladder(w, device) + [replace(v, ladder="fp32-eager") for v in rows]


def _one_change_rows(
    w: BenchWorkload, device: str, on: Callable[..., dict[str, dict[str, Any]]]
) -> list[Variant]:
    """The fp32 ladder's rows of one optimization each on the baseline (``on(**sections)``)."""
    gpt = w.model in LANGUAGE_MODELS
    moe = {"moe_impl": "loop"} if w.model == "moe" else {}  # MoE baseline: one matmul pair per expert
    no_attention = "" if gpt else "no attention in this model"
    conv = w.model in ("resnet", "cifar") or (w.model == CUSTOM and bool(w.model_kwargs.get("conv")))
    only_cuda = "" if device == "cuda" else "CUDA only"
    masked = {"attention": "masked", **moe} if gpt else {}
    graphs = {"scope": "model", "mode": "reduce-overhead"}
    # name, what it changes, config sections, model overrides, why it does not apply here
    rows: list[tuple[str, str, dict[str, dict[str, Any]], dict[str, Any], str]] = [
        ("baseline", "fp32, eager, AdamW torch default, explicit attention mask, no prefetch", {}, masked, ""),
        ("+bf16-mixed", "bf16 autocast", {"precision": {"mode": "bf16-mixed"}}, masked, ""),
        ("+tf32", "TF32 matmuls/convolutions", {"precision": {"tf32": True}}, masked, only_cuda),
        ("+cudnn-benchmark", "cuDNN autotuning", {"precision": {"cudnn_benchmark": True}}, masked,
         only_cuda or ("" if conv else "no convolutions in this model")),
        ("+compile", "torch.compile (model)", {"compile": {"scope": "model"}}, masked, ""),
        ("+fused-adamw", "fused AdamW", {"optim": {"implementation": "fused"}}, masked, ""),
        ("+sdpa-flash", "SDPA is_causal (flash kernel) instead of an explicit mask", {}, {**moe}, no_attention),
        ("+cudnn-attention", "SDPA is_causal preferring cuDNN attention (model.sdpa_backend = 'cudnn'; "
         "shapes cuDNN refuses fall back)", {}, {"sdpa_backend": "cudnn", **moe},
         no_attention or cudnn_attention_unavailable(device)),
        ("+chunked-loss", "linear + cross-entropy by chunks, no full logits (model.loss = 'chunked')", {},
         {**masked, "loss": "chunked"}, "" if gpt else "no language-model loss in this model"),
        ("+prefetch", "pinned batches, side-stream copy", {"data": {"device_prefetch": True, "pin_memory": True}},
         masked, only_cuda or ("the data is already resident on the device" if w.resident else "")),
        ("+cuda-graphs", "compile mode reduce-overhead (CUDA graphs)", {"compile": graphs}, masked, only_cuda),
    ]  # fmt: skip
    if moe:
        rows += [
            ("+grouped-experts", "all experts as one grouped GEMM per projection (moe.impl = 'grouped')", {},
             {**masked, "moe_impl": "grouped"}, ""),
            ("+batched-experts", "all experts as one padded batched matmul (moe.impl = 'batched')", {},
             {**masked, "moe_impl": "batched"}, ""),
        ]  # fmt: skip
    return [
        Variant(name, change, on(**sections), model, skip=skip)
        for name, change, sections, model, skip in rows
    ]


def bf16_ladder(w: BenchWorkload, device: str) -> list[Variant]:
    """bf16 autocast + torch.compile (model), the rest at turbotrain's defaults, then one change
    at a time on it (fp8: float8 linears by torchao's size filter). Not run on CPU: there
    turbotrain trains fp32 eager, and bf16 autocast is the slow path on many CPUs."""
    gpt = w.model in LANGUAGE_MODELS
    gpu_only = (
        ""
        if device == "cuda"
        else "a GPU question: on CPU turbotrain trains fp32 eager (see the fp32 ladder)"
    )
    base = {"precision": {"mode": "bf16-mixed"}, "compile": {"scope": "model", "mode": "default"}}
    graphs = {**base, "compile": {"scope": "model", "mode": "reduce-overhead"}}
    no_attention = "" if gpt else "no attention in this model"
    rows = [
        Variant("bf16-compile", "bf16 autocast, torch.compile (model), SDPA is_causal; defaults otherwise", base),
        Variant("bf16-compile+cudnn-attention", "SDPA preferring cuDNN attention (model.sdpa_backend = 'cudnn')",
                base, {"sdpa_backend": "cudnn"}, skip=no_attention or cudnn_attention_unavailable(device)),
        Variant("bf16-compile+chunked-loss", "linear + cross-entropy by chunks (model.loss = 'chunked')", base,
                {"loss": "chunked"}, skip="" if gpt else "no language-model loss in this model"),
        Variant("bf16-compile+cuda-graphs", "compile mode reduce-overhead (CUDA graphs)", graphs),
        Variant("bf16-compile+fp8",
                "torchao float8 linears (precision.mode = 'fp8', tensorwise, torchao's size filter)",
                {**base, "precision": {"mode": "fp8"}}, skip=fp8_unavailable(device)),
    ]  # fmt: skip
    return [replace(v, ladder="bf16-compile", skip=gpu_only or v.skip) for v in rows]
