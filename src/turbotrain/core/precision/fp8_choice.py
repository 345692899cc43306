"""fp8 per layer, chosen by timing (docs/fp8.md): each distinct linear shape timed in bf16, tensorwise
and rowwise, a layer converted in its fastest recipe only where that beats bf16 by ``margin``; kept in
the kit's cache. The timer is a parameter: tests inject one (CPU float8 is emulation only).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ...base.atomic import atomic_write
from ...base.batch import map_tensors
from ...base.config import RunConfig, comma_list, recast
from ...base.config_plugins import Start, register_start
from ...base.version import package_version
from ...parts.data.sources import default_cache_dir as cache_root
from ...parts.hardware import device_name
from ..meter import cache as meter_cache
from ..meter.clock import time_call
from ..meter.table import figure, render_table
from .fp8 import FP8, FP8_RECIPES, FP8Settings, convert_linears

log = logging.getLogger(__name__)

BF16 = "bf16"
RECIPES = (BF16, *FP8_RECIPES)
MARGIN = 0.05  # a float8 recipe must be at least 5 % faster than bf16: timing noise never flips a layer
TABLE_JSON, TABLE_MD = "fp8_layers.json", "fp8_layers.md"
WHAT = "fp8 per layer"

Shape = tuple[int, int, int]  # M (tokens per micro-batch), K (in features), N (out features)
Timer = Callable[[Shape, str], float]  # (shape, recipe) -> ms for forward + backward


@dataclass
class LayerChoice:
    """One linear layer: its shape, the ms per recipe (of its shape) and what it runs in."""

    layer: str
    shape: Shape
    ms: dict[str, float]
    choice: str  # 'bf16', 'tensorwise' or 'rowwise'


@dataclass
class FP8Choice:
    """The per-layer decision: ``layers`` (every candidate), ``kept`` (the others, with fp8's reason)."""

    layers: list[LayerChoice]
    kept: dict[str, str] = field(default_factory=dict)
    margin: float = MARGIN
    cached: bool = False
    key: str = ""

    @property
    def converted(self) -> dict[str, str]:
        """Layer name -> recipe, for the layers that run in float8."""
        return {c.layer: c.choice for c in self.layers if c.choice != BF16}

    @property
    def line(self) -> str:
        """One line for the log and the summary."""
        n = len(self.converted)
        if not n:
            return (
                f"fp8 per layer: no linear layer is faster in float8 than in bf16 by {self.margin:.0%} "
                f"({len(self.layers)} timed), so this run trains in bf16"
            )
        recipes = sorted(set(self.converted.values()))
        return (
            f"fp8 per layer: {n} of {len(self.layers)} timed linear layers in float8 "
            f"({', '.join(recipes)}), the rest in bf16 (faster there, or within {self.margin:.0%})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FP8Choice:
        layers = [
            LayerChoice(c["layer"], tuple(c["shape"]), dict(c["ms"]), c["choice"]) for c in data["layers"]
        ]
        return cls(
            layers, dict(data.get("kept", {})), data["margin"], bool(data.get("cached")), data.get("key", "")
        )

    def table(self) -> str:
        """The markdown table: layer, shape, ms per recipe, choice."""
        columns: list[tuple[str, Callable[[LayerChoice], str]]] = [
            ("layer", lambda c: c.layer),
            ("M x K x N", lambda c: " x ".join(map(str, c.shape))),
            *((f"{r} ms", lambda c, r=r: figure(c.ms.get(r), ".3f")) for r in RECIPES),
            ("choice", lambda c: f"**{c.choice}**"),
        ]
        return render_table(self.layers, columns)

    def write(self, run_dir: Path) -> None:
        """``fp8_layers.json`` and ``fp8_layers.md`` in the run directory."""
        atomic_write(run_dir / TABLE_JSON, json.dumps(self.to_dict(), indent=1) + "\n")
        atomic_write(run_dir / TABLE_MD, f"{self.line}\n\n{self.table()}\n")


def candidates(model: nn.Module, fp8: FP8) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """The linears fp8's filter accepts with no size threshold, as name -> (K, N); the others with why."""
    plan = FP8(lm_head=fp8.lm_head, skip=fp8.skip, min_size=1).layer_plan(model)
    shapes, kept = {}, {}
    for name, why in plan.items():
        if why:
            kept[name] = why
        else:
            n, k = cast(nn.Linear, model.get_submodule(name)).weight.shape  # layer_plan lists nn.Linear only
            shapes[name] = (int(k), int(n))
    return shapes, kept


def decide(ms: dict[str, float], margin: float = MARGIN) -> str:
    """The fastest float8 recipe if it beats bf16 by ``margin``, else 'bf16'."""
    fp8 = {r: t for r, t in ms.items() if r != BF16}
    if not fp8:
        return BF16
    best = min(fp8, key=fp8.__getitem__)
    return best if fp8[best] < ms[BF16] * (1 - margin) else BF16


def layer_rows(model: nn.Module, names: Iterable[str], forward: Callable[[], Any]) -> dict[str, int]:
    """M of each named linear layer: its input's rows in one ``forward()``, without gradients."""
    rows: dict[str, int] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:  # returns None: the input is kept
            rows.setdefault(name, args[0].numel() // args[0].shape[-1])

        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(record(name)) for name in names]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return rows


def choose_fp8_layers(
    model: nn.Module,
    tokens_per_micro: int | dict[str, int],
    fp8: FP8,
    timer: Timer,
    *,
    cache_dir: Path | None = None,
    key_parts: dict[str, Any] | None = None,
) -> FP8Choice:
    """Time each distinct candidate shape once per recipe and choose per layer (cached)."""
    shapes, kept = candidates(model, fp8)
    if isinstance(tokens_per_micro, int):
        m_of = dict.fromkeys(shapes, tokens_per_micro)
    else:
        m_of = {name: tokens_per_micro[name] for name in shapes if name in tokens_per_micro}
        kept.update({name: "did not run in the forward pass" for name in shapes if name not in m_of})
    full = {name: (m_of[name], k, n) for name, (k, n) in shapes.items() if name in m_of}
    distinct = sorted(set(full.values()))
    settings = {"recipes": RECIPES, "margin": MARGIN, **(key_parts or {})}
    material = meter_cache.material(settings, {"shapes": distinct}, str(settings.pop("device", "")))
    key = meter_cache.key_of(material)
    path = cache_dir / f"{key}.json" if cache_dir is not None else None

    def check(value: Any) -> FP8Choice:
        choice = FP8Choice.from_dict(value)
        if {c.layer for c in choice.layers} != set(full):
            raise ValueError("its layers are not this model's")
        if not all(isinstance(c.ms.get(r), (int, float)) for c in choice.layers for r in RECIPES):
            raise ValueError(f"a layer lacks the ms of a recipe ({', '.join(RECIPES)})")
        choice.cached = True
        return choice

    cached = meter_cache.read(path, WHAT, material, check) if path is not None else None
    if cached is not None:
        return cached
    ms = {shape: {r: float(timer(shape, r)) for r in RECIPES} for shape in distinct}
    layers = [LayerChoice(name, shape, ms[shape], decide(ms[shape])) for name, shape in full.items()]
    choice = FP8Choice(layers, kept, key=key)
    if path is not None:
        meter_cache.write(path, WHAT, material, choice.to_dict())
    return choice


def default_cache_dir() -> Path:
    """``<cache>/fp8_layers`` (``$XDG_CACHE_HOME/turbotrain``, ``~/.cache/turbotrain`` without it)."""
    return cache_root() / "fp8_layers"


def timing_settings(device: torch.device, compile: bool, emulate: bool) -> dict[str, Any]:
    """The settings besides the shapes that a timing depends on: the device, torchao, compile."""
    torchao = package_version("torchao")
    return {"device": device_name(device), "torchao": torchao, "compile": compile, "emulate": emulate}


def linear_timer(
    device: torch.device, *, compile: bool = False, emulate: bool = False, repeats: int = 10, warmup: int = 3
) -> Timer:
    """The default timer: ``nn.Linear(K, N)`` forward + backward at M x K under bf16 autocast."""

    def timer(shape: Shape, recipe: str) -> float:
        m, k, n = shape
        layer = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
        if recipe != BF16:
            convert_linears(layer, {"0": recipe}, emulate=emulate)
        fn: Callable[[torch.Tensor], torch.Tensor] = torch.compile(layer) if compile else layer
        x = torch.randn(m, k, device=device, requires_grad=True)

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                fn(x).sum().backward()

        return time_call(step, device, repeats, warmup).median

    return timer


def time_fp8_layers(
    model: nn.Module,
    forward: Callable[[], Any] | dict[str, int],
    device: torch.device,
    fp8: FP8,
    *,
    compile: bool = True,
    cache_dir: Path | None = None,
    timer: Timer | None = None,
) -> FP8Choice:
    """The decision for ``model`` at the micro-batch ``forward()`` runs (or M per layer), timed."""
    rows = forward if isinstance(forward, dict) else layer_rows(model, candidates(model, fp8)[0], forward)
    return choose_fp8_layers(
        model,
        rows,
        fp8,
        timer or linear_timer(device, compile=compile, emulate=fp8.emulate),
        cache_dir=cache_dir,
        key_parts=timing_settings(device, compile, fp8.emulate),
    )


def choose_for_run(
    config: RunConfig,
    model: nn.Module,
    example: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    run_dir: Path,
    device: torch.device,
    *,
    timer: Timer | None = None,
    cache_dir: Path | None = None,
) -> tuple[RunConfig, FP8Choice]:
    """``precision.fp8_layers = 'timed'`` for a run (M from a meta forward of ``example``): the config
    whose fp8 filter converts exactly the chosen layers, and the decision, written to ``run_dir``."""
    own = recast(config.precision, FP8Settings)  # the run's [precision], typed as fp8's
    fp8 = FP8.from_settings(device, own)
    names, _ = candidates(model, fp8)
    try:
        shadow = copy.deepcopy(model).to("meta")
        rows = layer_rows(
            shadow, names, lambda: loss_fn(shadow, map_tensors(example, lambda t: t.to("meta")))
        )
    except Exception:  # a model that cannot run on meta tensors: one real forward on the host
        rows = layer_rows(model, names, lambda: loss_fn(model, example))
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    choice = time_fp8_layers(
        model, rows, device, fp8, compile=config.compile.scope != "off", cache_dir=cache_dir, timer=timer
    )
    # each layer in its fastest recipe (tensorwise alone under the float8 all-gather, which needs
    # one scale per weight), or bf16 where neither beats it by the margin
    recipes = (BF16, "tensorwise") if own.fp8_all_gather else RECIPES
    for layer in choice.layers:
        layer.choice = decide({r: layer.ms[r] for r in recipes if r in layer.ms}, choice.margin)
    choice.write(run_dir)
    return config.replace(precision=_filter_settings(own, choice)), choice


def _filter_settings(own: FP8Settings, choice: FP8Choice) -> dict[str, Any]:
    """The fp8 filter that converts exactly the chosen layers (the others in ``fp8_skip``)."""
    skip = comma_list(own.fp8_skip)
    # whole names as prefixes: no GPT layer name is the start of another one's
    skip += [c.layer for c in choice.layers if c.choice == BF16 and c.layer not in skip]
    layer_recipes = {c.layer: c.choice for c in choice.layers if c.choice not in (BF16, own.fp8_recipe)}
    return {
        "fp8_skip": ",".join(skip),
        "fp8_min_size": 1,
        "fp8_layer_recipes": ",".join(f"{name}={recipe}" for name, recipe in layer_recipes.items()),
    }


def timed_layers(start: Start) -> tuple[RunConfig, dict[str, Any]]:
    """fp8's start hook: :func:`choose_for_run` at the run's micro-batch (8 before the batch search)."""
    c = start.config
    if not isinstance(c.precision, FP8Settings) or c.precision.fp8_layers != "timed":
        return c, {}
    assert start.model is not None and start.example is not None and start.loss_fn is not None
    micro = c if isinstance(c.batch.micro, int) else c.replace(batch={"micro": 8})
    c, choice = choose_for_run(
        c, start.model, start.example(micro), start.loss_fn, start.run_dir, start.device
    )
    log.info(choice.line)
    return c, {"fp8_layers": choice.to_dict()}  # summary.md's "fp8 per layer" table


register_start("fp8", f"precision.mode={FP8.name}", settle=timed_layers)
