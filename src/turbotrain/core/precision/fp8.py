"""``precision.mode = fp8``: bf16 autocast plus torchao's float8 training on the linear layers that
benefit (docs/fp8.md). Weights, gradients and optimizer state stay float32, so an fp8 checkpoint
loads into a bf16 run and back; under FSDP2, ``precision.fp8_all_gather`` all-gathers the float8
weights in float8 while the parameters keep their identity and the state dict stays plain.
Never picked by ``auto`` (it changes the math); falls back to bf16-mixed, in place.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ...base.config import PrecisionConfig, comma_list, knob, recast, setting
from ...base.errors import ConfigError, TurbotrainWarning, quiet_imports
from .core import BF16Mixed, DeviceCaps

log = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
OUTPUT_NAMES = ("lm_head", "output", "head")  # the output layer of a language model, by its usual names
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 scaling recipes
FP8_LAYER_CHOICES = ("filter", "timed")  # precision.fp8_layers: the size rule, or timing per layer
_SAME_NAMED = ("recipe", "emulate", "min_size", "lm_head", "all_gather")  # FP8's X is precision.fp8_X


@dataclass(frozen=True)
class FP8Settings(PrecisionConfig):
    """``[precision]`` of an fp8 run: the shared switches and fp8's own (``precision.fp8_*``)."""

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
    fp8_layer_recipes: str = knob(
        "",
        "mode 'fp8': comma-separated 'prefix=recipe' pairs: the linear layers whose names start with a "
        "prefix use that recipe instead of precision.fp8_recipe (fp8_layers = 'timed' writes the layers "
        "where the other recipe timed fastest)",
    )
    fp8_layers: str = knob(
        "filter",
        "mode 'fp8': which linear layers run in float8: 'filter' (the size rule above) or 'timed' (each "
        "distinct layer shape timed in bf16 and the recipe at the run's micro-batch, converted only where "
        "float8 is 5 % faster: core/precision/fp8_choice.py; the table in the run directory, cached)",
        choices=FP8_LAYER_CHOICES,
    )
    fp8_all_gather: bool = knob(
        False,
        "mode 'fp8' under FSDP2 (distributed.strategy = fsdp): all-gather the float8 layers' "
        "weights in float8 (torchao's enable_fsdp_float8_all_gather: half bf16's bytes, the scales "
        "precomputed in one all-reduce per step); tensorwise recipe only. Off by default, as in "
        "torchtitan: it only pays where the all-gather is exposed (many ranks, large layers) and its "
        "GPU speed is not measured here yet; no effect without FSDP2",
    )


def parse_layer_recipes(text: str) -> dict[str, str]:
    """``precision.fp8_layer_recipes`` ('prefix=recipe,...') as prefix -> recipe, else one line."""
    out: dict[str, str] = {}
    for entry in comma_list(text):
        prefix, _, recipe = entry.partition("=")
        if not prefix.strip() or recipe.strip() not in FP8_RECIPES:
            raise ConfigError(
                f"precision.fp8_layer_recipes: {entry!r} is not 'prefix=recipe' with a recipe of: "
                f"{', '.join(FP8_RECIPES)} (e.g. 'blocks.0.attn.=rowwise')"
            )
        out[prefix.strip()] = recipe.strip()
    return out


def float8_capable(caps: DeviceCaps) -> bool:
    """Whether ``caps`` has float8 tensor cores (CUDA compute capability >= 8.9): the rule's one owner."""
    return caps.type == "cuda" and caps.capability is not None and caps.capability >= MIN_CAPABILITY


def torchao_available() -> bool:
    """Whether torchao can be imported (cheap: no import). Tests patch it to see the refusal."""
    return importlib.util.find_spec("torchao") is not None


def float8_module() -> Any:
    """``torchao.float8``, imported on first use (two seconds: only fp8 runs pay it)."""
    with quiet_imports():
        import torchao.float8 as float8  # optional extra: turbotrain[fp8]
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    float8.Float8Linear = Float8Linear
    float8.WeightWithDynamicFloat8CastTensor = WeightWithDynamicFloat8CastTensor
    return float8


