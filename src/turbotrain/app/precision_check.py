"""``turbotrain doctor --model FILE.py:FUNC``: is your model sound in each precision, before a long
run? One forward/backward on one batch per precision through the Engine, against fp32 without TF32
(docs/fp8.md)."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..base.batch import move_to
from ..base.config import PrecisionConfig, load_config, recast
from ..base.errors import ConfigError, TurbotrainError
from ..base.failure import one_line
from ..core.device import resolve_device
from ..core.engine import Engine, default_loss
from ..core.meter.table import render_table
from ..core.meter.trial import copy_on
from ..core.precision import FP8, DeviceCaps, FP16Mixed, Precision, fallback_mode, resolve_precision
from ..core.precision.fp8 import FP8Settings, float8_capable, torchao_available
from ..core.precision.fp8_choice import FP8Choice, default_cache_dir, time_fp8_layers
from ..parts.models.registry import spec_for
from ..parts.workload import Workload, load_workload
from ..tools.memory.stats import default_vocab_size

# fp8 is asked for by name only, and needs torchao
CHECKED = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
REFERENCE = "fp32"
LOSS_RTOL = 0.05  # 16-bit rounding moves a loss by well under 1 %; 5 % is a model that computes differently
GRAD_RTOL = 0.25  # a parameter's gradient norm: bf16 keeps 3 significant digits, less after long reductions
GRAD_FLOOR = 0.01  # norms below this share of the largest are compared against it: a bias before a BatchNorm
# has a gradient that is zero up to rounding, and its relative difference would be noise
MAX_SCALE_HALVINGS = 16  # fp16: the GradScaler's 65536 down to 1
PRESET_MICRO = 8  # a preset's batch (random tokens) holds at most this many sequences
FP8_LISTED = 8  # layer names shown per line of the text report (--json has them all)


class _FP16MixedForTheCheck(FP16Mixed, register=False):
    """fp16-mixed on a device whose training refuses it (CPU), for this check only."""

    @classmethod
    def check(cls, caps: DeviceCaps, settings: PrecisionConfig) -> None:
        pass


@dataclass
class PrecisionResult:
    """One precision's forward/backward against the fp32 reference."""

    precision: str
    status: str  # ok, nonfinite, differs, error, unsupported, reference
    trains_here: bool  # training on this device accepts this precision
    note: str = ""  # why training here refuses it, or how it was checked anyway
    loss: float | None = None
    finite_loss: bool | None = None
    finite_grads: bool | None = None
    nonfinite_grads: list[str] | None = None  # the first parameters whose gradients are not finite
    loss_abs_diff: float | None = None
    loss_rel_diff: float | None = None
    grad_norm_rel_diff: float | None = None  # the largest over parameters
    grad_norm_worst: str | None = None  # the parameter it was found in
    loss_scale: float | None = None  # fp16: the GradScaler scale the gradients were taken at
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EXACT: dict[str, dict[str, Any]] = {
    "compile": {"scope": "off"},
    "memory": {"on_oom": "stop"},
    "precision": {"tf32": False, "cudnn_benchmark": False},
}


