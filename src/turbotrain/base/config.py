"""Run configuration: the mechanism that collects, parses, validates and describes every setting.

Why: every knob is typed, documented (with its unit and range) and validated once, when the config
is built. Nothing downstream reads raw strings; the engine and the loop receive resolved objects.

Sources, later wins: field defaults < a TOML preset shipped in ``turbotrain/presets`` (or a TOML
file path) < ``--section.key=value`` overrides. Errors name the field and the valid values.

Who declares what: the run's own sections are in :mod:`.config_sections`; a plugin declares its
settings in its own file, as a frozen dataclass of :func:`knob` fields, and registers it here with
:func:`register_settings`: a model family (its fields join ``[model]``, or a section of its own
such as ``[moe]``), a precision (its fields join ``[precision]``, as fp8's ``fp8_*`` do). Its
rules that span fields, the one line for settings given where they do nothing, and the names its
settings had before they moved (:data:`MOVED`) come with the registration. ``import turbotrain``
imports every built-in plugin, so a config read anywhere knows all of them.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

from .config_fields import (
    AUTO,
    MAX_BATCH,
    MAX_SEED,
    MAX_STEPS,
    MAX_TIMEOUT_S,
    PRECISION_CHOICES,
    PRECISION_MODES,
    Names,
    audience,
    choice_error,
    in_range,
    knob,
    range_text,
    setting,
)
from .config_sections import (
    ARCHS,
    BATCH_PICKS,
    BEST_MODES,
    CHECKPOINTING_MODES,
    CHOOSE_MODES,
    COMPILE_MODES,
    COMPILE_SCOPES,
    CUDA_GRAPH_MODES,
    DATA_BATCHINGS,
    DIST_STRATEGIES,
    LR_SCALINGS,
    NONFINITE_POLICIES,
    OOM_POLICIES,
    OPTIM_IMPLEMENTATIONS,
    SCHEDULES,
    TOKENIZERS,
    BatchConfig,
    BestConfig,
    ChooseConfig,
    CompileConfig,
    DataConfig,
    DistributedConfig,
    MemoryConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    PrecisionConfig,
    RunSection,
    TrainConfig,
    check_run,
    unused_run,
)
from .errors import ConfigError

__all__ = [
    "ARCHS",
    "AUTO",
    "BATCH_PICKS",
    "BEST_MODES",
    "CHECKPOINTING_MODES",
    "CHOOSE_MODES",
    "COMPILE_MODES",
    "COMPILE_SCOPES",
    "CUDA_GRAPH_MODES",
    "DATA_BATCHINGS",
    "DIST_STRATEGIES",
    "LR_SCALINGS",
    "MAX_BATCH",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_TIMEOUT_S",
    "MODEL_SECTIONS",
    "MOVED",
    "NONFINITE_POLICIES",
    "OOM_POLICIES",
    "OPTIM_IMPLEMENTATIONS",
    "PRECISION_CHOICES",
    "PRECISION_MODES",
    "SCHEDULES",
    "SECTIONS",
    "TOKENIZERS",
    "BatchConfig",
    "BestConfig",
    "ChooseConfig",
    "CompileConfig",
    "DataConfig",
    "DistributedConfig",
    "MemoryConfig",
    "ModelConfig",
    "MonitorConfig",
    "Names",
    "OptimConfig",
    "PrecisionConfig",
    "RunConfig",
    "RunSection",
    "TrainConfig",
    "audience",
    "choice_error",
    "describe",
    "from_dict",
    "in_range",
    "knob",
    "load_config",
    "migrate",
    "parse_overrides",
    "preset_names",
    "range_text",
    "read_preset",
    "register_settings",
    "setting",
    "to_toml",
    "validate",
]


@dataclass(frozen=True)
class RunConfig:
    """The whole run. Each attribute is one concern's config; see ``turbotrain train --help-config``.
    A plugin's own section (``moe``) is an attribute too, added when the plugin registers it."""

    preset: str = knob("gpt-tiny", "the preset this config started from")
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    best: BestConfig = field(default_factory=BestConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    choose: ChooseConfig = field(default_factory=ChooseConfig)

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


SECTIONS: dict[str, type] = {}
"""Every section by name, in ``--help-config`` order: the run's own and those plugins registered."""

MODEL_SECTIONS = Names("model")
"""The sections that decide the model's tensors (a checkpoint fits or not): ``[model]`` and the
families' own sections (``[moe]``)."""

MOVED: dict[str, str] = {}
"""Settings that moved (old ``section.key`` -> new), declared by the plugin that owns them: a file
written before the move (a saved run's config.toml, a preset) is read with them moved; a new
command line or dict that still names the old place gets one line naming the new one."""


# ----------------------------------------------------------------------------- plugin settings


@dataclass(frozen=True)
class Registration:
    """One plugin's settings (see :func:`register_settings`)."""

    section: str
    cls: type
    names: tuple[str, ...]  # the settings it declared, keys of ``section``
    check: Callable[[RunConfig], None] | None
    unused: Callable[[RunConfig, Sequence[str]], str] | None


REGISTERED: list[Registration] = []

# what a dataclass generates from its fields (copied onto a section grown in place; __setattr__ and
# __delattr__ stay the original's, so the frozen check keeps naming the class)
_GENERATED = ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__", "__dataclass_fields__")


def _registered_default(self: Any, name: str) -> Any:
    """A section object made before a plugin added field ``name`` reads the field's default."""
    f = type(self).__dataclass_fields__.get(name)
    if f is None or name.startswith("__"):
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]