def worth_converting(out_features: int, in_features: int, recipe: str, min_size: int) -> bool:
    """The size filter: ``min_size`` > 0 bounds in x out; 0 takes torchao's per-recipe H100 thresholds."""
    if out_features % 16 or in_features % 16:
        return False
    if min_size:
        return out_features * in_features >= min_size
    n, k = out_features, in_features
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def convert_linears(
    module: nn.Module, recipes: dict[str, str], *, emulate: bool = False, all_gather: bool = False
) -> list[str]:
    """Swap the plain linears named in ``recipes`` for ``Float8Linear``; the float8 layers' names."""
    float8 = float8_module()
    by_recipe: dict[str, set[str]] = {}
    for name, recipe in recipes.items():
        by_recipe.setdefault(recipe, set()).add(name)
    for recipe, names in by_recipe.items():
        config = dataclasses.replace(
            float8.Float8LinearConfig.from_recipe_name(recipe),
            emulate=emulate,
            enable_fsdp_float8_all_gather=all_gather,
        )
        float8.convert_to_float8_training(
            module,
            config=config,
            module_filter_fn=lambda m, name, names=names: name in names and type(m) is nn.Linear,
        )
    return [name for name, m in module.named_modules() if isinstance(m, float8.Float8Linear)]


def output_layers(module: nn.Module) -> set[str]:
    """Names of the output layer(s): a linear named like one, or one whose weight an embedding shares (tied)."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return {
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.Linear)
        and (name.rpartition(".")[2] in OUTPUT_NAMES or id(m.weight) in embeddings)
    }


class FP8(BF16Mixed):
    """bf16 autocast; float8 matmuls (torchao) in the linear layers the filter picks."""

    name = "fp8"
    fallback = "bf16-mixed"
    peak = "fp8"
    settings = FP8Settings

    def __init__(
        self,
        device: torch.device | None = None,
        *,
        recipe: str = "tensorwise",
        emulate: bool = False,
        min_size: int = 0,
        lm_head: bool = False,
        skip: tuple[str, ...] = (),
        all_gather: bool = False,
        layer_recipes: dict[str, str] | None = None,
    ) -> None:
        super().__init__(device)
        self.layer_recipes = dict(layer_recipes or {})  # name prefix -> recipe where it is not ``recipe``
        self.recipe, self.emulate, self.min_size, self.lm_head = recipe, emulate, min_size, lm_head
        self.skip = skip
        self.all_gather = all_gather  # asked for; it acts only on a model FSDP2 shards
        self.converted: list[str] = []  # names of the layers that run in float8
        self.kept: list[str] = []  # linear layers left in bf16, with the reason
        self.all_gathered: list[nn.Module] = []  # models whose float8 weights FSDP2 all-gathers in float8
        # their state-dict hooks (plain weights in checkpoints, fresh scales on load), removed on revert
        self._hooks: list[Any] = []

    def own_settings(self, settings: PrecisionConfig) -> PrecisionConfig:
        return dataclasses.replace(
            recast(settings, FP8Settings),
            **{f"fp8_{name}": getattr(self, name) for name in _SAME_NAMED},
            fp8_skip=",".join(self.skip),
            fp8_layer_recipes=",".join(f"{k}={v}" for k, v in self.layer_recipes.items()),
        )

    @classmethod
    def from_settings(cls, device: torch.device, settings: PrecisionConfig) -> FP8:
        settings = recast(settings, FP8Settings)  # a section of another mode: fp8's defaults
        return cls(
            device,
            **{name: getattr(settings, f"fp8_{name}") for name in _SAME_NAMED},
            skip=tuple(comma_list(settings.fp8_skip)),
            layer_recipes=parse_layer_recipes(settings.fp8_layer_recipes),
        )

    @classmethod
    def check_settings(cls, settings: PrecisionConfig) -> None:
        """The float8 all-gather needs one scale per weight: the tensorwise recipe (every layer's)."""
        settings = recast(settings, FP8Settings)
        recipes = parse_layer_recipes(settings.fp8_layer_recipes)  # its own mistakes: one line
        if settings.fp8_all_gather and any(r != "tensorwise" for r in recipes.values()):
            raise ConfigError(
                "precision.fp8_all_gather = true needs the tensorwise recipe for every float8 layer; "
                f"precision.fp8_layer_recipes gives {settings.fp8_layer_recipes!r}: drop its rowwise entries or use "
                f"{setting('precision.fp8_all_gather', False)}"
            )
        if settings.fp8_all_gather and settings.fp8_recipe != "tensorwise":
            raise ConfigError(
                f"precision.fp8_all_gather = true needs precision.fp8_recipe = 'tensorwise' (torchao all-gathers "
                f"float8 weights with one scale per tensor), not {settings.fp8_recipe!r}; use "
                f"{setting('precision.fp8_recipe', 'tensorwise')} or {setting('precision.fp8_all_gather', False)}"
            )

    @classmethod
    def check(cls, caps: DeviceCaps, settings: PrecisionConfig) -> None:
        settings = recast(settings, FP8Settings)
        cls.check_settings(settings)  # a plugin object's own fields: no config load checked them
        if not settings.fp8_emulate:
            if caps.type != "cuda":
                raise ConfigError(
                    f"precision.mode = 'fp8' needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper); on {caps.type} use "
                    f"{setting('precision.mode', 'fp32')}, or add {setting('precision.fp8_emulate', True)} to test correctness (slower)"
                )
            if not float8_capable(caps):
                raise ConfigError(
                    f"precision.mode = 'fp8': this GPU (compute capability {caps.capability}) has no float8 tensor cores "
                    f"(>= 8.9 needed); use {setting('precision.mode', 'bf16-mixed')}, or add "
                    f"{setting('precision.fp8_emulate', True)} to test correctness (slower)"
                )
        if caps.type == "cuda" and not caps.bf16:
            raise ConfigError(
                f"precision.mode = 'fp8' runs under bf16 autocast, which this GPU (compute capability "
                f"{caps.capability}) lacks; use {setting('precision.mode', 'fp16-mixed')}"
            )
        if not torchao_available():
            raise ConfigError(
                "precision.mode = 'fp8' needs torchao, which is not installed: pip install 'turbotrain[fp8]' "
                f"(or use {setting('precision.mode', 'bf16-mixed')})"
            )
        if settings.fp8_emulate:
            warnings.warn(
                "precision.fp8_emulate = true: float8 rounding emulated in higher-precision matmuls, for correctness "
                "tests only (slower than bf16, and no float8 speed-up to measure)",
                TurbotrainWarning,
                stacklevel=4,
            )

    def wants(self, module: nn.Linear, name: str, outputs: set[str]) -> str:
        """'' when the linear ``name`` should run in float8, else why not."""
        if any(name.startswith(p) for p in self.skip):
            return "precision.fp8_skip"
        if name in outputs and not self.lm_head:
            return "output layer (precision.fp8_lm_head)"
        n, k = module.weight.shape
        if n % 16 or k % 16:
            return "dims not divisible by 16"
        if not worth_converting(n, k, self.recipe_of(name), self.min_size):
            return "below the size threshold (precision.fp8_min_size)"
        return ""

    def recipe_of(self, name: str) -> str:
        """The recipe of linear ``name``: its longest ``fp8_layer_recipes`` prefix, else ``fp8_recipe``."""
        hits = [p for p in self.layer_recipes if name.startswith(p)]
        return self.layer_recipes[max(hits, key=len)] if hits else self.recipe

    def layer_plan(self, module: nn.Module) -> dict[str, str]:
        """Every plain linear by name: '' when it would run in float8, else why not (no torchao needed)."""
        outputs = output_layers(module)
        return {
            name: self.wants(m, name, outputs) for name, m in module.named_modules() if type(m) is nn.Linear
        }

    def convert_module(self, module: nn.Module, *, sharded: bool = False) -> nn.Module:
        """Swap the linears the filter picks for ``Float8Linear``; with ``precision.fp8_all_gather``
        and ``sharded`` (FSDP2 shards the model next), their weights become the all-gather subclass."""
        all_gather = self.all_gather and sharded
        if self.all_gather and not sharded:
            log.info(
                "precision.fp8_all_gather: this model is not sharded by FSDP2, so there is no all-gather to run "
                "in float8; the weights stay plain (distributed.strategy = fsdp uses it)"
            )
        reasons = self.layer_plan(module)
        unmatched = [p for p in self.layer_recipes if not any(name.startswith(p) for name in reasons)]
        if unmatched:  # a recipe for no layer would do nothing: refused, as other such settings are
            raise ConfigError(
                f"precision.fp8_layer_recipes: the prefix {unmatched[0]!r} matches no linear layer of this model "
                f"(they are {', '.join(list(reasons)[:4])}{', ...' if len(reasons) > 4 else ''}); "
                "fix the prefix or drop its entry"
            )
        weights = {
            name: cast(nn.Linear, module.get_submodule(name)).weight
            for name, why in reasons.items()
            if not why
        }
        recipes = {name: self.recipe_of(name) for name in weights}
        self.converted = convert_linears(module, recipes, emulate=self.emulate, all_gather=all_gather)
        layers = {name: module.get_submodule(name) for name in self.converted}
        self.kept = [f"{name}: {why}" for name, why in reasons.items() if why]
        if all_gather and layers:
            self._gather_in_float8(module, layers, weights)
        if not self.converted:
            log.warning(
                "precision fp8: no linear layer passed the filter (%s), so this run is bf16-mixed in effect; %s",
                "; ".join(self.kept[:3]) or "the model has none",
                self.advice(reasons.values()),
            )
        return module

    def _gather_in_float8(
        self, module: nn.Module, layers: dict[str, nn.Module], weights: dict[str, torch.Tensor]
    ) -> None:
        """The float8 ``layers``' weights made the all-gather subclass, checkpoints kept plain."""
        for name, layer in layers.items():
            _keep_identity(layer, weights[name])
        subclass = float8_module().WeightWithDynamicFloat8CastTensor
        for m in module.modules():
            if any(isinstance(w, subclass) for w in m.parameters(recurse=False)):
                self._hooks += [
                    m.register_state_dict_post_hook(_plain_weights_in_state_dict),
                    m.register_load_state_dict_post_hook(_forget_precomputed_scales),
                ]
        self.all_gathered.append(module)

    def advice(self, reasons: Iterable[str]) -> str:
        """The settings that would convert layers kept out for ``reasons`` (none at its end)."""
        why = set(reasons)
        fixes = []
        if any(r.endswith("(precision.fp8_min_size)") for r in why) and self.min_size != 1:
            fixes.append(f"a smaller {setting('precision.fp8_min_size', 1)}")
        if any(r.endswith("(precision.fp8_lm_head)") for r in why):
            fixes.append(setting("precision.fp8_lm_head", True))
        if "precision.fp8_skip" in why:
            fixes.append(f"fewer precision.fp8_skip prefixes (now {','.join(self.skip)!r})")
        if fixes:
            return f"to convert some: {' or '.join(fixes)}"
        return (
            f"no fp8 setting changes that (float8 needs linear layers whose dimensions divide by 16); "
            f"use {setting('precision.mode', 'bf16-mixed')}"
        )

    def revert_module(self, module: nn.Module) -> nn.Module:
        """Float8 layers back to plain linears holding the same parameters, all-gather weights unwrapped."""
        float8 = float8_module()
        for layer in module.modules():
            if type(layer) is float8.Float8Linear:
                # In place, not a new module: FSDP2 (which sets the gathered weight on this very
                # object before each forward) and any hooks keep working; Float8Linear is an
                # nn.Linear with another forward, so the class is all that changes.
                layer.__class__ = nn.Linear
        _unwrap_all_gather_weights(module, float8.WeightWithDynamicFloat8CastTensor)  # a no-op without them
        self.all_gathered = [m for m in self.all_gathered if m is not module]
        if not self.all_gathered:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
        return module

    def optimizer_step(
        self, optimizer: Optimizer, finite: Tensor | bool, grad_scale: Tensor | None = None
    ) -> None:
        """The step, then (float8 all-gather) every weight's next scale in one all-reduce; no host sync."""
        super().optimizer_step(optimizer, finite, grad_scale)
        if self.all_gathered:
            precompute = float8_module().precompute_float8_dynamic_scale_for_fsdp
            for module in self.all_gathered:
                precompute(module)

    def mfu_peak(self) -> str:
        return self.peak if self.converted else BF16Mixed.peak  # no float8 matmul ran: bf16 is the ceiling

    def summary(self) -> dict[str, Any]:
        recipes = sorted({self.recipe_of(name) for name in self.converted}) or [self.recipe]
        how = f"{' and '.join(recipes)} recipe{'s' if len(recipes) > 1 else ''}"
        how += ", emulated (correctness only)" if self.emulate else ""
        gather = (
            "; FSDP2 all-gathers their weights in float8"
            if self.all_gathered
            else "; precision.fp8_all_gather asked for, but FSDP2 does not shard this model"
            if self.all_gather
            else ""
        )
        return {
            "fp8": f"{how}: {len(self.converted)} linear layers in float8, {len(self.kept)} kept in bf16{gather}",
            "fp8_converted": self.converted,
            "fp8_kept_in_bf16": self.kept,
            "fp8_all_gather": bool(self.all_gathered),
            "mfu_peak": f"{self.mfu_peak()} dense (datasheet)",
        }


def _keep_identity(layer: nn.Module, weight: torch.Tensor) -> None:
    """torchao gave ``layer`` a new Parameter wrapping ``weight``: swap their contents so ``weight``
    itself is the subclass (an optimizer built before ``setup`` and a tied weight keep it)."""
    wrapped: Any = layer.weight  # torchao's all-gather weight subclass (holds the plain tensor in _tensor)
    if wrapped is weight:
        return
    # torchao wrapped the Parameter object itself, which is about to change class
    wrapped._tensor = weight.detach()
    torch.utils.swap_tensors(weight, wrapped)
    layer.weight = weight


def _plain_weights_in_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict hook: all-gather float8 weights as plain float32 tensors (load without torchao)."""
    for name, _ in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if value is None:
            continue
        inner = getattr(value, "_local_tensor", value)
        if not hasattr(inner, "fsdp_pre_all_gather"):
            continue
        if inner is value:
            state_dict[prefix + name] = inner._tensor
            continue
        from torch.distributed.tensor import DTensor  # only sharded runs get here

        state_dict[prefix + name] = DTensor.from_local(
            inner._tensor,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )


def _forget_precomputed_scales(module: nn.Module, incompatible_keys: Any) -> None:
    """Load hook: drop the precomputed scales (they describe the weights before the load)."""
    for _, weight in module.named_parameters(recurse=False):
        inner = getattr(weight, "_local_tensor", weight)
        if hasattr(inner, "_precomputed_scale"):
            inner._precomputed_scale = None


def _unwrap_all_gather_weights(module: nn.Module, subclass: type) -> None:
    """Every all-gather weight back to a plain tensor, Parameters kept; under FSDP2 its float8 state is
    dropped too (torch's private state, torch 2.13: the fallback test in tests/distributed checks it)."""
    from torch.distributed.fsdp import FSDPModule  # on first use, as core/distributed.py imports FSDP2

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group: Any = m._get_fsdp_state()._fsdp_param_group  # torch's private state, untyped here: see above
        wrapped = (
            [f for f in group.fsdp_params if isinstance(f._sharded_local_tensor, subclass)]
            if group is not None
            else []
        )
        if not wrapped:
            continue
        m.reshard()  # every parameter sharded: the module holds the sharded parameters again
        for fsdp_param in wrapped:
            fsdp_param.sharded_param._local_tensor = fsdp_param._sharded_local_tensor._tensor
            fsdp_param._sharded_param_data = fsdp_param._sharded_param_data._tensor
            fsdp_param.all_gather_outputs = []
            fsdp_param._unsharded_inner_tensors = []
            fsdp_param.__dict__.pop("_unsharded_param", None)
    for p in module.parameters():
        if isinstance(p, subclass):
            grad, plain = p.grad, cast(Any, p)._tensor  # torchao's subclass holds the plain tensor
            torch.utils.swap_tensors(p, nn.Parameter(plain, requires_grad=p.requires_grad))
            p.grad = grad