def _forward_backward(
    mode: str | Precision, w: Workload, batch: Any, device: torch.device, seed: int
) -> dict[str, Any]:
    """The loss, the gradients (unscaled, float32, by parameter name) and the fp16 loss scale."""
    with warnings.catch_warnings(action="ignore"):  # bf16 on CPU "is slow": true, and beside the point here
        engine = Engine({"run": {"device": str(device)}, **EXACT}, precision=mode)  # an exact fp32 reference
    model, _ = copy_on(engine, w.model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    carrier = torch.optim.SGD(params, lr=0.0)  # GradScaler unscales through an optimizer; never stepped
    scaler = engine.precision.scaler
    loss_fn = w.loss_fn or default_loss
    for _ in range(MAX_SCALE_HALVINGS + 1):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the same dropout in every precision
        loss = float(engine.forward_backward(model, batch, loss_fn).detach().float())
        engine.precision.unscale_(carrier)
        grads = {name: p.grad.detach().float() for name, p in model.named_parameters() if p.grad is not None}
        bad = [name for name, g in grads.items() if not bool(torch.isfinite(g).all())]
        if not bad or scaler is None or not math.isfinite(loss) or scaler.get_scale() <= 1.0:
            break
        scaler.update()  # found inf: halve the scale, as a skipped training step does
    scale = scaler.get_scale() if scaler is not None else None
    return {"loss": loss, "grads": grads, "bad": bad, "scale": scale}


def _compare(result: PrecisionResult, run: dict[str, Any], ref: dict[str, Any] | None) -> None:
    result.loss, result.loss_scale = run["loss"], run["scale"]
    result.finite_loss, result.finite_grads = math.isfinite(run["loss"]), not run["bad"]
    result.nonfinite_grads = run["bad"][:5] or None
    if not (result.finite_loss and result.finite_grads):
        result.status = "nonfinite"
        what = [f"loss {run['loss']}"] if not result.finite_loss else []
        if run["bad"]:
            what.append(f"gradients of {len(run['bad'])} parameter(s), first {run['bad'][0]}")
        scale = f" at loss scale {run['scale']:g}" if run["scale"] is not None else ""
        result.detail = f"{' and '.join(what)}{scale}"
        return
    if ref is None:
        result.status = "reference"
        return
    result.loss_abs_diff = abs(run["loss"] - ref["loss"])
    result.loss_rel_diff = result.loss_abs_diff / max(abs(ref["loss"]), 1e-12)
    ref_norms = {name: float(g.norm()) for name, g in ref["grads"].items()}
    floor = GRAD_FLOOR * max(ref_norms.values(), default=0.0)
    worst, worst_name = 0.0, None
    for name, n_ref in ref_norms.items():
        if (g := run["grads"].get(name)) is None:
            continue
        n, norm_scale = float(g.norm()), max(n_ref, floor)
        rel = abs(n - n_ref) / norm_scale if norm_scale > 0 else (0.0 if n == 0 else math.inf)
        if rel > worst:
            worst, worst_name = rel, name
    result.grad_norm_rel_diff, result.grad_norm_worst = worst, worst_name
    over: list[str] = []
    if result.loss_rel_diff > LOSS_RTOL:
        over.append(f"loss {100 * result.loss_rel_diff:.2g} % from fp32 (limit {100 * LOSS_RTOL:g} %)")
    if worst > GRAD_RTOL:
        over.append(
            f"gradient norm of {worst_name} {100 * worst:.2g} % from fp32 (limit {100 * GRAD_RTOL:g} %)"
        )
    result.status, result.detail = ("differs", ", ".join(over)) if over else ("ok", "")


def fp8_plan(
    model: torch.nn.Module, device: torch.device, caps: DeviceCaps, settings: PrecisionConfig
) -> dict[str, Any]:
    """What ``precision.mode = fp8`` would do to ``model``: the linear layers converted, those kept in
    bf16 and why, and whether this device runs it (else ``note``: training's one-line refusal)."""
    fp8 = FP8.from_settings(device, settings)
    plan = fp8.layer_plan(model)
    converted = [name for name, why in plan.items() if not why]
    out: dict[str, Any] = {
        "recipe": fp8.recipe,
        "min_size": fp8.min_size,
        "converted": converted,
        "kept": [f"{name}: {why}" for name, why in plan.items() if why],
        "runs_here": True,
        "note": "",
    }
    if not converted and not fp8.min_size:
        ones = FP8.from_settings(device, dataclasses.replace(recast(settings, FP8Settings), fp8_min_size=1))
        out["with_min_size_1"] = sum(not why for why in ones.layer_plan(model).values())
    try:
        with warnings.catch_warnings(action="ignore"):  # fp8_emulate's "correctness only": the caller asked
            resolve_precision(FP8.name, caps, settings)
    except ConfigError as exc:
        out["runs_here"], out["note"] = False, str(exc)
    return out


def _fp8_per_layer(
    w: Workload, batch: Any, device: torch.device, caps: DeviceCaps, settings: PrecisionConfig
) -> dict[str, Any]:
    """fp8 per layer by timing (core/precision/fp8_choice.py) on a float8 GPU with torchao; elsewhere why not."""
    if not (float8_capable(caps) and torchao_available()):
        return {"line": "fp8 per layer by timing: needs a float8 GPU (compute capability >= 8.9) and torchao"}
    model = copy.deepcopy(w.model).to(device)
    fp8 = FP8.from_settings(device, settings)
    forward = lambda: (w.loss_fn or default_loss)(model, batch)  # noqa: E731
    return time_fp8_layers(model, forward, device, fp8, cache_dir=default_cache_dir()).to_dict()


def _check_mode(
    mode: str,
    w: Workload,
    batch: Any,
    device: torch.device,
    caps: DeviceCaps,
    fp8: PrecisionConfig,
    seed: int,
) -> tuple[PrecisionResult, dict[str, Any] | None]:
    """One precision's row and its forward/backward (None when it does not run here or raised)."""
    plugin: str | Precision = FP8.from_settings(device, fp8) if mode == FP8.name else mode
    try:
        with warnings.catch_warnings(action="ignore"):  # bf16 on CPU "is slow": beside the point here
            resolve_precision(mode, caps, fp8)
        result = PrecisionResult(mode, "ok", True)
    except ConfigError as exc:
        result = PrecisionResult(mode, "unsupported", False, note=str(exc))
        if not (mode == FP16Mixed.name and device.type == "cpu"):
            return result, None
        plugin = _FP16MixedForTheCheck()
        result.note = "a GPU mode; checked with CPU fp16 autocast"
    try:
        return result, _forward_backward(plugin, w, batch, device, seed)
    except TurbotrainError:
        raise
    except Exception as exc:  # the user's model in this precision: one line, as a finding
        line = one_line(exc)
        if mode == REFERENCE:
            raise TurbotrainError(
                f"{w.source or 'the model'}: its fp32 forward/backward raised {line}"
            ) from exc
        result.status, result.detail = "error", line
        return result, None


def check_precisions(
    w: Workload,
    device: torch.device | str | None = None,
    *,
    modes: tuple[str, ...] = CHECKED,
    seed: int = 0,
    fp8: PrecisionConfig | None = None,
) -> dict[str, Any]:
    """Run ``w``'s model on one batch in each of ``modes``, and fp8 too where this device runs it and
    its filter converts a layer; a model that fails in fp32 is a TurbotrainError."""
    device = resolve_device("auto" if device is None else str(device))
    caps = DeviceCaps.of(device)
    fp8_settings = recast(dataclasses.replace(fp8 or PrecisionConfig(), mode=FP8.name), FP8Settings)
    fp8_report = fp8_plan(w.model, device, caps, fp8_settings)
    if fp8_report["runs_here"] and fp8_report["converted"] and FP8.name not in modes:
        modes = (*modes, FP8.name)
    try:
        batch = move_to(next(iter(w.train_loader)), device)
    except StopIteration:
        raise TurbotrainError(
            f"{w.source or 'the workload'}: train_loader yields no batch to check"
        ) from None
    fp8_report["per_layer"] = _fp8_per_layer(w, batch, device, caps, fp8_settings)
    results: list[PrecisionResult] = []
    ref: dict[str, Any] | None = None
    for mode in (REFERENCE, *(m for m in modes if m != REFERENCE)):
        result, run = _check_mode(mode, w, batch, device, caps, fp8_settings, seed)
        results.append(result)
        if run is not None:
            _compare(result, run, ref)
        if mode == REFERENCE and run is not None:
            if result.status == "nonfinite":
                raise TurbotrainError(
                    f"{w.source or 'the model'}: already in fp32 the {result.detail}; "
                    "fix the model or the data before comparing precisions"
                )
            ref = run
    out = verdict(results, caps)
    if device.type != "cuda":  # what a GPU run of this model would get, from the same rows
        out["on_gpu"] = [{"gpu": label, **verdict(results, gpu)} for label, gpu in GPUS]
    rows = [r.to_dict() for r in results]
    return {"model": w.describe(), "device": str(device), "results": rows, "verdict": out, "fp8": fp8_report}


GPUS = (
    ("compute capability >= 8.0", DeviceCaps("cuda", (8, 0), True)),
    ("compute capability < 8.0", DeviceCaps("cuda", (7, 0), False)),
)
_WITHIN = "finite and within rounding of fp32"


def verdict(results: list[PrecisionResult], caps: DeviceCaps) -> dict[str, Any]:
    """The precision ``auto`` picks on ``caps``, whether it is sound for this model, and if not
    the first sound one on its fallback chain (the chain a run falls back along)."""
    by_name = {r.precision: r for r in results}
    auto = resolve_precision("auto", caps)
    row = by_name.get(auto)
    sound = row is not None and row.status in ("ok", "reference")
    out: dict[str, Any] = {"auto": auto, "sound": sound}
    if row is None:
        out["reason"] = f"{auto} was not checked"
        return out
    if sound:
        out["reason"] = "finite; it is the reference" if row.status == "reference" else _WITHIN
        return out
    out["reason"] = row.detail
    mode = fallback_mode(auto, caps)
    while mode is not None and getattr(by_name.get(mode), "status", None) not in ("ok", "reference"):
        mode = fallback_mode(mode, caps)
    return {**out, "use_instead": mode} if mode is not None else out


def load_target(model: str | None, preset: str | None, seed: int = 0) -> Workload:
    """``--model FILE.py:FUNC`` (its workload) or ``--preset NAME`` (the preset's model on one batch
    of random tokens of at most PRESET_MICRO sequences)."""
    if model:
        return load_workload(model, seed=seed)
    config = load_config(preset)
    spec, vocab = spec_for(config), default_vocab_size(config)
    torch.manual_seed(seed)
    net = spec.build_model(config, vocab)
    micro = min(config.batch.micro if isinstance(config.batch.micro, int) else PRESET_MICRO, PRESET_MICRO)
    batch = spec.random_batch(config, vocab, torch.device("cpu"), seed=seed)(micro)
    return Workload(model=net, train_loader=[batch], source=f"preset {config.preset} (random tokens)")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2g} %"