def _grow(cls: type, extra: list[tuple[str, Any, dataclasses.Field]], after: str | None = None) -> None:
    """Add fields to the frozen dataclass ``cls`` in place (torchtitan merges its config dataclasses
    with ``make_dataclass`` too; in place, so every module that imported ``cls``, and every pickle,
    keeps meaning the one class). The new fields go after field ``after`` (else at the end)."""
    hints = get_type_hints(cls)
    own = [(f.name, hints[f.name], _copy_field(f)) for f in fields(cls)]
    at = len(own) if after is None else [name for name, _, _ in own].index(after) + 1
    merged = dataclasses.make_dataclass(cls.__name__, [*own[:at], *extra, *own[at:]], frozen=True)
    for attr in _GENERATED:
        setattr(cls, attr, merged.__dict__[attr])
    for name, hint, f in extra:
        cls.__annotations__[name] = hint
        if f.default is not MISSING:
            setattr(cls, name, f.default)
    cls.__getattr__ = _registered_default  # type: ignore[attr-defined]


def _copy_field(f: dataclasses.Field) -> dataclasses.Field:
    return field(default=f.default, default_factory=f.default_factory, metadata=f.metadata)  # type: ignore[call-overload]


def _declared(cls: type) -> list[tuple[str, Any, dataclasses.Field]]:
    """``cls``'s fields as settings, each declared with :func:`knob` (help text; a range if numeric)."""
    if not (is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: settings are a @dataclass(frozen=True) of knob(...) fields")
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        numeric = isinstance(f.default, (int, float)) and not isinstance(f.default, bool)
        if "doc" not in f.metadata or (numeric and not range_text(f)):
            raise TypeError(
                f"{cls.__name__}.{f.name}: declare it with knob(default, help, ...), a number with its range (min=, max=)"
            )
        out.append((f.name, hints[f.name], _copy_field(f)))
    return out


def register_settings(
    section: str,
    cls: type,
    *,
    after: str | None = None,
    check: Callable[[RunConfig], None] | None = None,
    unused: Callable[[RunConfig, Sequence[str]], str] | None = None,
    moved: Mapping[str, str] | None = None,
    model_shape: bool = False,
) -> None:
    """Make the settings ``cls`` (a frozen dataclass of :func:`knob` fields, in the plugin's own
    file) part of every run config: parsed, validated, written, listed by ``--help-config``.

    ``section`` names an existing section: the fields join it (``precision.fp8_recipe``); a new
    name: ``cls`` is that section (``[moe]``, ``config.moe``), placed after section ``after``.
    ``check(config)`` raises a one-line :class:`ConfigError` for rules that span fields (run by
    :func:`validate`); ``unused(config, given)`` returns the one line for settings of ``cls`` the
    caller gave (flags, an override dict) where they would do nothing ("" where they apply; files
    are never held to it); ``moved`` maps a setting's old ``section.key`` to its key here;
    ``model_shape``: the section decides the model's tensors (resume compares it). Registering the
    same class again (a module reloaded) changes nothing."""
    declared = _declared(cls)
    names = tuple(name for name, _, _ in declared)
    key = (cls.__module__, cls.__qualname__)
    again = [r for r in REGISTERED if (r.cls.__module__, r.cls.__qualname__) == key and r.section == section]
    if again:
        REGISTERED[REGISTERED.index(again[0])] = Registration(section, cls, names, check, unused)
        return
    if section in SECTIONS:
        target = SECTIONS[section]
        clash = sorted(set(names) & {f.name for f in fields(target)})
        if clash:
            raise ValueError(f"{cls.__name__}: {section}.{clash[0]} is already a setting")
        _grow(target, declared)
    else:
        _grow(RunConfig, [(section, cls, field(default_factory=cls))], after=after)
        _index_sections()
    REGISTERED.append(Registration(section, cls, names, check, unused))
    MOVED.update({old: f"{section}.{new}" for old, new in (moved or {}).items()})
    if model_shape:
        MODEL_SECTIONS.add(section)


def _index_sections() -> None:
    SECTIONS.clear()
    SECTIONS.update(
        {f.name: f.default_factory for f in fields(RunConfig) if f.default_factory is not MISSING}  # type: ignore[misc]
    )


_index_sections()


# ----------------------------------------------------------------------------- presets


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
    given = {section: list(values) for section, values in extra.items()}
    message = unused_run(config, given)  # the run's own settings given where they would do nothing
    if message:
        raise ConfigError(message)
    for r in REGISTERED:  # settings given where they would do nothing: the plugin's one line
        given = [k for k in extra.get(r.section, {}) if k in r.names]
        message = r.unused(config, given) if given and r.unused is not None else ""
        if message:
            raise ConfigError(message)
    return config


# ----------------------------------------------------------------------------- validation


def validate(config: RunConfig) -> None:
    """Check every field against its choices and bounds, then the rules that span fields.

    Every float must be finite (a NaN passes every ``<`` check and an inf learning rate only
    fails after steps have run), every whole number must fit a 64-bit integer, every number lie in
    its field's declared range (``knob(min=, max=)``: what the code can really do). Then the rules
    that span fields: the run's own (:func:`~.config_sections.check_run`: the run name is one
    folder name, the device one turbotrain knows, ...) and each plugin's (its registration's
    ``check``)."""
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
    check_run(config)
    for r in REGISTERED:  # the plugins' rules that span fields
        if r.check is not None:
            r.check(config)


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
