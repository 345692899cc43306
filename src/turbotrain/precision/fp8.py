"""``precision.mode = fp8``: bf16 autocast plus torchao's float8 training on the linear layers that
benefit.

torchao swaps the chosen ``nn.Linear`` layers for ``Float8Linear`` (dynamic scaling, recipe
``tensorwise`` or ``rowwise``): their matmuls run in float8 (e4m3 forward, e5m2 for the output
gradient), while the weights, gradients and optimizer state stay float32, so an fp8 checkpoint has
the same keys and dtypes as a bf16 one and loads into either. On a GPU the speed needs
``torch.compile`` (it fuses the scaling and casting around each matmul; eager fp8 is slower than
bf16); it needs compute capability >= 8.9 (Ada, Hopper, Blackwell). ``precision.fp8_emulate``
runs the same float8 rounding in higher-precision matmuls anywhere (CPU included): for
correctness tests only.

Which layers: both dimensions divisible by 16 (a float8 kernel requirement), the output layer only
with ``precision.fp8_lm_head``, none whose name starts with a ``precision.fp8_skip`` prefix, and a
size filter: ``precision.fp8_min_size`` (in x out features), or with 0 the thresholds torchao
measured on H100 for each recipe (small matmuls lose more to scaling than float8 gains).

Never picked by ``auto`` (it changes the math); falls back to bf16-mixed on non-finite steps,
where the float8 layers are swapped back to plain linears holding the same parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from ..config import PrecisionConfig, setting
from ..errors import ConfigError
from .core import BF16Mixed, DeviceCaps

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
OUTPUT_NAMES = ("lm_head", "output", "head")  # the output layer of a language model, by its usual names


def torchao_available() -> bool:
    """Whether torchao can be imported (cheap: no import). Tests patch it to see the refusal."""
    return importlib.util.find_spec("torchao") is not None


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao logs a warning per optional CUDA extension it cannot load (all of them on CPU) and
    torch one about an Enum it registers: noise, not news, at every import."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def float8_module() -> Any:
    """``torchao.float8`` (with ``Float8Linear``), imported on first use (two seconds; only fp8 runs pay it)."""
    with _quiet_import():
        import torchao.float8 as float8  # optional extra: turbotrain[fp8]
        from torchao.float8.float8_linear import Float8Linear
    float8.Float8Linear = Float8Linear
    return float8


def worth_converting(out_features: int, in_features: int, recipe: str, min_size: int) -> bool:
    """The size filter: ``min_size`` > 0 is a bound on in x out; 0 takes torchao's per-recipe
    thresholds (its H100 tables, torchao.float8's auto filter): N = out, K = in features."""
    if out_features % 16 or in_features % 16:
        return False
    if min_size:
        return out_features * in_features >= min_size
    n, k = out_features, in_features
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def output_layers(module: nn.Module) -> set[str]:
    """Names of the output layer(s): a linear named like one, or one whose weight an embedding shares (tied)."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return {name for name, m in module.named_modules() if isinstance(m, nn.Linear)
            and (name.rpartition(".")[2] in OUTPUT_NAMES or id(m.weight) in embeddings)}


class FP8(BF16Mixed):
    """bf16 autocast; float8 matmuls (torchao) in the linear layers the filter picks."""

    name = "fp8"
    fallback = "bf16-mixed"
    peak = "fp8"

    def __init__(self, device: torch.device | None = None, *, recipe: str = "tensorwise", emulate: bool = False,
                 min_size: int = 0, lm_head: bool = False, skip: tuple[str, ...] = ()) -> None:
        super().__init__(device)
        self.recipe, self.emulate, self.min_size, self.lm_head, self.skip = recipe, emulate, min_size, lm_head, skip
        self.converted: list[str] = []  # names of the layers that run in float8
        self.kept: list[str] = []  # linear layers left in bf16, with the reason

    def own_settings(self, settings: PrecisionConfig) -> PrecisionConfig:
        return dataclasses.replace(settings, fp8_recipe=self.recipe, fp8_emulate=self.emulate, fp8_min_size=self.min_size,
                                   fp8_lm_head=self.lm_head, fp8_skip=",".join(self.skip))

    @classmethod
    def from_settings(cls, device: torch.device, settings: PrecisionConfig) -> "FP8":
        skip = tuple(p.strip() for p in settings.fp8_skip.split(",") if p.strip())
        return cls(device, recipe=settings.fp8_recipe, emulate=settings.fp8_emulate, min_size=settings.fp8_min_size,
                   lm_head=settings.fp8_lm_head, skip=skip)

    @classmethod
    def check(cls, caps: DeviceCaps, settings: PrecisionConfig) -> None:
        """One line per refusal: no float8 hardware (without emulation), no torchao."""
        if not settings.fp8_emulate:
            if caps.type != "cuda":
                raise ConfigError(
                    f"precision.mode = 'fp8' needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper); on {caps.type} use "
                    f"{setting('precision.mode', 'fp32')}, or add {setting('precision.fp8_emulate', True)} to test correctness (slower)")
            if caps.capability is None or caps.capability < MIN_CAPABILITY:
                raise ConfigError(
                    f"precision.mode = 'fp8': this GPU (compute capability {caps.capability}) has no float8 tensor cores "
                    f"(>= 8.9 needed); use {setting('precision.mode', 'bf16-mixed')}, or add "
                    f"{setting('precision.fp8_emulate', True)} to test correctness (slower)")
        if caps.type == "cuda" and not caps.bf16:
            raise ConfigError(f"precision.mode = 'fp8' runs under bf16 autocast, which this GPU (compute capability "
                              f"{caps.capability}) lacks; use {setting('precision.mode', 'fp16-mixed')}")
        if not torchao_available():
            raise ConfigError("precision.mode = 'fp8' needs torchao, which is not installed: pip install 'turbotrain[fp8]' "
                              f"(or use {setting('precision.mode', 'bf16-mixed')})")
        if settings.fp8_emulate:
            warnings.warn("precision.fp8_emulate = true: float8 rounding emulated in higher-precision matmuls, for correctness "
                          "tests only (slower than bf16, and no float8 speed-up to measure)", stacklevel=4)

    # ------------------------------------------------------------------ the model transform

    def wants(self, module: nn.Module, name: str, outputs: set[str]) -> str:
        """'' when the linear ``name`` should run in float8, else why not."""
        if any(name.startswith(p) for p in self.skip):
            return "precision.fp8_skip"
        if name in outputs and not self.lm_head:
            return "output layer (precision.fp8_lm_head)"
        n, k = module.weight.shape
        if n % 16 or k % 16:
            return "dims not divisible by 16"
        if not worth_converting(n, k, self.recipe, self.min_size):
            return "below the size threshold (precision.fp8_min_size)"
        return ""

    def convert_module(self, module: nn.Module) -> nn.Module:
        float8 = float8_module()
        config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulate)
        outputs = output_layers(module)
        reasons = {name: self.wants(m, name, outputs) for name, m in module.named_modules() if type(m) is nn.Linear}
        float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda m, name: reasons.get(name) == "")
        self.converted = [name for name, m in module.named_modules() if isinstance(m, float8.Float8Linear)]
        self.kept = [f"{name}: {why}" for name, why in reasons.items() if why]
        if not self.converted:
            log.warning("precision fp8: no linear layer passed the filter (%s), so this run is bf16-mixed in effect; "
                        "a smaller %s converts more", "; ".join(self.kept[:3]) or "the model has none",
                        setting("precision.fp8_min_size", 1))
        return module

    def revert_module(self, module: nn.Module) -> nn.Module:
        """Float8 layers back to plain linears holding the same parameters (the optimizer's stay valid)."""
        float8 = float8_module()
        for parent in list(module.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, float8.Float8Linear):
                    plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                    plain.weight, plain.bias = child.weight, child.bias
                    setattr(parent, child_name, plain)
        return module

    def summary(self) -> dict[str, Any]:
        how = f"{self.recipe} recipe{', emulated (correctness only)' if self.emulate else ''}"
        return {"fp8": f"{how}: {len(self.converted)} linear layers in float8, {len(self.kept)} kept in bf16",
                "fp8_converted": self.converted, "fp8_kept_in_bf16": self.kept,
                "mfu_peak": "fp8 dense (datasheet)"}