def _sound(v: dict[str, Any]) -> str:
    instead = f"; use --precision.mode={v['use_instead']}" if v.get("use_instead") else ""
    return f"sound ({v['reason']})." if v["sound"] else f"NOT sound ({v['reason']}){instead}."


_RESULT = {
    "ok": "ok",
    "reference": "ok (reference)",
    "nonfinite": "NON-FINITE",
    "differs": "DIFFERS",
    "error": "ERROR",
    "unsupported": "not supported here",
}


def _against_fp32(r: dict[str, Any], value: str, text: str) -> str:
    """A "vs fp32" cell: the reference's own, '-' when not measured, else ``text``."""
    return "reference" if r["status"] == "reference" else "-" if r[value] is None else text


def _result(r: dict[str, Any]) -> str:
    if r["detail"]:
        return f"{_RESULT[r['status']]}: {r['detail']}"
    scale = f" at loss scale {r['loss_scale']:g}" if r["loss_scale"] is not None else ""
    return _RESULT[r["status"]] + scale


def _loss_diff(r: dict[str, Any]) -> str:
    return _against_fp32(r, "loss_abs_diff", f"{r['loss_abs_diff'] or 0:.2g} / {_pct(r['loss_rel_diff'])}")


def _grad_diff(r: dict[str, Any]) -> str:
    return _against_fp32(r, "grad_norm_rel_diff", f"{_pct(r['grad_norm_rel_diff'])} ({r['grad_norm_worst']})")


CHECK_COLUMNS: list[tuple[str, Any]] = [
    ("precision", lambda r: r["precision"]),
    ("trains here", lambda r: "yes" if r["trains_here"] else f"no: {r['note']}"),
    ("loss", lambda r: "-" if r["loss"] is None else f"{r['loss']:.6g}"),
    ("vs fp32: abs / rel", _loss_diff),
    ("max grad-norm diff", _grad_diff),
    ("result", _result),
]


def format_check(report: dict[str, Any]) -> str:
    """Markdown, like the rest of doctor's report: a table per precision and the verdict."""
    v = report["verdict"]
    lines = [
        "### Precisions: one forward/backward per precision against fp32",
        "",
        f"- model: {report['model']}",
        f"- device: {report['device']} (fp32 reference without TF32)",
        "",
        render_table(report["results"], CHECK_COLUMNS),
        "",
        f"Verdict: precision auto uses {v['auto']} on this device: {_sound(v)}",
        *(
            f"- on a GPU with {g['gpu']}, auto would use {g['auto']}: {_sound(g)}"
            for g in v.get("on_gpu", [])
        ),
        "",
        f"(Limits: loss {100 * LOSS_RTOL:g} %, gradient norm {100 * GRAD_RTOL:g} % from fp32; one batch, "
        "so a model that overflows later in training is not caught.)",
    ]
    if "fp8" in report:
        lines += ["", *format_fp8(report["fp8"])]
    return "\n".join(lines)


def _names(items: list[str]) -> str:
    more = f" and {len(items) - FP8_LISTED} more" if len(items) > FP8_LISTED else ""
    return ", ".join(items[:FP8_LISTED]) + more


def format_fp8(plan: dict[str, Any]) -> list[str]:
    """The fp8 section of the text report: where it runs, and its layers."""
    size = f"in x out >= {plan['min_size']}" if plan["min_size"] else "torchao's H100 size thresholds"
    lines = [f"fp8 (asked for by name: --precision.mode=fp8; {plan['recipe']} recipe, {size}):"]
    lines.append(f"- this device: {'runs it' if plan['runs_here'] else 'no fp8: ' + plan['note']}")
    total = len(plan["converted"]) + len(plan["kept"])
    if plan["converted"]:
        converted = f"{len(plan['converted'])} of {total} linear layers would run in float8"
        lines.append(f"- {converted}: {_names(plan['converted'])}")
    else:
        ones = plan.get("with_min_size_1")
        lines.append(
            f"- none of its {total} linear layers would run in float8, so fp8 would be bf16-mixed in effect"
            + (f"; --precision.fp8_min_size=1 converts {ones}" if ones else "")
        )
    if plan["kept"]:
        lines.append(f"- kept in bf16: {_names(plan['kept'])}")
    per_layer = plan.get("per_layer") or {}
    if per_layer:
        lines.append(f"- {per_layer['line']}")
    if per_layer.get("layers"):
        lines.append(FP8Choice.from_dict(per_layer).table())
    return lines
